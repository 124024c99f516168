"""The same-host GPU lane's copy: one gather kernel per batch of layers.

A batch is every layer of the batch and both kinds (latent, indexer): a table of
per-buffer source and destination base pointers and item lengths, and the request's
source and destination page ids. The work is cut into tasks, one a block-sized chunk of
one buffer's item; program (t, i) copies task `t` of the request's i-th page. A table of
tasks (rather than a grid of buffers x the largest item's chunks) leaves no program
idle: with DSA's 41 KiB latent and 8 KiB indexer items, a third of the programs of that
grid had nothing to copy. The kernel moves a request near a contiguous device copy's
rate, which UCX cuda_ipc, posting one descriptor at a time, stays far from
(docs/benchmarks.md). The kernel and its launch through the driver:
`transfer.lanes.cuda_ipc.kernel`.

Every pointer and page id is validated on the host before the launch (a table's addresses by
`IpcMapping.translate`, a read's ids by `transfer.lanes.cuda_ipc.plan.route_pages` or
`gather_plan`, one vectorised reduction a side): a bad one would fault the decode's GPU
context and with it every request on that GPU.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import queue
import threading
import time
from typing import Any, Protocol

import numpy as np
import torch

from pdkv.errors import ClosedError, TransferError
from transfer.lanes.base import Watch
from transfer.lanes.cuda_ipc.kernel import DriverEvent, GatherKernel, LaunchArgs
from transfer.lanes.cuda_ipc.plan import GatherPlan, GatherTable
from transfer.timeouts import CALLER_YIELD_SECONDS

logger = logging.getLogger(__name__)

_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension: pages per launch
_INT32 = 1 << 31  # page ids travel as int32
_SHOTS_KEPT = 256  # launch shapes kept by table and page count


def _shape(nbytes: int) -> tuple[int, int]:
    """Block bytes and warps: bigger blocks pay off once a launch fills the GPU many times."""
    return (8192, 8) if nbytes >= 1 << 30 else (4096, 4)


def launch_split(pages: int, lists: int, capacities: tuple[int, ...]) -> tuple[int, int]:
    """How a plan of `pages` pages and `lists` source page lists goes out: the parameter
    capacity its launches use (the fewest ids that hold every page's, else the most) and
    the pages each launch copies."""
    ids = (lists + 1) * pages
    for capacity in capacities:  # the last one if none holds them all
        if capacity >= ids:
            break
    return capacity, max(1, min(_MAX_GRID_Y, capacity // (lists + 1), pages))


def _meta(table: GatherTable, block_words: int) -> tuple[np.ndarray, int]:
    """The kernel's table argument (see the kernel) and its task count."""
    if table.buffers and max(int(table.src_items.max()), table.dst_items) > _INT32:
        raise TransferError("a gather table of more than 2**31 pages: page ids travel as int32")
    rows = table.table.copy()
    rows[2] //= table.word  # item lengths in words
    chunks = -(-rows[2] // block_words)
    task_buf = np.repeat(np.arange(table.buffers, dtype=np.int64), chunks)
    first = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    task_off = (np.arange(len(task_buf), dtype=np.int64) - np.repeat(first, chunks)) * block_words
    return np.concatenate([rows.reshape(-1), task_buf, task_off]).astype(np.int64, copy=False), len(task_buf)


class _Shot:
    """How one table's read of so many pages goes out: the launch's parameter set, the pages
    a launch copies, the kernel, its grid's task count, threads a block and the scalars."""

    __slots__ = ("args", "per_launch", "lists", "function", "tasks", "threads", "values")

    def __init__(
        self,
        args: LaunchArgs,
        per_launch: int,
        lists: int,
        function: Any,
        tasks: int,
        threads: int,
        values: list[ctypes.c_int64 | int],
    ) -> None:
        self.args, self.per_launch, self.lists, self.function = args, per_launch, lists, function
        self.tasks, self.threads, self.values = tasks, threads, values


class Launch:
    """One launch queued on the lane's stream: its end event, and a start event where the
    lane times its kernels."""

    def __init__(self, start: DriverEvent | None, done: DriverEvent) -> None:
        self.start, self.done = start, done
        self.launched = 0.0  # when its launch call began (perf_counter)
        self.ended_at = 0.0  # when the host saw it end (perf_counter)

    def wait(self) -> None:
        """Block this thread until the kernel has ended."""
        self.done.synchronize()

    def passed(self) -> bool:
        """Whether the kernel has ended, without waiting; a sticky CUDA error raises."""
        return self.done.query()

    def seconds(self) -> float | None:
        """Seconds on the GPU (after `wait`); None if not timed."""
        return None if self.start is None else self.start.seconds_until(self.done)


async def _polled(launch: Launch, waiter: _Waiter) -> float | None:
    """On the loop: ask whether `launch` has ended between the loop's turns, so that the loop
    never parks while its kernel runs; then its GPU seconds if timed, else None. Parked, the
    loop waits for the waiting thread to wake it, a hop dearest after an idle spell
    (docs/benchmarks.md#seeing-a-kernels-end). Cancelled, it still returns only once the
    kernel has ended."""
    try:
        while not launch.passed():
            await asyncio.sleep(0)  # other work of the loop runs between the asks
    except asyncio.CancelledError:
        await _to_its_end(launch, waiter)  # no byte may land after the caller moved on
        raise
    launch.ended_at = time.perf_counter()
    return launch.seconds()


async def _to_its_end(launch: Launch, waiter: _Waiter) -> None:
    """Return once `launch` has ended, however often the calling task is cancelled meanwhile
    (then its cancel is raised, after the end): a read's outcome must not come before its
    kernel's end. Raises nothing of the kernel's (the read has failed already); where the
    waiting thread is gone or cannot wait, waits on this one."""
    try:
        ended = waiter.ended(launch)
    except ClosedError:
        _wait_here(launch)
        return
    cancel: asyncio.CancelledError | None = None
    while not ended.done():
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError as exc:
            cancel = cancel or exc
        except Exception:  # the kernel's failure, or a thread that could not wait for it
            _wait_here(launch)
            break
    if cancel is not None:
        raise cancel


def _wait_here(launch: Launch) -> None:
    """Block this thread (the launch's own, its context current) until `launch` has ended;
    a sticky CUDA error ends it too, and is the caller's failure already (logged only)."""
    try:
        launch.wait()
    except Exception as exc:
        logger.debug("a failed read's kernel ended with %s", exc)


def _wait_then_wake(
    launch: Launch,
    loop: asyncio.AbstractEventLoop,
    ended: asyncio.Future[float | None],
    watch: Watch | None,
    failure: Exception | None = None,
) -> None:
    """On the lane's waiting thread: block until the kernel ends, tell `watch`, then resolve
    `ended` with its GPU seconds if timed (read here, where the thread is awake, not on the
    loop after its wake), else None. `failure`: the thread cannot wait (no context): fail
    `ended` with it."""
    seconds, error, told = None, failure, False
    if error is None:
        try:
            launch.wait()
            launch.ended_at = time.perf_counter()  # not the loop's wake-up, which a told caller defers
            seconds = launch.seconds()
        except Exception as exc:  # a sticky CUDA error: every later wait fails the same way
            error = exc
        else:
            told = watch is not None and _tell(watch)
    try:
        if told:
            # its caller has its outcome (`Watch.landed`): the loop's continuation goes second
            loop.call_soon_threadsafe(loop.call_later, CALLER_YIELD_SECONDS, _settle, ended, seconds, error)
        else:
            loop.call_soon_threadsafe(_settle, ended, seconds, error)
    except RuntimeError:  # its loop was closed meanwhile: nobody waits for this launch
        pass


def _tell(watch: Watch) -> bool:
    """`watch.landed()`, which must not raise: this thread waits for every launch of the lane."""
    try:
        return watch.landed()
    except Exception:
        logger.exception("a read's watch failed as its kernel ended; its loop reports the read")
        return False


class Ordered(Watch, Protocol):
    """A `Watch` whose caller is a CUDA stream (`DecodeFetcher.fetch(stream=...)`): told on the
    loop's thread as soon as a read's launches are queued, before their end is awaited."""

    def queued(self, stream: torch.cuda.Stream) -> None:
        """The read's kernels are queued on `stream` (the lane's): what is recorded on it now
        passes once they have ended. Never raises."""
        ...


_Wait = tuple[Launch, asyncio.AbstractEventLoop, asyncio.Future[float | None], Watch | None]


def _settle(ended: asyncio.Future[float | None], seconds: float | None, exc: BaseException | None) -> None:
    if not ended.done():  # a cancelled waiter has moved on
        if exc is None:
            ended.set_result(seconds)
        else:
            ended.set_exception(exc)


class _Waiter:
    """A thread of the lane's own that waits for its launches to end, the GPU's context
    current on it, and resolves each launch's future on its loop. Not the default
    executor, which may be busy with other blocking work; and a plain queue rather than a
    thread pool: handing a launch over is one call, where a pool's submit ran tens of
    microseconds of Python on every fetch's path."""

    def __init__(self, kernel: GatherKernel) -> None:
        self._queue: queue.SimpleQueue[_Wait | None] = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._serve, args=(kernel,), name="pdkv-gather-wait", daemon=True).start()

    def _serve(self, kernel: GatherKernel) -> None:
        try:
            kernel.make_current()
            failure: Exception | None = None
        except Exception as exc:  # every wait then fails with it, rather than never ending
            failure = exc
        while (item := self._queue.get()) is not None:
            _wait_then_wake(*item, failure)

    def ended(self, launch: Launch, watch: Watch | None = None) -> asyncio.Future[float | None]:
        """A future of the running loop resolved with `launch`'s GPU seconds (None if
        untimed) once it ended; `watch` is told first, on this thread."""
        if self._closed:  # the thread is gone: the future would never resolve
            raise ClosedError("the GPU lane was closed")
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[float | None] = loop.create_future()
        self._queue.put((launch, loop, ended, watch))
        return ended

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)  # the thread ends after the waits queued before


