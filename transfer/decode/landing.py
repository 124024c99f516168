"""A read's end told to a synchronous caller without waiting for the decode's loop.

A read on the GPU lane has landed once its kernel has passed. The lane's waiting thread
sees that first; the decode's loop hears it from there, then proves the pin words, builds
the result and settles the caller's handle: the wake-up and that Python are a large part
of a GPU lane read (docs/benchmarks.md#sglang-through-its-receiver), all of it holding
the interpreter lock that a polling scheduler needs to see the outcome. Given a
`Landing`, such a read has the waiting thread prove the pin words (loads from the owners'
mapped tables) and keep the result as the kernel ends; the caller's `poll()` reads it
from there, and the loop's continuation (its releases) comes a moment later
(`transfer.timeouts.CALLER_YIELD_SECONDS`).

The proof is made once, by whichever thread comes first (the waiting thread, or the loop
where the lane had nothing to tell), and both follow that verdict: the loop's read ends as
the result its caller may already have been given, and a refused read is never offered.
A `Landing` decides nothing about the caller's handle: it only keeps the proved result.
Which outcome the handle reports (this result, the task's end, or a cancel first) is
decided in one place, `transfer.sync.LoopTask`, whose docstring states the order.

A caller that is itself a CUDA stream (`DecodeFetcher.fetch(stream=...)`) gets a
`StreamLanding`: the lane tells it as the read's gather is queued, and it makes the caller's
stream wait on an event behind the gather, so that the caller's kernels queue up before the
host has seen the gather end. The read's end is then seen and proved as any read's, and the
fetch's outcome comes after the proof (`StreamFetch`; the guarantee is in docs/gpu-lane.md).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Generator
from typing import Any, NoReturn

import torch

from transfer.results import FetchResult

logger = logging.getLogger(__name__)


class Landing:
    """Where a read's result waits for a polling caller (`transfer.sync`) once a lane has
    told it, on the lane's own thread, that the bytes are in place (a `Watch`). Made by the
    caller, armed by the read on the decode's loop before it launches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the proof is made once, whichever thread comes first
        self._prove: Callable[[], None] = _unarmed
        self._result: Callable[[], FetchResult] = _unarmed
        self._verdict: Exception | None | bool = None  # None: not proved yet; True: proved; an error: refused
        self._proved_result: FetchResult | None = None  # the result the lane's thread made, for the caller

    def arm(self, prove: Callable[[], None], result: Callable[[], FetchResult]) -> None:
        """The read is about to launch (on the decode's loop): `prove`, asked once its bytes
        are in place and never awaiting, checks every owner's pin word and raises (a
        `PdkvError`) if one is not the room's; `result` is what the read then reports."""
        self._prove, self._result = prove, result

    def landed(self) -> bool:
        """The bytes are in place (the lane's thread): prove them and keep the result for
        `proved_result`. True if the read was proved here; never raises (whatever fails here, the
        loop reports)."""
        try:
            if self._proved(self._prove) is not True:
                return False
            self._proved_result = self._result()
            return True
        except Exception:
            logger.debug("a landing's result could not be made: the decode's loop reports the read", exc_info=True)
            return False

    def proved_result(self) -> FetchResult | None:
        """The read's result once the lane's thread proved it; None before, or if it did not
        (any thread)."""
        return self._proved_result

    def check(self, prove: Callable[[], None]) -> None:
        """On the loop, once the bytes are in place: prove them with `prove` unless the lane's
        thread did already; raises the proof's failure, whichever thread made it."""
        verdict = self._proved(prove)
        if isinstance(verdict, Exception):
            raise verdict

    def _proved(self, prove: Callable[[], None]) -> Exception | bool:
        with self._lock:
            verdict = self._verdict
            if verdict is None:
                try:
                    prove()
                    verdict = True
                except Exception as exc:  # any failure is final: both threads report it
                    verdict = exc
                self._verdict = verdict
            return verdict


class StreamFetch:
    """A fetch handed to a consumer's CUDA stream (`DecodeFetcher.fetch(stream=...)`).

    `event` passes once the bytes are in `dst_pages`, and `stream` (the consumer's) already
    waits on it: kernels queued there after the call run on the room's bytes. Whether they
    are the room's bytes is known only once the fetch completes: `await handle` returns the
    `FetchResult` once every owner's pin word was proved after the data, or raises the fetch's
    `PdkvError`; results computed on the stream must not be used unless it returned.

    `ordered`: the event was recorded behind the lane's gather, before the host saw its end
    (one launch of the same-host GPU lane: a ticket's read, or a room claimed whole). False
    where the fetch was completed on the host first (owners read over UCX, or one at a time),
    and the event was recorded on `stream` after: then `await handle` has already returned."""

    __slots__ = ("event", "stream", "ordered", "_done")

    def __init__(
        self, event: torch.cuda.Event, stream: torch.cuda.Stream, ordered: bool, done: asyncio.Future[FetchResult]
    ) -> None:
        self.event, self.stream, self.ordered, self._done = event, stream, ordered, done

    def __await__(self) -> Generator[Any, None, FetchResult]:
        # Shielded: the read cannot be stopped once queued; a caller giving up its wait leaves it to end.
        return asyncio.shield(self._done).__await__()

    def done(self) -> bool:
        """Whether the fetch has completed (proved, or failed)."""
        return self._done.done()

    def result(self) -> FetchResult:
        """The proved result once `done()`; raises the fetch's failure (or `InvalidStateError` before)."""
        return self._done.result()


