"""Each `Timeouts` field once read off the class is now the instance's: set small, it is seen.

`read_stall` and `late_read` on a UCX worker through a fake NIXL agent (the seam: a READ
that never ends, a handle that refuses release while in flight); `header`, `idle` and
`body` on a real registry service over raw sockets that send slowly. Each bound is given
far below its default, and observed well before that default could have fired.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest

from pdkv.errors import PeerLostError
from tests.http_probe import closed_by_server
from transfer.deadline import Deadline
from transfer.lanes.ucx.worker import Worker
from transfer.registry.server import RegistryServer
from transfer.timeouts import Timeouts

DEFAULTS = Timeouts()


# ---- the UCX worker: read_stall, late_read --------------------------------------------------
class _StuckHandle:
    """A posted READ part that never ends and refuses release while in flight, as NIXL's does."""

    def __init__(self) -> None:
        self.releases: list[float] = []  # when each release was tried
        self.released = False

    def release(self) -> None:
        self.releases.append(time.monotonic())
        if len(self.releases) == 1:
            raise RuntimeError("transfer still in progress")
        self.released = True


class _StuckAgent:
    def __init__(self) -> None:
        self.handles: list[_StuckHandle] = []

    def create_backend(self, name: str, params: Any) -> None:
        pass

    def get_xfer_descs(self, rows: np.ndarray, mem: str) -> np.ndarray:
        return rows

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str) -> _StuckHandle:
        self.handles.append(_StuckHandle())
        return self.handles[-1]

    def transfer(self, handle: _StuckHandle) -> str:
        return "PROC"

    def check_xfer_state(self, handle: _StuckHandle) -> str:
        return "PROC"


def _worker(timeouts: Timeouts) -> tuple[Worker, _StuckAgent]:
    agent = _StuckAgent()
    nixl = SimpleNamespace(nixl_agent=lambda name, conf: agent, nixl_agent_config=lambda **kw: None)
    return Worker(nixl, "stuck", timeouts), agent  # type: ignore[arg-type]


def _read(worker: Worker) -> float:
    """A one-row READ with a far deadline; the seconds until it raised."""
    rows = np.array([[4096, 4096, 0]], dtype=np.int64)
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match="made no end"):
        worker.read_blocking("owner", rows, rows.copy(), "DRAM", Deadline.after(60), threading.Event())
    return time.monotonic() - t0


def test_read_stall_is_the_instances():
    worker, agent = _worker(Timeouts(read_stall=0.2, late_read=0.05))
    try:
        took = _read(worker)
    finally:
        worker.executor.shutdown()
    assert 0.2 <= took < DEFAULTS.read_stall / 2  # the instance's 0.2 s, not the default 10 s
    assert agent.handles[0].released  # waited for, then released: no handle left behind


def test_late_read_is_the_instances():
    late = 0.6
    worker, agent = _worker(Timeouts(read_stall=0.05, late_read=late))
    try:
        _read(worker)
    finally:
        worker.executor.shutdown()
    handle = agent.handles[0]
    refused, released = handle.releases
    assert handle.released
    # The part in flight at the failure was waited for the instance's `late_read`, then released.
    assert late <= released - refused < DEFAULTS.late_read / 2


def test_a_transport_gives_its_workers_its_timeouts():
    from transfer.lanes.ucx.transport import UcxTransport

    timeouts = Timeouts(read_stall=0.7, late_read=0.9, connect=1.5)
    transport = UcxTransport("timeouts-probe", workers=2, timeouts=timeouts, notifies=True)
    try:
        agents = [*transport._workers, transport._notifier]
        assert [(w.read_stall, w.late_read) for w in agents] == [(0.7, 0.9)] * 3
        assert transport.timeouts is timeouts
    finally:
        asyncio.run(transport.aclose())


# ---- a service: header, idle, body ------------------------------------------------------------
async def _registry(**fields: float) -> RegistryServer:
    server = RegistryServer(timeouts=Timeouts(**fields))
    await server.start()
    return server


async def _connect(server: RegistryServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(server.url)
    return await asyncio.open_connection(parts.hostname, parts.port)


async def _one_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """A keep-alive GET answered in full; its status line."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status = await asyncio.wait_for(reader.readline(), 5)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
    await asyncio.wait_for(reader.readexactly(length), 5)
    return status


async def test_header_is_the_instances():
    server = await _registry(header=0.3, idle=30.0)
    try:
        reader, writer = await _connect(server)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ... and never the blank line
        t0 = time.monotonic()
        assert await closed_by_server(reader, DEFAULTS.header / 2)  # the default would wait 10 s
        assert time.monotonic() - t0 >= 0.2
        writer.close()
        # Answered, a connection waits for `idle` (30 s), not `header`.
        reader, writer = await _connect(server)
        assert b" 200 " in await _one_request(reader, writer)
        assert not await closed_by_server(reader, 1.5)
        writer.close()
    finally:
        await server.aclose()


async def test_idle_is_the_instances():
    server = await _registry(header=30.0, idle=0.3)
    try:
        reader, writer = await _connect(server)
        assert b" 200 " in await _one_request(reader, writer)
        t0 = time.monotonic()
        assert await closed_by_server(reader, DEFAULTS.idle / 4)  # the default would wait 30 s
        assert time.monotonic() - t0 >= 0.2
        writer.close()
        # A connection that has sent nothing yet is a header's wait (30 s), not `idle`'s.
        reader, writer = await _connect(server)
        assert not await closed_by_server(reader, 1.5)
        writer.close()
    finally:
        await server.aclose()


@pytest.mark.parametrize("length", [100, 1 << 20])  # read whole, and read in chunks into a map
async def test_body_is_the_instances(length):
    server = await _registry(body=0.3)
    try:
        reader, writer = await _connect(server)
        writer.write(
            f"PUT /v1/engines/e/ranks/0 HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-msgpack\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
            + b"\x00" * 10  # ... and the rest never comes
        )
        t0 = time.monotonic()
        status = await asyncio.wait_for(reader.readline(), DEFAULTS.body / 4)  # the default: 30 s
        assert b" 504 " in status  # DeadlineExceeded
        assert time.monotonic() - t0 >= 0.2
        assert b"not received within 0.3s" in await asyncio.wait_for(reader.read(1 << 16), 5)
        writer.close()
    finally:
        await server.aclose()
