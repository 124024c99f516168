"""The owner broadcast's NCCL watchdog, its logic alone: a stand-in communicator and
broadcasts whose completion the test decides (the real one runs in tests/test_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from pdkv import DeadlineExceeded
from pdkv.deadline import Deadline
from pdkv.nccl import _Watchdog


@dataclass
class _Comm:
    timeout: float = 5.0
    calling_until: Deadline | None = None
    _ctx: None = None
    _events: list[int] = field(default_factory=list)
    aborted: list[Exception] = field(default_factory=list)
    api: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(ctx_set=lambda ctx: 0))

    def check_async(self) -> None:
        pass

    def abort(self, why: Exception) -> None:
        self.aborted.append(why)


@dataclass(eq=False)
class _Work:
    event: int
    what: str
    done: bool = False
    deadline: Deadline = Deadline(float("inf"))
    tensors: tuple = ("payload",)
    ran: bool = False

    def is_completed(self) -> bool:
        return self.done


def _watchdog(comm: _Comm) -> _Watchdog:
    dog = _Watchdog(comm)  # type: ignore[arg-type]
    dog.stop()  # swept by hand below, not by its thread
    return dog


def test_a_broadcast_that_ran_lets_its_tensors_go_and_its_event_serve_again():
    comm = _Comm()
    dog = _watchdog(comm)
    first, second = _Work(1, "layer 3", done=True), _Work(2, "layer 4")
    dog.track(first)
    dog.track(second)
    dog._sweep(comm)  # type: ignore[arg-type]
    assert (first.ran, first.tensors, comm._events) == (True, (), [1])
    assert (second.ran, second.tensors) == (False, ("payload",)) and not dog.idle()
    second.done = True
    assert dog.idle() and comm._events == [1, 2] and comm.aborted == []


def test_a_broadcast_past_its_deadline_aborts_the_communicator():
    comm = _Comm()
    dog = _watchdog(comm)
    late = _Work(1, "layer 9", deadline=Deadline.after(-0.1))
    dog.track(late)
    dog._sweep(comm)  # type: ignore[arg-type]
    assert len(comm.aborted) == 1 and isinstance(comm.aborted[0], DeadlineExceeded)
    assert "layer 9" in str(comm.aborted[0]) and not late.ran  # its tensors stay: NCCL may still hold them


def test_a_call_blocked_in_nccl_past_the_timeout_aborts_the_communicator():
    comm = _Comm(timeout=1.0, calling_until=Deadline.after(-1.0))  # began 2 s ago
    dog = _watchdog(comm)
    dog._sweep(comm)  # type: ignore[arg-type]
    assert len(comm.aborted) == 1 and "blocked" in str(comm.aborted[0])
    comm.aborted.clear()
    comm.calling_until = Deadline.after(comm.timeout)  # a call that began just now is left alone
    dog._sweep(comm)  # type: ignore[arg-type]
    assert comm.aborted == []