class StreamLanding(Landing):
    """A `Landing` for a consumer's CUDA stream (`DecodeFetcher.fetch(stream=...)`): told by
    the GPU lane, on the loop's thread, that the read's gather is queued on the lane's stream
    (`queued`, an `transfer.lanes.cuda_ipc.gather.Ordered` watch), it records an event behind
    it that `consumer` waits on. The read's end is then seen and proved as a plain fetch's (on
    the loop where it polls, else by the lane's waiting thread, `Landing.landed`), and the
    fetch's task reports the verdict."""

    def __init__(self, consumer: torch.cuda.Stream) -> None:
        super().__init__()
        self.consumer = consumer
        # The event once the read is queued; None once the fetch ended without one.
        self._handed: asyncio.Future[torch.cuda.Event | None] = asyncio.get_running_loop().create_future()

    def queued(self, stream: torch.cuda.Stream) -> None:
        """The read's kernels are queued on the lane's `stream` (on the loop): record an event
        behind them and make the consumer's stream wait on it. Never raises: where that fails,
        the fetch is handed over once proved on the host."""
        if self._handed.done():  # a read is one launch; a second one is not ordered
            return
        try:
            event = self._order(stream)
        except Exception:
            logger.warning("the consumer's stream could not be ordered behind a read", exc_info=True)
            return
        self._handed.set_result(event)  # one hop: the caller has it at the loop's next turn

    def _order(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        self.consumer.wait_event(event)
        return event

    def _after(self) -> torch.cuda.Event:
        """An event on the consumer's stream itself, for a fetch completed on the host first."""
        event = torch.cuda.Event()
        event.record(self.consumer)
        return event

    def landed(self) -> bool:
        """As `Landing.landed`, but the caller hears the verdict from the fetch's task on the
        decode's loop, so the loop's continuation need not wait (False)."""
        super().landed()
        return False

    async def hand_over(self, fetch: asyncio.Future[FetchResult]) -> StreamFetch:
        """Wait until `fetch` (the fetch's task, armed with this landing) has queued its read, or
        ended; a fetch that failed first raises here. Cancelled, the fetch is cancelled and
        awaited: it raises once nothing more can land."""
        fetch.add_done_callback(self._ended)
        try:
            event = await self._handed
        except asyncio.CancelledError:
            fetch.cancel()
            await asyncio.wait((fetch,))
            raise
        if fetch.done() and (fetch.cancelled() or fetch.exception() is not None):
            fetch.result()  # raises the failure: no event for a fetch known to have failed
        if event is not None:
            return StreamFetch(event, self.consumer, True, fetch)
        fetch.result()
        return StreamFetch(self._after(), self.consumer, False, fetch)

    def _ended(self, fetch: asyncio.Future[FetchResult]) -> None:
        if not fetch.cancelled():
            fetch.exception()  # retrieved: a failure its caller never awaits was logged by the fetcher
        if not self._handed.done():
            self._handed.set_result(None)


def consumer_stream(stream: torch.cuda.Stream | int, device: torch.device) -> torch.cuda.Stream:
    """The consumer's stream, checked: a `torch.cuda.Stream` of the pool's GPU `device`, or a
    raw `cudaStream_t` handle (an int) taken on that GPU (`torch.cuda.ExternalStream`)."""
    if device.type != "cuda":
        raise ValueError("a fetch ordered on a CUDA stream needs a decode pool on a GPU")
    if isinstance(stream, bool) or not isinstance(stream, (int, torch.cuda.Stream)):
        raise TypeError(f"stream must be a torch.cuda.Stream or a cudaStream_t handle (int), not {stream!r}")
    if isinstance(stream, int):
        return torch.cuda.ExternalStream(stream, device=device)
    if _index(stream.device) != _index(device):
        raise ValueError(f"the consumer's stream is on {stream.device}, the decode pool on {device}")
    return stream


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _unarmed() -> NoReturn:
    raise AssertionError("a landing told before its read armed it")
