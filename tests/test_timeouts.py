"""Each `Timeouts` field once read off the class is now the instance's: set small, it is seen.

`read_stall` on a UCX worker through a fake NIXL agent (the seam: a READ that never ends, a
handle that refuses release while in flight); `header`, `idle` and `body` on a real registry
service over raw sockets that send slowly. Each bound is given far below its default, and
observed well before that default could have fired. What an abandoned READ does to its
worker's agent (dropped, its peers loaded again) is shown through the same fake.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest

from pdkv.errors import PeerLostError, TransferError
from tests.http_probe import closed_by_server
from transfer.deadline import Deadline
from transfer.lanes.ucx.worker import Worker
from transfer.registry.server import RegistryServer
from transfer.timeouts import Timeouts

DEFAULTS = Timeouts()


# ---- the UCX worker: read_stall, and an abandoned READ's agent --------------------------------
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
    """NIXL's agent as a worker calls it; its READs never end."""

    def __init__(self) -> None:
        self.handles: list[_StuckHandle] = []
        self.peers: list[str] = []  # loaded, in order

    def create_backend(self, name: str, params: Any) -> None:
        pass

    def register_memory(self, tensors: list[Any]) -> list[Any]:
        return tensors

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.peers.append(metadata.decode())
        return metadata  # the fake's blob is the peer's name

    def make_connection(self, peer: str) -> None:
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


def _worker(timeouts: Timeouts) -> tuple[Worker, list[_StuckAgent]]:
    """A worker on fake agents (each one it makes, in order), with peers "owner" and "other" loaded."""
    agents: list[_StuckAgent] = []

    def make(name: str, conf: Any) -> _StuckAgent:
        agents.append(_StuckAgent())
        return agents[-1]

    worker = Worker(SimpleNamespace(nixl_agent=make, nixl_agent_config=lambda **kw: None), "stuck", timeouts)  # type: ignore[arg-type]
    worker.register(["pool"])
    for peer in ("owner", "other"):
        worker.load_peer(peer.encode())
    return worker, agents


def _read(worker: Worker, peer: str = "owner") -> float:
    """A one-row READ with a far deadline; the seconds until it raised."""
    rows = np.array([[4096, 4096, 0]], dtype=np.int64)
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match="made no end"):
        worker.read_blocking(peer, rows, rows.copy(), "DRAM", Deadline.after(60), threading.Event())
    return time.monotonic() - t0


def test_read_stall_is_the_instances():
    worker, agents = _worker(Timeouts(read_stall=0.2))
    try:
        took = _read(worker)
    finally:
        worker.executor.shutdown()
    assert 0.2 <= took < DEFAULTS.read_stall / 2  # the instance's 0.2 s, not the default 10 s


def test_an_abandoned_read_drops_its_agent_and_only_its_peer_must_connect_again():
    """A part that made no end is abandoned with the agent, at once (no wait for it): a new
    agent registers the same memory, loads the other peer again on its first use, and refuses
    the abandoned READ's peer as lost until the transport loads it anew."""
    worker, agents = _worker(Timeouts(read_stall=0.05))
    try:
        took = _read(worker)
        assert took < 1.0 and worker.drops == 1
        assert agents[0].handles[0].releases and not agents[0].handles[0].released  # refused: gone with its agent
        rows = np.array([[4096, 4096, 0]], dtype=np.int64)
        with pytest.raises(PeerLostError, match="connect again"):
            worker.read_blocking("owner", rows, rows.copy(), "DRAM", Deadline.after(60), threading.Event())
        assert len(agents) == 2 and agents[1].peers == []  # a new agent, nothing loaded into it yet
        _read(worker, "other")  # loaded again on its first use (its READ is stuck too: a third agent)
        assert agents[1].peers == ["other"] and worker.drops == 2
        assert worker.load_peer(b"owner") == "owner"  # connected anew by the transport
        _read(worker, "owner")
        assert agents[2].peers == ["owner"]
    finally:
        worker.executor.shutdown()


def test_a_stopped_reads_parts_in_flight_are_abandoned_after_a_short_grace():
    """A stop (the fetch cancelled) ends a READ whose part makes no end in well under its stall
    bound: the part goes with the agent."""
    worker, agents = _worker(Timeouts(read_stall=30))
    stop = threading.Event()
    rows = np.array([[4096, 4096, 0]], dtype=np.int64)
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TransferError, match="stopped"):
            worker.read_blocking("owner", rows, rows.copy(), "DRAM", Deadline.after(60), stop)
    finally:
        worker.executor.shutdown()
    assert time.monotonic() - t0 < 5 and worker.drops == 1


class _Core:
    """NIXL's C++ agent under its Python one: what must be gone once a READ is abandoned."""


class _HeldHandle(_StuckHandle):
    """A part whose handle holds its agent in a cycle, as NIXL's Python handle may."""

    def __init__(self, agent: _FailingAgent) -> None:
        super().__init__()
        self.agent, self.cycle = agent, self


class _FailingAgent(_StuckAgent):
    """Its READ's state check fails deep in the agent, as NIXL's raise from C++."""

    def __init__(self) -> None:
        super().__init__()
        self.agent = _Core()
        self.checks = 0

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str) -> _StuckHandle:
        self.handles.append(_HeldHandle(self))
        return self.handles[-1]

    def check_xfer_state(self, handle: _StuckHandle) -> str:
        self.checks += 1
        return "PROC" if self.checks < 3 else self._state(handle)

    def _state(self, handle: _StuckHandle) -> str:
        raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")  # this frame holds the agent


