"""The same-host GPU lane's copy: one gather kernel per batch of layers.

A batch is every layer of the batch and both kinds (latent, indexer): a table of
per-buffer source and destination base pointers and item lengths, and the request's
source and destination page ids. The work is cut into tasks, one a BLOCK-sized chunk of
one buffer's item; program (t, i) copies task `t` of the request's i-th page. A table of
tasks (rather than a grid of buffers x the largest item's chunks) leaves no program
idle: with DSA's 41 KiB latent and 8 KiB indexer items, a third of the programs of that
grid had nothing to copy. On an H200 the kernel moves a 32k-token DSA request at
0.91-0.93x a contiguous device copy (the old grid: 0.88-0.90x; Triton's own contiguous
copy: 0.91-0.96x), where UCX cuda_ipc (8 us a descriptor) reached 0.01x
(docs/benchmarks.md).

Every pointer and page id in a plan is validated on the host before the launch
(`transfer.plan.build_gather_plan`, `IpcMapping.translate`): a bad one would fault the
decode's GPU context and with it every request on that GPU.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from transfer.plan import GatherPlan, GatherTable

__all__ = ["GatherLane"]

_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension: pages per launch


def _shape(nbytes: int) -> tuple[int, int]:
    """Block bytes and warps: bigger blocks pay off once a launch fills the GPU many times."""
    return (8192, 8) if nbytes >= 1 << 30 else (4096, 4)


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Counts and offsets unspecialised: Triton would otherwise compile a variant per
    # divisibility class of the page count, a first fetch of such a size paying a compile.
    @triton.jit(do_not_specialize=["n_bufs", "n_tasks", "n_pages", "dst0", "page0"])
    def gather_pages(meta, pages, n_bufs, n_tasks, n_pages, dst0, page0, WORD: tl.constexpr, BLOCK: tl.constexpr):
        # meta, int64, the table's (uploaded once): per buffer src base, dst base, item
        # words, source page list (n_bufs each); per task its buffer, then its first word
        # (n_tasks each). pages, int64, the launch's: the source page lists (n_pages each),
        # then the destination pages from dst0.
        t = tl.program_id(0)
        i = page0 + tl.program_id(1)
        b = tl.load(meta + 4 * n_bufs + t)
        o = tl.load(meta + 4 * n_bufs + n_tasks + t) + tl.arange(0, BLOCK)
        words = tl.load(meta + 2 * n_bufs + b)
        m = o < words
        src_base = tl.load(meta + b).to(tl.pointer_type(WORD))
        dst_base = tl.load(meta + n_bufs + b).to(tl.pointer_type(WORD))
        sp = tl.load(pages + tl.load(meta + 3 * n_bufs + b) * n_pages + i)
        dp = tl.load(pages + dst0 + i)
        tl.store(dst_base + dp * words + o, tl.load(src_base + sp * words + o, mask=m), mask=m)

    return gather_pages


def _word_type(nbytes: int) -> Any:
    import triton.language as tl

    return {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[nbytes]


def _meta(table: GatherTable, block_words: int) -> tuple[np.ndarray, int]:
    """The kernel's table argument (see the kernel) and its task count."""
    rows = table.table.copy()
    rows[2] //= table.word  # item lengths in words
    chunks = -(-rows[2] // block_words)
    task_buf = np.repeat(np.arange(table.buffers, dtype=np.int64), chunks)
    first = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    task_off = (np.arange(len(task_buf), dtype=np.int64) - np.repeat(first, chunks)) * block_words
    return np.concatenate([rows.reshape(-1), task_buf, task_off]).astype(np.int64, copy=False), len(task_buf)


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class GatherLane:
    """Launches gather plans on a stream of its own on `device`; `await` a launch's end."""

    def __init__(self, device: torch.device, shape: tuple[int, int] | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.shape = shape  # (block bytes, warps); None: by the plan's size
        # Waits for kernels on a thread of the lane's own: the default executor may be
        # busy with other blocking work, and this wait is on every fetch's path.
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="pdkv-gather-wait")
        # Page ids go up through one pinned buffer into one device buffer: kernels on the
        # lane's stream read the device buffer in order, so each launch may overwrite it.
        self._staged: torch.Tensor | None = None
        self._staged_free = torch.cuda.Event()
        self._pages = torch.empty(0, dtype=torch.int64, device=device)
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # event pairs to reuse

    def _table_on_device(self, table: GatherTable, block: int) -> tuple[torch.Tensor, int]:
        key = (self.device.index or 0, block)
        if key not in table.on_device:
            meta, n_tasks = _meta(table, block)
            table.on_device[key] = (torch.from_numpy(meta).to(self.device), n_tasks)  # on the lane's stream
        return table.on_device[key]  # type: ignore[no-any-return]

    def _upload_pages(self, plan: GatherPlan) -> torch.Tensor:
        """The plan's page ids on the GPU, on the lane's stream (call under it)."""
        n = plan.src_pages.size + plan.pages
        host = self._staged
        if host is None or host.numel() < n or not self._staged_free.query():
            # Pinned, so the copy does not wait on the host. One still queued behind a
            # kernel is left to torch's pinned-memory cache, which reuses it once copied.
            host = self._staged = torch.empty(max(n, 1 << 12), dtype=torch.int64, pin_memory=True)
        view = host.numpy()
        view[: plan.src_pages.size] = plan.src_pages.reshape(-1)
        view[plan.src_pages.size : n] = plan.dst_pages
        if self._pages.numel() < n:  # kernels still reading the old one run first: same stream
            self._pages = torch.empty(host.numel(), dtype=torch.int64, device=self.device)
        self._pages[:n].copy_(host[:n], non_blocking=True)
        self._staged_free.record(self.stream)
        return self._pages

    def launch(self, plan: GatherPlan) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue `plan` on the lane's stream; the events bracket its kernel."""
        block_bytes, warps = self.shape or _shape(plan.nbytes)
        block = max(1, block_bytes // plan.word)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            meta, n_tasks = self._table_on_device(plan.table, block)
            pages = self._upload_pages(plan)
            start, done = self._timing.pop() if self._timing else (_timing_event(), _timing_event())
            start.record(self.stream)
            for page0 in range(0, plan.pages, _MAX_GRID_Y):
                grid = (n_tasks, min(_MAX_GRID_Y, plan.pages - page0))
                _kernel()[grid](
                    meta,
                    pages,
                    plan.buffers,
                    n_tasks,
                    plan.pages,
                    plan.src_pages.size,
                    page0,
                    WORD=_word_type(plan.word),
                    BLOCK=block,
                    num_warps=warps,
                )
            done.record(self.stream)
        return start, done

    async def run(self, plan: GatherPlan) -> float:
        """Copy `plan` and return once the bytes are in place: seconds on the GPU."""
        if plan.buffers == 0 or plan.pages == 0:
            return 0.0
        start, done = self.launch(plan)
        # The loop stays free while the GPU copies. A cancelled caller still waits for the
        # kernel to end: bytes must not land in pages that may be handed out again.
        ended = asyncio.get_running_loop().run_in_executor(self._waiter, done.synchronize)
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            await ended
            raise
        seconds = start.elapsed_time(done) / 1e3
        self._timing.append((start, done))  # both recorded and passed: free to record again
        return seconds

    def close(self) -> None:
        self._waiter.shutdown(wait=False)
