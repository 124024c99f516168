"""A UCX worker whose READ part ended other than DONE drops its NIXL agent before the READ
ends (docs/between-hosts.md, "Link cuts"): UCX cannot cancel a GET, and over TCP an answer
that arrives once a cut link is back lands whenever the agent is next progressed. Through a
fake NIXL (the seam): the dropped agent is never called again, and the next use makes a new
one with the memory registered anew; the old one's peers are refused as lost (loading one
waits for its TCP connect) until the transport connects them again."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pdkv.errors import PeerLostError, TransferError
from transfer.deadline import Deadline
from transfer.lanes.ucx.worker import Worker
from transfer.timeouts import Timeouts


class _Agent:
    """A NIXL agent that records every call; its parts end in `ends` (one state a part)."""

    def __init__(self, ends: list[str]) -> None:
        self.ends = ends
        self.calls: list[str] = []
        self.registered: list[Any] = []
        self.peers: list[bytes] = []

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_") and name not in ("calls", "ends", "registered", "peers"):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)

    def create_backend(self, name: str, params: Any) -> None:
        pass

    def register_memory(self, tensors: Any) -> str:
        self.registered.append(tensors)
        return f"descs-{len(self.registered)}"

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.peers.append(metadata)
        return b"owner"

    def get_xfer_descs(self, rows: np.ndarray, mem: str) -> np.ndarray:
        return rows

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str) -> SimpleNamespace:
        return SimpleNamespace(release=lambda: None, end=self.ends.pop(0))

    def transfer(self, handle: SimpleNamespace) -> str:
        return "PROC"

    def check_xfer_state(self, handle: SimpleNamespace) -> str:
        return str(handle.end)


def _worker(*agents: _Agent) -> Worker:
    made = iter(agents)
    nixl = SimpleNamespace(nixl_agent=lambda name, conf: next(made), nixl_agent_config=lambda **kw: None)
    return Worker(nixl, "w", Timeouts(read_stall=0.2, late_read=0.05))  # type: ignore[arg-type]


def _read(worker: Worker) -> float:
    rows = np.array([[4096, 4096, 0]], dtype=np.int64)
    return worker.read_blocking("owner", rows, rows.copy(), "DRAM", Deadline.after(10), threading.Event())


def _on_thread(worker: Worker, fn: Any, *args: Any) -> Any:
    return worker.executor.submit(fn, *args).result()


def test_a_part_ending_in_err_drops_the_agent_and_the_peer_is_lost_until_connected_again():
    first, second = _Agent(["ERR"]), _Agent(["DONE"])
    worker = _worker(first, second)
    try:
        _on_thread(worker, worker.register, ["tensors"])
        assert _on_thread(worker, worker.load_peer, b"owner-metadata") == "owner"
        with pytest.raises(TransferError, match="ended in state ERR"):
            _on_thread(worker, _read, worker)
        assert worker.agent is None and worker.renewals == 1  # dropped before the READ ended
        calls = len(first.calls)
        with pytest.raises(PeerLostError, match="dropped UCX agent"):  # at once: no connect attempted
            _on_thread(worker, _read, worker)
        assert worker.agent is second and second.registered == [["tensors"]] and second.peers == []
        _on_thread(worker, worker.forget_peer, "owner")  # the decode drops the lost peer ...
        assert "remove_remote_agent" not in second.calls  # (never loaded there)
        _on_thread(worker, worker.load_peer, b"owner-metadata")  # ... and connects it anew
        _on_thread(worker, _read, worker)
        assert len(first.calls) == calls  # the dropped agent was never called again
        assert second.peers == [b"owner-metadata"]
    finally:
        worker.executor.shutdown()


def test_a_part_stalled_past_read_stall_drops_the_agent_and_a_clean_read_keeps_it():
    first = _Agent(["DONE", "PROC"])
    worker = _worker(first, _Agent([]))
    try:
        _on_thread(worker, _read, worker)
        assert worker.agent is first and worker.renewals == 0  # DONE: nothing to drop
        with pytest.raises(PeerLostError, match="made no end"):
            _on_thread(worker, _read, worker)
        assert worker.agent is None and worker.renewals == 1
    finally:
        worker.executor.shutdown()


def test_a_stopped_read_abandons_its_part_in_flight_with_the_agent_at_once():
    """A cancelled fetch (`stop` set) does not wait for a part that a cut link holds, up to
    `read_stall`: it ends as soon as it sees `stop`, its agent dropped with the part."""
    agent = _Agent(["PROC"])
    worker = Worker(
        SimpleNamespace(nixl_agent=lambda name, conf: agent, nixl_agent_config=lambda **kw: None),  # type: ignore[arg-type]
        "w",
        Timeouts(read_stall=30.0, late_read=30.0),
    )
    stop = threading.Event()
    rows = np.array([[4096, 4096, 0]], dtype=np.int64)
    try:
        ended = worker.executor.submit(
            worker.read_blocking, "owner", rows, rows.copy(), "DRAM", Deadline.after(60), stop
        )
        while "check_xfer_state" not in agent.calls:  # its part is posted and waited for
            time.sleep(0.01)
        stop.set()
        with pytest.raises(TransferError, match="stopped"):
            ended.result(timeout=10)  # far below read_stall's 30 s
        assert worker.agent is None and worker.renewals == 1
    finally:
        worker.executor.shutdown()


class _EndsAfterStop(_Agent):
    """A part that runs until its fetch is stopped, and ends DONE a moment later (a live link)."""

    def __init__(self, stop: threading.Event) -> None:
        super().__init__(["PROC", "PROC"])
        self._stop, self._seen = stop, 0

    def check_xfer_state(self, handle: SimpleNamespace) -> str:
        self._seen += self._stop.is_set()
        return "DONE" if self._seen > 20 else "PROC"


def test_a_stopped_read_whose_part_ends_within_the_grace_keeps_its_agent_and_peers():
    """On a live link a cancelled fetch's part in flight ends DONE in milliseconds: nothing of
    it can land later, so the agent (and every peer loaded on it) is kept."""
    stop = threading.Event()
    agent = _EndsAfterStop(stop)
    worker = Worker(
        SimpleNamespace(nixl_agent=lambda name, conf: agent, nixl_agent_config=lambda **kw: None),  # type: ignore[arg-type]
        "w",
        Timeouts(read_stall=30.0, late_read=30.0),
    )
    rows = np.array([[4096, 4096, 0]], dtype=np.int64)
    try:
        assert _on_thread(worker, worker.load_peer, b"owner-metadata") == "owner"
        ended = worker.executor.submit(
            worker.read_blocking, "owner", rows, rows.copy(), "DRAM", Deadline.after(60), stop
        )
        while "check_xfer_state" not in agent.calls:
            time.sleep(0.01)
        stop.set()
        ended.result(timeout=10)  # its one part ended DONE: the READ is whole
        assert worker.agent is agent and worker.renewals == 0
        _on_thread(worker, _read, worker)  # the peer still loaded: read at once, not refused as lost
    finally:
        worker.executor.shutdown()