def test_an_abandoned_agent_is_gone_when_the_read_raises_whatever_held_it():
    """Frames of the agent's own error and a young cycle through a handle held the agent; the
    drop frees it anyway (over RDMA a live agent's READ could still land)."""
    agents: list[_FailingAgent] = []

    def make(name: str, conf: Any) -> _FailingAgent:
        agents.append(_FailingAgent())
        return agents[-1]

    worker = Worker(SimpleNamespace(nixl_agent=make, nixl_agent_config=lambda **kw: None), "failing", Timeouts())  # type: ignore[arg-type]
    rows = np.array([[4096, 4096, 0]], dtype=np.int64)
    try:
        worker.register(["pool"])
        worker.load_peer(b"owner")
        core = weakref.ref(agents[0].agent)
        del agents[0]
        with pytest.raises(Exception, match="REMOTE_DISCONNECT"):
            worker.read_blocking("owner", rows, rows.copy(), "DRAM", Deadline.after(60), threading.Event())
        assert worker.drops == 1
        assert core() is None
    finally:
        worker.executor.shutdown()


class _StoppedThenFailingAgent(_FailingAgent):
    """Its first READ's two parts end DONE, the second's post stopping the READ (its fetch
    cancelled) before a third; every later part fails deep in the agent."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__()
        self.stop, self.posts = stop, 0

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str) -> _StuckHandle:
        self.handles.append(_StuckHandle())
        return self.handles[-1]

    def transfer(self, handle: _StuckHandle) -> str:
        self.posts += 1
        if self.posts == 2:
            self.stop.set()
        return "PROC"

    def check_xfer_state(self, handle: _StuckHandle) -> str:
        return "DONE" if self.posts <= 2 else self._state(handle)


def test_an_agent_is_gone_at_its_drop_though_an_earlier_stopped_reads_error_is_kept():
    """A READ stopped between its parts raises with its frames, whose locals held the agent;
    its error kept by a caller (a fetch's outcome, a log record) must not keep that agent alive
    when a later READ abandons it."""
    stop = threading.Event()
    agents: list[_StoppedThenFailingAgent] = []

    def make(name: str, conf: Any) -> _StoppedThenFailingAgent:
        agents.append(_StoppedThenFailingAgent(stop))
        return agents[-1]

    worker = Worker(SimpleNamespace(nixl_agent=make, nixl_agent_config=lambda **kw: None), "stopped", Timeouts())  # type: ignore[arg-type]
    rows = np.array([[4096 * i, 16, 0] for i in range(3 * 4096)], dtype=np.int64)  # three parts by rows
    try:
        worker.register(["pool"])
        worker.load_peer(b"owner")
        core = weakref.ref(agents[0].agent)
        with pytest.raises(TransferError, match="stopped") as stopped:
            worker.read_blocking("owner", rows, rows.copy(), "DRAM", Deadline.after(60), stop)
        kept = stopped.value  # as the fetch that reports it keeps it
        assert agents[0].posts == 2 and worker.drops == 0
        del agents[0]
        one = rows[:1]
        with pytest.raises(Exception, match="REMOTE_DISCONNECT"):
            worker.read_blocking("owner", one, one.copy(), "DRAM", Deadline.after(60), threading.Event())
        assert worker.drops == 1
        assert core() is None, kept
    finally:
        worker.executor.shutdown()


def test_a_transport_gives_its_workers_its_timeouts():
    from transfer.lanes.ucx.transport import UcxTransport

    timeouts = Timeouts(read_stall=0.7, connect=1.5)
    transport = UcxTransport("timeouts-probe", workers=2, timeouts=timeouts, notifies=True)
    try:
        agents = [*transport._workers, transport._notifier]
        assert [w.read_stall for w in agents] == [0.7] * 3
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


# ---- an owner's progress while its rooms are read -----------------------------------------------
def test_reading_progress_is_the_instances_else_by_transport():
    from transfer.timeouts import TCP_PROGRESS_INTERVAL

    assert Timeouts(ticket_progress_interval=0.002).reading_progress_interval(over_tcp=True) == 0.002
    assert Timeouts(ticket_progress_interval=0.002).reading_progress_interval(over_tcp=False) == 0.002
    assert DEFAULTS.reading_progress_interval(over_tcp=True) == TCP_PROGRESS_INTERVAL < DEFAULTS.progress_interval
    assert DEFAULTS.reading_progress_interval(over_tcp=False) == DEFAULTS.progress_interval
    assert Timeouts(progress_interval=0.0001).reading_progress_interval(over_tcp=True) == 0.0001  # never slower


async def test_a_driven_owner_hands_a_notification_over_as_it_arrives():
    """An owner driven on its worker's thread for a long stretch returns as soon as a
    notification arrives (a release must not wait out the stretch)."""
    from transfer.lanes.ucx.transport import UcxTransport

    owner = UcxTransport("drive-owner")
    decode = UcxTransport("drive-decode", notifies=True)
    try:
        await decode.add_peer(owner.agent_name, owner.agent_metadata(), [])
        driving = asyncio.ensure_future(owner.progress(60.0, 0.0005))
        await asyncio.sleep(0.05)
        assert not driving.done()  # nothing arrived: still driving
        assert decode.notify([(owner.agent_name, b"released")]) == []
        arrived = await asyncio.wait_for(driving, 20)  # well before the 60 s stretch
        assert arrived == {"drive-decode.notify": [b"released"]}
    finally:
        await decode.aclose()
        await owner.aclose()
