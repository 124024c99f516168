"""The same-host GPU lane's copy: one gather kernel per batch of layers.

A batch is every layer of the batch and both kinds (latent, indexer): a table of
per-buffer source and destination base pointers and item lengths, and the request's
source and destination page ids. The work is cut into tasks, one a block-sized chunk of
one buffer's item; program (t, i) copies task `t` of the request's i-th page. A table of
tasks (rather than a grid of buffers x the largest item's chunks) leaves no program
idle: with DSA's 41 KiB latent and 8 KiB indexer items, a third of the programs of that
grid had nothing to copy. On an H200 the kernel moves a 32k-token DSA request at
0.91-0.93x a contiguous device copy, where UCX cuda_ipc (8 us a descriptor) reached 0.01x
(docs/benchmarks.md). The kernel and its launch through the driver: `transfer.gather_kernel`.

Every pointer and page id in a plan is validated on the host before the launch
(`transfer.plan.gather_plan`, `IpcMapping.translate`): a bad one would fault the
decode's GPU context and with it every request on that GPU.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from transfer.gather_kernel import DriverEvent, GatherKernel, LaunchArgs
from transfer.plan import GatherPlan, GatherTable

__all__ = ["GatherLane", "Launch"]

_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension: pages per launch
_STAGING_KEPT = 8  # pinned page-id buffers kept for launches queued at once


def _shape(nbytes: int) -> tuple[int, int]:
    """Block bytes and warps: bigger blocks pay off once a launch fills the GPU many times."""
    return (8192, 8) if nbytes >= 1 << 30 else (4096, 4)


def _meta(table: GatherTable, block_words: int) -> tuple[np.ndarray, int]:
    """The kernel's table argument (see the kernel) and its task count."""
    rows = table.table.copy()
    rows[2] //= table.word  # item lengths in words
    chunks = -(-rows[2] // block_words)
    task_buf = np.repeat(np.arange(table.buffers, dtype=np.int64), chunks)
    first = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    task_off = (np.arange(len(task_buf), dtype=np.int64) - np.repeat(first, chunks)) * block_words
    return np.concatenate([rows.reshape(-1), task_buf, task_off]).astype(np.int64, copy=False), len(task_buf)


class _Staged:
    """A pinned host buffer that carries one launch's page ids to the GPU."""

    def __init__(self, words: int) -> None:
        self.tensor = torch.empty(max(words, 1 << 12), dtype=torch.int64, pin_memory=True)
        self.view = self.tensor.numpy()
        self.addr = self.tensor.data_ptr()
        self.after: DriverEvent | None = None  # recorded after the copy from it: passed, it may be rewritten


class _Staging:
    """Pinned buffers for page ids, each rewritten only once the copy queued from it has run:
    the driver's copy is asynchronous, so a buffer rewritten sooner would send one launch
    another's page ids. A buffer's marker is its launch's end, so this costs no event."""

    def __init__(self) -> None:
        self._buffers: list[_Staged] = []

    def take(self, words: int) -> _Staged:
        """A buffer of at least `words` int64 free to write."""
        for staged in self._buffers:
            if staged.view.size >= words and (staged.after is None or staged.after.query()):
                return staged
        if len(self._buffers) >= _STAGING_KEPT:  # launches queued at once came and went: drop a free one
            free = next((b for b in self._buffers if b.after is None or b.after.query()), None)
            if free is not None:
                self._buffers.remove(free)
        staged = _Staged(words)
        self._buffers.append(staged)
        return staged


class Launch:
    """One launch queued on the lane's stream: its events, waited on and timed."""

    def __init__(self, start: DriverEvent, done: DriverEvent) -> None:
        self.start, self.done = start, done
        self.staged: _Staged | None = None  # the pinned buffer its page ids went from

    def wait(self) -> None:
        """Block this thread until the kernel has ended."""
        self.done.synchronize()

    def seconds(self) -> float:
        """Seconds on the GPU (after `wait`)."""
        return self.start.seconds_until(self.done)


def _wait_then_wake(launch: Launch, loop: asyncio.AbstractEventLoop, ended: asyncio.Future[float]) -> None:
    """On the lane's waiting thread: block until the kernel ends, then resolve `ended` with
    its GPU seconds (read here, where the thread is awake, not on the loop after its wake)."""
    try:
        launch.wait()
        seconds = launch.seconds()
    except BaseException as exc:
        loop.call_soon_threadsafe(_settle, ended, 0.0, exc)
        raise
    loop.call_soon_threadsafe(_settle, ended, seconds, None)


def _settle(ended: asyncio.Future[float], seconds: float, exc: BaseException | None) -> None:
    if not ended.done():  # a cancelled waiter has moved on
        if exc is None:
            ended.set_result(seconds)
        else:
            ended.set_exception(exc)


class GatherLane:
    """Launches gather plans on a stream of its own on `device`; `await` a launch's end."""

    def __init__(self, device: torch.device, shape: tuple[int, int] | None = None) -> None:
        self.device = device
        self.index = device.index or 0
        self.kernel = GatherKernel.on(self.index)
        self.stream = torch.cuda.Stream(device)
        self._stream = self.stream.cuda_stream
        self.shape = shape  # (block bytes, warps); None: by the plan's size
        # Waits for kernels on a thread of the lane's own, with the GPU's context current:
        # the default executor may be busy with other blocking work, and this wait is on
        # every fetch's path.
        self._waiter = ThreadPoolExecutor(1, "pdkv-gather-wait", initializer=self.kernel.make_current)
        self._staging = _Staging()
        self._args = LaunchArgs()  # launches come from the loop's thread
        # Kernels on the lane's stream read the device buffer in order: each launch may overwrite it.
        self._pages = torch.empty(0, dtype=torch.int64, device=device)
        self._timing: list[Launch] = []  # event pairs to reuse

    def _table_on_device(self, table: GatherTable, block: int) -> tuple[int, int]:
        """The table's kernel argument (address, task count), uploaded once per table."""
        key = (self.index, block)
        if key not in table.on_device:
            meta, n_tasks = _meta(table, block)
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):  # ordered before its kernels
                table.on_device[key] = (torch.from_numpy(meta).to(self.device, non_blocking=False), n_tasks)
        tensor, n_tasks = table.on_device[key]
        return tensor.data_ptr(), n_tasks

    def _upload_pages(self, plan: GatherPlan) -> tuple[int, _Staged]:
        """Queue the plan's page ids' copy to the GPU on the lane's stream: their address
        there, and the pinned buffer they went from."""
        n = plan.src_pages.size + plan.pages
        if self._pages.numel() < n:  # allocated for the lane's stream: kernels queued on it keep the old one alive
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                self._pages = torch.empty(max(n, 1 << 12), dtype=torch.int64, device=self.device)
        staged = self._staging.take(n)
        staged.view[: plan.src_pages.size] = plan.src_pages.reshape(-1)
        staged.view[plan.src_pages.size : n] = plan.dst_pages
        pages = self._pages.data_ptr()
        self.kernel.upload(pages, staged.addr, 8 * n, self._stream)
        return pages, staged

    def launch(self, plan: GatherPlan) -> Launch:
        """Queue `plan` on the lane's stream."""
        block_bytes, warps = self.shape or _shape(plan.nbytes)
        block = max(1, block_bytes // plan.word)
        launch = self._timing.pop() if self._timing else Launch(DriverEvent(self.kernel), DriverEvent(self.kernel))
        pushed = self.kernel.enter()
        try:
            meta, n_tasks = self._table_on_device(plan.table, block)
            pages, staged = self._upload_pages(plan)
            launch.start.record(self._stream)
            for page0 in range(0, plan.pages, _MAX_GRID_Y):
                grid = (n_tasks, min(_MAX_GRID_Y, plan.pages - page0))
                args = (meta, pages, plan.buffers, n_tasks, plan.pages, plan.src_pages.size, page0, block)
                self._args.values[:] = args
                self.kernel.launch(plan.word, grid, 32 * warps, self._stream, self._args)
            launch.done.record(self._stream)
            staged.after, launch.staged = launch.done, staged
        finally:
            if pushed:
                self.kernel.leave()
        return launch

    async def run(self, plan: GatherPlan) -> float:
        """Copy `plan` and return once the bytes are in place: seconds on the GPU."""
        if plan.buffers == 0 or plan.pages == 0:
            return 0.0
        launch = self.launch(plan)
        # The loop stays free while the GPU copies; the waiting thread wakes this task
        # directly (no executor future in between: each future hop is a turn of the loop).
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[float] = loop.create_future()
        self._waiter.submit(_wait_then_wake, launch, loop, ended)
        try:
            seconds = await ended
        except asyncio.CancelledError:
            # Bytes must not land in pages that may be handed out again: wait for the kernel.
            await loop.run_in_executor(self._waiter, launch.wait)
            raise
        staged = launch.staged
        if staged is not None and staged.after is launch.done:  # not taken by a later launch meanwhile
            staged.after = None  # its copy ran: rewritable without asking the driver
        self._timing.append(launch)  # both events recorded and passed: free to record again
        return seconds

    def close(self) -> None:
        self._waiter.shutdown(wait=False)