class Gatherer:
    """Launches gather plans on a stream of its own on `device`; `await` a launch's end.

    `timed`: time each launch on the GPU (a start and an end event, read back before the
    wake-up). Off, a launch's seconds run from its launch call to the host seeing its end:
    the events' timing costs a fetch host time (docs/benchmarks.md#gpu-lane-end-to-end).

    How the end is seen (`poll`): the awaiting loop asks the launch's end event between its
    turns (`_polled`), or parks and the lane's waiting thread wakes it (`_Waiter`). None:
    the loop polls where it runs on the process's main thread (an async caller, whose loop
    waits for this fetch), and parks elsewhere: pdkv's synchronous surface runs its loop on
    a thread beside a scheduler that needs the interpreter lock, which a polling loop would
    keep taking. A read whose caller is told on the waiting thread (a `watch`) parks."""

    def __init__(
        self,
        device: torch.device,
        shape: tuple[int, int] | None = None,
        *,
        timed: bool = False,
        poll: bool | None = None,
    ) -> None:
        self.device = device
        self.index = device.index or 0
        self.kernel = GatherKernel.on(self.index)
        self.stream = torch.cuda.Stream(device)
        self._stream = self.kernel.stream(self.stream.cuda_stream)  # the driver's handle, wrapped once
        self._cu_launch = self.kernel.cu_launch
        self.shape = shape  # (block bytes, warps); None: by the plan's size
        self._waiter = _Waiter(self.kernel)
        self._args = {ids: LaunchArgs(ids) for ids in self.kernel.capacities}  # launches come from one thread
        self._shots: dict[tuple[GatherTable, int], _Shot] = {}  # by table and pages
        self.timed, self.poll = timed, poll
        self._spare: list[Launch] = []  # launches whose events have passed: free to record again

    def _table_on_device(self, table: GatherTable, block: int) -> tuple[int, int]:
        """The table's kernel argument (address, task count), uploaded once per table: queued on
        the lane's stream from pinned memory, ahead of its kernels, so that the host does not
        wait behind the launches already queued there (a synchronous copy would)."""
        key = (self.index, block)
        uploaded = table.on_device.get(key)
        if uploaded is None:
            meta, n_tasks = _meta(table, block)
            host = torch.from_numpy(meta).pin_memory()
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):  # ordered before its kernels
                tensor = host.to(self.device, non_blocking=True)
            # Both tensors kept: the pinned one must outlive its copy, which nothing here waits for.
            uploaded = table.on_device[key] = (tensor.data_ptr(), n_tasks, tensor, host)
        return uploaded[0], uploaded[1]

    def prime(self) -> None:
        """Queue an empty kernel on the lane's stream now, ahead of a launch about to come:
        after an idle spell the GPU then wakes while the host still checks the fetch's pages,
        rather than when the gather arrives."""
        pushed = self.kernel.enter()  # not `current()`: its generator is Python on every fetch's path
        try:
            self.kernel.prime(self._stream)
        finally:
            if pushed:
                self.kernel.leave()

    def launch(self, plan: GatherPlan) -> Launch:
        """Queue `plan` on the lane's stream: one launch, or several where its page ids
        outgrow a launch's parameters."""
        return self.launch_pages(plan.table, plan.src_pages, plan.dst_pages)

    def launch_pages(self, table: GatherTable, src: np.ndarray, dst: np.ndarray) -> Launch:
        """Queue `table`'s copy of source pages `src` (a row per source page list, or one list
        as a 1-D array) into `dst`, every id already checked: the kernel turns ids into
        addresses through the table kept on the GPU, so the host only writes the ids into
        the launch's parameters. How a table's read of so many pages goes out (`_Shot`) is
        worked out once: between a fetch's first step and its launch every Python step
        counts, several times over on a host just woken."""
        pages = len(dst)
        shot = self._shots.get((table, pages))
        launch = self._spare.pop() if self._spare else self._new_launch()
        launch.ended_at = 0.0
        pushed = self.kernel.enter()
        try:
            if shot is None:
                shot = self._shot(table, pages)  # its table's upload needs the context current
            args = shot.args
            args.values[:] = shot.values
            if launch.start is not None:
                launch.start.record(self._stream)
            ids = args.ids
            if src.ndim == 1 and pages <= shot.per_launch:  # the usual: one list, one launch
                ids[:pages] = src
                ids[pages : 2 * pages] = dst
                rc = self._cu_launch(
                    shot.function, shot.tasks, pages, 1, shot.threads, 1, 1, 0, self._stream, args.address, 0
                )[0]
                if rc:
                    self.kernel.check(rc, "cuLaunchKernel")
            else:
                self._launch_split(shot, src, dst)
            launch.done.record(self._stream)
        finally:
            if pushed:
                self.kernel.leave()
        return launch

    def _launch_split(self, shot: _Shot, src: np.ndarray, dst: np.ndarray) -> None:
        """`launch_pages` of several lists, or of more pages than one launch's parameters hold."""
        pages, lists, per_launch, args = len(dst), shot.lists, shot.per_launch, shot.args
        ids, one_list = args.ids, src.ndim == 1
        for page0 in range(0, pages, per_launch):
            n = min(per_launch, pages - page0)
            args.values[3] = n
            if one_list:  # the lists' rows, then the destinations
                ids[:n] = src[page0 : page0 + n]
            else:
                ids[: lists * n].reshape(lists, n)[:] = src[:, page0 : page0 + n]
            ids[lists * n : (lists + 1) * n] = dst[page0 : page0 + n]
            f, tasks, threads = shot.function, shot.tasks, shot.threads
            rc = self._cu_launch(f, tasks, n, 1, threads, 1, 1, 0, self._stream, args.address, 0)[0]
            if rc:
                self.kernel.check(rc, "cuLaunchKernel")

    def _shot(self, table: GatherTable, pages: int) -> _Shot:
        """How `pages` pages of `table` go out (call with the context current: the table is
        uploaded here the first time)."""
        block_bytes, warps = self.shape or _shape(table.page_bytes * pages)
        block = max(1, block_bytes // table.word)
        capacity, per_launch = launch_split(pages, table.lists, self.kernel.capacities)
        meta, n_tasks = self._table_on_device(table, block)
        function = self.kernel.functions[table.word, capacity]
        values: list[ctypes.c_int64 | int] = [meta, table.buffers, n_tasks, min(pages, per_launch), block, table.lists]
        shot = _Shot(self._args[capacity], per_launch, table.lists, function, n_tasks, 32 * warps, values)
        if len(self._shots) >= _SHOTS_KEPT:  # tables come and go with owners, page counts with requests
            self._shots.clear()
        self._shots[table, pages] = shot
        return shot

    def _new_launch(self) -> Launch:
        start = DriverEvent(self.kernel) if self.timed else None
        return Launch(start, DriverEvent(self.kernel, timed=self.timed))

    async def run(self, plan: GatherPlan, watch: Watch | None = None) -> float:
        """Copy `plan` and return once the bytes are in place: its seconds on the GPU if
        timed, else from the launch call to the host seeing its end. `watch` is told on the
        waiting thread as the kernel ends, before this task hears it."""
        if plan.buffers == 0 or plan.pages == 0:
            return 0.0
        return await self.run_pages(plan.table, plan.src_pages, plan.dst_pages, watch)

    async def run_pages(
        self, table: GatherTable, src: np.ndarray, dst: np.ndarray, watch: Watch | None = None
    ) -> float:
        """`run` for pages already checked against `table` (`launch_pages`), none empty. An
        `Ordered` watch is told once they are queued (`queued`), before this task first yields;
        its read's end is then seen as one without a watch's (its caller proves it on the loop)."""
        return await self.landed(self.start(table, src, dst, watch), watch)

    def start(self, table: GatherTable, src: np.ndarray, dst: np.ndarray, watch: Watch | None = None) -> Launch:
        """Queue the copy now (`launch_pages`) and tell an `Ordered` watch; then `landed` for its
        end. Whatever the caller does between the two, it must await `landed` or `settle`: no
        byte may land after its read's outcome is reported."""
        launched = time.perf_counter()
        launch = self.launch_pages(table, src, dst)
        launch.launched = launched
        if (queued := getattr(watch, "queued", None)) is not None:
            queued(self.stream)
        return launch

    async def landed(self, launch: Launch, watch: Watch | None = None) -> float:
        """Once `launch` (from `start`, with the same `watch`) has ended: its seconds on the GPU if
        timed, else from its launch call to the host seeing its end. Cancelled, it raises only
        once the kernel has ended."""
        ordered = watch is not None and hasattr(watch, "queued")
        if (watch is None or ordered) and self.polls():
            seconds = await _polled(launch, self._waiter)
        else:
            # The loop stays free while the GPU copies; the waiting thread wakes this task
            # directly (no executor future in between: each future hop is a turn of the loop).
            try:
                if ordered:  # its caller first: the waiting thread, once woken, takes the GIL
                    await asyncio.sleep(0)
                seconds = await self._waiter.ended(launch, watch)
            except asyncio.CancelledError:
                # Bytes must not land in pages that may be handed out again: wait for the kernel.
                await _to_its_end(launch, self._waiter)
                raise
            except Exception:  # the lane closed under the read, or its thread could not wait
                _wait_here(launch)
                raise
        self._spare.append(launch)
        return launch.ended_at - launch.launched if seconds is None else seconds

    async def settle(self, launch: Launch) -> None:
        """Return once `launch` has ended, for a caller that failed between `start` and
        `landed` (its read's outcome must come after the kernel's end). Raises nothing of the
        kernel's: the read has failed already."""
        if not launch.ended_at:
            await _to_its_end(launch, self._waiter)

    def polls(self) -> bool:
        """Whether the calling loop asks for its launches' ends rather than parking (`poll`)."""
        return self.poll if self.poll is not None else threading.current_thread() is threading.main_thread()

    def close(self) -> None:
        self._waiter.close()
