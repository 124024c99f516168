"""pdkv for synchronous schedulers: the asyncio side on a thread of its own.

A serving engine's scheduler runs a synchronous loop and must never block in it. These
classes own an event loop on a background thread and give that loop the work; every call
returns at once (it only hands a callable to the loop), and outcomes are read by polling
a handle or by a callback (which runs on pdkv's thread: keep it short).

    fetcher = SyncFetcher(pool, registry_url)
    handle = fetcher.fetch("prefill0", room, dst_pages, ticket=ticket)
    ...                                    # scheduler iterations
    if handle.poll() is HandleStatus.DONE:  # non-blocking
        result = handle.result()
    fetcher.close()

    exporter = SyncExporter(pool, "prefill0", cp_rank, cp_size, registry_url)
    exporter.publish_room(room, pages, hold=False)  # read by ticket: no claim held for the arbiter
    exporter.mark_ready(room, upto_layer)  # records a CUDA event on the caller's stream
    ticket_pin = exporter.pin(room)        # a handle: poll() / result()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import numpy as np
import torch

from pdkv.errors import ClosedError, ConflictError, PdkvError
from pdkv.pages import PageIds
from transfer.decode import DecodeFetcher, RoomLease
from transfer.decode.landing import Landing
from transfer.decode.tasks import eager_task
from transfer.engine_kv import KVBuffers
from transfer.metadata import OwnerPin, RankDescriptor, RoomTicket
from transfer.prefill import PrefillExporter
from transfer.prefill.rooms import OnEnd
from transfer.results import FetchResult
from transfer.timeouts import CALLER_YIELD_SECONDS, Timeouts

__all__ = ["BackgroundLoop", "Handle", "HandleStatus", "SyncFetcher", "SyncExporter"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")


class HandleStatus(enum.Enum):
    """What `Handle.poll()` says, for every handle here (a fetch's and an export's alike)."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class BackgroundLoop:
    """An asyncio loop running on a daemon thread until `stop()`."""

    def __init__(self, name: str = "pdkv-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def _check_open(self) -> None:
        if self._stopping or self.loop.is_closed() or not self._thread.is_alive():
            raise ClosedError("pdkv's loop has stopped (closed)")

    def submit(self, coro: Coroutine[Any, Any, T]) -> LoopTask[T]:
        """Schedule `coro` on the loop as a task; returns at once."""
        try:
            self._check_open()
        except ClosedError:
            coro.close()
            raise
        return LoopTask(self.loop, coro)

    def call(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop's thread soon; returns at once."""
        self._check_open()
        try:
            self.loop.call_soon_threadsafe(fn)
        except RuntimeError as exc:  # the loop closed under us
            raise ClosedError("pdkv's loop has stopped (closed)") from exc

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and wait for it (set-up and tear-down only)."""
        return self.submit(coro).future.result(timeout)

    @property
    def on_own_thread(self) -> bool:
        """Whether the caller runs on this loop's thread (a callback of a handle)."""
        return threading.current_thread() is self._thread

    def close(self, coro: Coroutine[Any, Any, object], timeout: float) -> None:
        """Run `coro` (an object's `aclose()`), then stop: from any other thread it waits
        (up to `timeout`); from the loop's own thread (a handle's callback) it returns at
        once, and the loop stops once `coro` has ended."""
        if self.on_own_thread:
            self._check_open()
            self._stopping = True
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda _: self.loop.stop())
            return
        try:
            self.run(coro, timeout)
        finally:
            self.stop(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop and wait for its thread, at most `timeout` (the sync faces pass their
        `Timeouts.start`; by default the default's); not from the loop's own thread: `close`."""
        timeout = Timeouts().start if timeout is None else timeout
        self._stopping = True
        if self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # it closed meanwhile
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


class _Outcome(enum.Enum):
    """Where a `LoopTask`'s outcome stands (`LoopTask._decide`)."""

    OPEN = "open"  # nothing decided yet
    CANCELLED = "cancelled"  # the caller cancelled first: only the task's end settles
    SETTLED = "settled"  # decided: nothing changes it


class _Party(enum.Enum):
    """Who offers a `LoopTask` its outcome (`LoopTask._decide`)."""

    TASK = "the task's end"
    REPORT = "a poll's report of a read proved on its lane's thread"
    CANCEL = "the caller's cancel"


class LoopTask(Generic[T]):
    """A task on a `BackgroundLoop`, seen from other threads: `future` is its outcome.

    The outcome is decided in one place, `_decide`, under one lock. Three parties offer one:

    * the task's end, on the loop (`_settling`): its result, or its error (`ClosedError`
      once cancelled);
    * a read proved on its lane's own thread (`transfer.decode.landing.Landing`), which the
      caller's poll reports (`report`, on the polling thread) while the task still finishes
      behind (releases, bookkeeping);
    * the caller's cancel (`cancel`, any thread).

    The first offer decides, by these rules:

    1. Once settled, nothing changes the outcome: the task's later error is only logged, a
       later cancel does nothing (a read a poll was told of finishes unhindered).
    2. A cancel before any outcome goes to the task, and from then on only the task's end
       settles: once its READs and kernels have ended, since until then bytes may still land
       in its pages (a `concurrent.futures` cancel would report the end at once). A report
       after the cancel is not taken.
    3. Otherwise the report or the task's end, whichever comes first. The proof behind a
       report is made once (`Landing`, by the lane's thread or the loop, whichever comes
       first), so a task that ends after a report ends with the same verdict.

    The party whose offer decided settles `future`, outside the lock: its done-callbacks run on
    that party's thread (the loop's, or the polling caller's) and may cancel or close.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> None:
        self._loop = loop
        self._task: asyncio.Task[None] | None = None
        self._cancel_asked = False  # on the loop: the task is cancelled once it has started
        self._lock = threading.Lock()
        self._outcome = _Outcome.OPEN
        self.future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self.future.set_running_or_notify_cancel()  # from now on only `_decide`'s winner settles it
        try:
            loop.call_soon_threadsafe(self._start, coro)
        except RuntimeError as exc:  # the loop closed meanwhile
            coro.close()
            raise ClosedError("pdkv's loop has stopped") from exc

    def _decide(self, party: _Party) -> bool:
        """The one place the outcome is decided (the class's rules): True if `party`'s offer is
        taken, and that party then settles `future` (a cancel: stops the task)."""
        with self._lock:
            now = self._outcome
            if now is _Outcome.SETTLED or (now is _Outcome.CANCELLED and party is not _Party.TASK):
                return False  # rules 1 and 2
            self._outcome = _Outcome.CANCELLED if party is _Party.CANCEL else _Outcome.SETTLED
            return True

    def _start(self, coro: Coroutine[Any, Any, T]) -> None:
        self._task = eager_task(self._settling(coro), self._loop)
        if self._cancel_asked:
            self._cancel()

    async def _settling(self, coro: Coroutine[Any, Any, T]) -> None:
        """Run `coro` and offer its end in its last step, not in a done-callback after it:
        a fetch's releases, queued on its way out, would run first (the notifications'
        sends hold the interpreter lock a while)."""
        try:
            result = await coro
        except asyncio.CancelledError:
            self._ended_with(ClosedError("cancelled"))
            raise
        except BaseException as exc:
            self._ended_with(exc)
            if not isinstance(exc, Exception):  # KeyboardInterrupt and the like go on up
                raise
            return
        if self._decide(_Party.TASK):  # else a poll reported the read proved (rule 1)
            self.future.set_result(result)

    def _ended_with(self, exc: BaseException) -> None:
        if self._decide(_Party.TASK):
            self.future.set_exception(exc)
        else:  # rule 1: a poll reported the read, its bytes proved before this
            logger.info("a read already reported done ended with %r afterwards (its bytes were proved)", exc)

    def report(self, result: T) -> None:
        """Offer `result`, proved off the loop while the task finishes behind (a read its lane's
        thread proved); taken unless the outcome is settled or a cancel came first."""
        if self._decide(_Party.REPORT):
            self.future.set_result(result)

    def cancel(self) -> None:
        """Ask the task to stop (from any thread); `future` settles once it has. Nothing to
        do once `future` has settled (a read seen landed by a poll finishes unhindered)."""
        if not self._decide(_Party.CANCEL):
            return
        try:
            self._loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the loop is closed: the task cannot run any more
            logger.debug("cancel after pdkv's loop closed")

    def _cancel(self) -> None:
        self._cancel_asked = True
        if self._task is not None:
            # After the task's first step (queued before this), not before: a task cancelled
            # unstarted runs none of its code, so it would neither settle `future` nor clean up
            # (a read claimed ahead would keep its claim until the pin expires).
            self._loop.call_soon(self._task.cancel)


class Handle(Generic[T]):
    """An operation running on pdkv's loop, read without blocking."""

    def __init__(self, job: LoopTask[T]) -> None:
        self._job = job
        self._future = job.future

    def poll(self) -> HandleStatus:
        """PENDING until the operation has ended: after `cancel()` too, until every READ
        and kernel it started has finished."""
        if not self._future.done():
            return HandleStatus.PENDING
        return HandleStatus.FAILED if self._future.exception() else HandleStatus.DONE

    def result(self, timeout: float | None = 0) -> T:
        """The outcome; raises its `PdkvError`. With the default `timeout=0` it does not
        block: a pending operation raises `TimeoutError`."""
        return self._future.result(timeout)

    def exception(self) -> BaseException | None:
        """The failure of a finished operation (None if it succeeded or is pending)."""
        if not self._future.done():
            return None
        return self._future.exception()

    def cancel(self) -> None:
        """Ask the operation to stop; a fetch then raises and leaves nothing pinned. It is
        over only once `poll()` says so: until then its bytes may still land. Once `poll()`
        has said DONE there is nothing left to stop."""
        self._job.cancel()

    def on_done(self, callback: Callable[[Handle[T]], None]) -> None:
        """Call `callback(self)` once finished: on pdkv's thread, on the thread whose `poll`
        found a read proved, or at once if it has."""
        self._future.add_done_callback(lambda _: callback(self))


class FetchHandle(Handle[FetchResult]):
    """A fetch's handle. Where its read is one launch on the GPU lane, the lane's own thread
    proves it as the kernel ends and leaves the result in its `Landing`: `poll` offers it to
    the job (`LoopTask.report`, which decides), rather than waiting for pdkv's loop to hear of it."""

    def __init__(self, job: LoopTask[FetchResult], landing: Landing) -> None:
        super().__init__(job)
        self._landing = landing

    def poll(self) -> HandleStatus:
        """As `Handle.poll`; a read the lane proved is offered here (`LoopTask.report`), and once
        taken `on_done`'s callbacks run on this thread. After `cancel()` it waits for the task."""
        future = self._future
        if not future.done():  # written out, not `super().poll()`: a scheduler calls it every iteration
            proved = self._landing.proved_result()
            if proved is None:
                return HandleStatus.PENDING
            self._job.report(proved)
            if not future.done():  # cancelled first: the task's end is the outcome
                return HandleStatus.PENDING
        return HandleStatus.FAILED if future.exception() else HandleStatus.DONE


class SyncFetcher:
    """A `DecodeFetcher` driven from a synchronous scheduler thread: the same keyword arguments,
    except that `release_delay` defaults to `transfer.timeouts.CALLER_YIELD_SECONDS`. Starting and
    closing wait at most `start_timeout`, by default its `timeouts`' `start`."""

    def __init__(
        self,
        pool: KVBuffers,
        registry_url: str,
        start_timeout: float | None = None,
        *,
        consumer_id: str | None = None,
        timeouts: Timeouts = Timeouts(),
        secret: str | None = None,
        ucx_workers: int | None = None,
        merge_runs: bool = True,
        lane: str = "auto",
        time_kernels: bool = False,
        release_delay: float = CALLER_YIELD_SECONDS,
    ) -> None:
        self._start = timeouts.start if start_timeout is None else start_timeout
        self._bg = BackgroundLoop("pdkv-decode")

        def make() -> DecodeFetcher:
            return DecodeFetcher(
                pool,
                registry_url,
                consumer_id=consumer_id,
                timeouts=timeouts,
                secret=secret,
                ucx_workers=ucx_workers,
                merge_runs=merge_runs,
                lane=lane,
                time_kernels=time_kernels,
                release_delay=release_delay,
            )

        self.fetcher = _start_or_stop(self._bg, make, self._start)

    def fetch(
        self,
        engine_id: str,
        room: int,
        dst_pages: PageIds,
        *,
        ticket: RoomTicket | None = None,
        timeout: float | None = None,
        readers: int = 1,
    ) -> FetchHandle:
        """Start `DecodeFetcher.fetch` on pdkv's loop; returns a handle at once.

        `dst_pages` is copied here, so the caller may reuse its list or array.
        """
        landing = Landing()
        coro = self.fetcher.fetch(
            engine_id, room, _own(dst_pages), ticket=ticket, timeout=timeout, readers=readers, landing=landing
        )
        return FetchHandle(self._bg.submit(coro), landing)

    def claim(self, engine_id: str, room: int, *, readers: int = 1) -> Handle[RoomLease]:
        """Start claiming `room` ahead of its read (`DecodeFetcher.claim`): it waits for the
        room to be published; cancelling it gives up whatever it had claimed."""
        return Handle(self._bg.submit(self.fetcher.claim(engine_id, room, readers=readers)))

    def read_claimed(
        self, claim: Handle[RoomLease], dst_pages: PageIds, *, timeout: float | None = None, skip: int = 0
    ) -> FetchHandle:
        """Read a room claimed ahead into `dst_pages`, then release it (`RoomLease.read_once`;
        `skip`: the room's first pages, which the decode holds, are not read); returns a
        handle at once. Cancelling it cancels the claim too if it is still pending.
        `dst_pages` is copied here."""
        landing = Landing()
        read = _read_claimed(claim, _own(dst_pages), timeout, landing, skip)
        return FetchHandle(self._bg.submit(read), landing)

    def watch(self, lease: RoomLease) -> Handle[None]:
        """Start `RoomLease.until_aborted` (a claim held ahead, unread: it fails once an owner
        aborts the room or is lost); returns at once. Cancel it as the read starts."""
        return Handle(self._bg.submit(lease.until_aborted()))

    def describe(self, engine_id: str, *, timeout: float | None = None) -> Handle[dict[int, RankDescriptor]]:
        """Start `DecodeFetcher.describe` (the engine's ranks); returns a handle at once."""
        return Handle(self._bg.submit(self.fetcher.describe(engine_id, timeout=timeout)))

    def give_up(self, lease: RoomLease) -> Handle[None]:
        """Start `RoomLease.give_up`: a room claimed ahead will not be read."""
        return Handle(self._bg.submit(lease.give_up()))

    def give_up_room(self, engine_id: str, room: int) -> Handle[None]:
        """Start `DecodeFetcher.give_up_room` (its owners free `room` now); returns at once."""
        return Handle(self._bg.submit(self.fetcher.give_up_room(engine_id, room)))

    def close(self, timeout: float | None = None) -> None:
        """End fetches in flight (they raise `ClosedError`), close, stop the thread (waiting at
        most `timeout`, by default the start's bound). From a handle's callback (pdkv's own
        thread) it returns at once and closes behind."""
        self._bg.close(self.fetcher.aclose(), self._start if timeout is None else timeout)


class SyncExporter:
    """A `PrefillExporter` driven from a synchronous model thread (the same arguments).
    Starting and closing wait at most `start_timeout`, by default its `timeouts`' `start`."""

    def __init__(
        self,
        pool: KVBuffers,
        engine_id: str,
        cp_rank: int,
        cp_size: int,
        registry_url: str,
        start_timeout: float | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        timeouts: Timeouts = Timeouts(),
        secret: str | None = None,
        on_free: Callable[[int, np.ndarray], None] = lambda room, pages: None,
        group_size: int = 1,
        hold_claims: bool = True,
    ) -> None:
        self._bg = BackgroundLoop(f"pdkv-{engine_id}-cp{cp_rank}")
        self.timeouts = timeouts
        self._start = timeouts.start if start_timeout is None else start_timeout

        def make() -> PrefillExporter:
            return PrefillExporter(
                pool,
                engine_id,
                cp_rank,
                cp_size,
                registry_url,
                host=host,
                port=port,
                advertise=advertise,
                timeouts=timeouts,
                secret=secret,
                on_free=on_free,
                group_size=group_size,
                hold_claims=hold_claims,
            )

        self.exporter = _start_or_stop(self._bg, make, self._start)

    # A publication handle's result is the publication's id. The calls that take one act on
    # that publication only: after a refused publish (the room id was live or used) they
    # fail, rather than reach the room that holds the id.
    def publish_room(
        self, room: int, src_pages: np.ndarray, consumers: int = 1, on_end: OnEnd | None = None, hold: bool = True
    ) -> Handle[int]:
        """Pin `src_pages` for `room`; a handle says whether it was accepted (its publication).
        `on_end(status, reason)` runs on pdkv's thread as the room ends; `hold`: False for a
        room to be read by ticket (`PrefillExporter.publish_room`)."""
        pages = np.array(src_pages, copy=True)
        return Handle(self._bg.submit(_call(self.exporter.publish_room, room, pages, consumers, on_end, hold)))

    def mark_ready(self, room: int, upto_layer: int, publication: Handle[int] | None = None) -> None:
        """Owned layers below `upto_layer` of `room` are written (on a GPU: queued on the
        caller's current stream, where the event is recorded)."""
        written = self._written_here()
        self._bg.submit(_of(publication, room, lambda pub: self.exporter.mark_ready(room, upto_layer, written, pub)))

    def publish_chunked(
        self, room: int, total_pages: int, consumers: int = 1, on_end: OnEnd | None = None
    ) -> Handle[int]:
        """`room` will arrive in chunks (a chunked prefill), `total_pages` in all (as
        `publish_room`)."""
        return Handle(self._bg.submit(_call(self.exporter.publish_chunked, room, total_pages, consumers, on_end)))

    def add_chunk(
        self,
        room: int,
        pages: np.ndarray,
        aux: bytes | None = None,
        publication: Handle[int] | None = None,
        abort_if_refused: bool = False,
    ) -> Handle[None]:
        """The next chunk of `room`, written in every owned layer (on a GPU, as for
        `mark_ready`), with the request's `aux` bytes if it is the last. The handle says
        whether it was accepted (on a GPU: queued). `abort_if_refused`: a refused chunk
        also aborts the room, naming the refusal, as it is refused (a sender that cannot
        go on: its decodes fail now, not at the pin's expiry)."""
        chunk, written = np.array(pages, copy=True), self._written_here()
        add = functools.partial(self.exporter.add_chunk, room, chunk, written, aux)

        def add_or_abort(pub: int | None) -> None:
            try:
                add(pub=pub)
            except PdkvError as exc:
                if abort_if_refused and not isinstance(exc, ConflictError):  # a conflict: not this room
                    self.exporter.abort_room(room, pub, exc)
                raise

        return Handle(self._bg.submit(_of(publication, room, add_or_abort)))

    def _written_here(self) -> torch.cuda.Event | None:
        """On a GPU, an event after what the caller's stream has queued; None on the host."""
        device = self.exporter.pool.device
        if device.type != "cuda":
            return None
        written = torch.cuda.Event()
        written.record(torch.cuda.current_stream(device))
        return written

    def abort_room(
        self, room: int, publication: Handle[int] | None = None, reason: PdkvError | None = None
    ) -> Handle[None]:
        """Free `room` now (only `publication`, where given: nothing if it was refused); its
        decodes fail, told `reason` where given."""
        return Handle(self._bg.submit(_of(publication, room, lambda pub: self.exporter.abort_room(room, pub, reason))))

    def unpin_word(self, room: int, publication: Handle[int] | None = None) -> bool:
        """Revoke `room` now, on the calling thread (`RoomTable.unpin_word`: its pin word
        cleared, the room ended by pdkv's loop before it answers for it again), for when that
        loop has not ended it in time and its pages are handed back: only `publication`'s room
        where it was granted, none where it was refused. True if the word held the nonce."""
        pub = None
        if publication is not None:
            status = publication.poll()
            if status is HandleStatus.FAILED:
                return False  # refused: the live room of that id, if any, is another request's
            if status is HandleStatus.DONE:
                pub = publication.result()
        return self.exporter.rooms.unpin_word(room, pub)

    def pin(self, room: int, timeout: float | None = None) -> Handle[OwnerPin | None]:
        """This rank's part of `room`'s ticket, once its layers are readable (a handle)."""
        wait = self.timeouts.request if timeout is None else timeout
        return Handle(self._bg.submit(self.exporter.pin(room, wait)))

    def close(self, timeout: float | None = None) -> None:
        """Close the exporter and stop the thread (as `SyncFetcher.close`)."""
        self._bg.close(self.exporter.aclose(), self._start if timeout is None else timeout)


def _own(pages: PageIds) -> PageIds:
    """A copy of a caller's page ids, which it may reuse once the call returns."""
    return pages.clone() if isinstance(pages, torch.Tensor) else np.array(pages, copy=True)


class _Startable(Protocol):
    async def start(self) -> None: ...


S = TypeVar("S", bound=_Startable)


def _start_or_stop(bg: BackgroundLoop, make: Callable[[], S], timeout: float) -> S:
    """`make()`'s object, made and started on `bg`; a failure stops `bg`'s thread too."""
    try:
        return bg.run(_started(make), timeout)
    except BaseException:
        bg.stop(timeout)
        raise


async def _started(make: Callable[[], S]) -> S:
    """`make()`'s object, made and started on the loop's thread."""
    obj = make()
    await obj.start()
    return obj


async def _read_claimed(
    claim: Handle[RoomLease], pages: PageIds, timeout: float | None, landing: Landing, skip: int
) -> FetchResult:
    if not claim._future.done():  # a claim granted already (the usual case) costs no turn of the loop
        try:
            await asyncio.wrap_future(claim._future)
        except asyncio.CancelledError:
            claim.cancel()  # a claim still waiting for its room stops, and gives up what it held
            if claim.poll() is HandleStatus.DONE:  # granted as this read was cancelled: give it up here
                await claim.result().give_up()
            raise
    lease = claim.result()  # raises the claim's failure
    return await lease.read_once(pages, timeout=timeout, landing=landing, skip=skip)


async def _of(publication: Handle[int] | None, room: int, fn: Callable[[int | None], object]) -> None:
    """`fn(pub)` on the loop's thread, with `publication`'s id (None: no publication named);
    `ConflictError` if that publication was refused. It was submitted before this, so it
    has usually settled already."""
    pub = None
    if publication is not None:
        try:
            pub = await asyncio.wrap_future(publication._future)
        except PdkvError as exc:
            raise ConflictError(f"room {room}: its publication was refused ({exc}); nothing done") from exc
    fn(pub)


async def _call(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` on the loop's thread; its error reaches the caller through the handle."""
    return fn(*args, **kwargs)
