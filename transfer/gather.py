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
from typing import Any

import numpy as np
import torch

from transfer.plan import GatherPlan

__all__ = ["GatherLane"]

_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension: pages per launch


def _shape(nbytes: int) -> tuple[int, int]:
    """Block bytes and warps: bigger blocks pay off once a launch fills the GPU many times."""
    return (8192, 8) if nbytes >= 1 << 30 else (4096, 4)


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gather_pages(meta, n_bufs, n_src, n_pages, n_tasks, page0, WORD: tl.constexpr, BLOCK: tl.constexpr):
        # meta, int64: per buffer src base, dst base, item words, src page list offset
        # (n_bufs each); the source page lists (n_src); the destination pages (n_pages);
        # per task its buffer, then its first word (n_tasks each).
        t = tl.program_id(0)
        i = page0 + tl.program_id(1)
        tasks = meta + 4 * n_bufs + n_src + n_pages
        b = tl.load(tasks + t)
        o = tl.load(tasks + n_tasks + t) + tl.arange(0, BLOCK)
        words = tl.load(meta + 2 * n_bufs + b)
        m = o < words
        src_base = tl.load(meta + b).to(tl.pointer_type(WORD))
        dst_base = tl.load(meta + n_bufs + b).to(tl.pointer_type(WORD))
        sp = tl.load(meta + 4 * n_bufs + tl.load(meta + 3 * n_bufs + b) + i)
        dp = tl.load(meta + 4 * n_bufs + n_src + i)
        tl.store(dst_base + dp * words + o, tl.load(src_base + sp * words + o, mask=m), mask=m)

    return gather_pages


def _word_type(nbytes: int) -> Any:
    import triton.language as tl

    return {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}[nbytes]


def _meta(plan: GatherPlan, block_words: int) -> tuple[np.ndarray, int]:
    """The kernel's one int64 argument array (see the kernel) and its task count."""
    table = plan.table.copy()
    table[2] //= plan.word  # item lengths in words
    chunks = -(-table[2] // block_words)
    task_buf = np.repeat(np.arange(plan.buffers, dtype=np.int64), chunks)
    first = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    task_off = (np.arange(len(task_buf), dtype=np.int64) - np.repeat(first, chunks)) * block_words
    parts = [table.reshape(-1), plan.src_pages, plan.dst_pages, task_buf, task_off]
    return np.concatenate(parts).astype(np.int64, copy=False), len(task_buf)


class GatherLane:
    """Launches gather plans on a stream of its own on `device`; `await` a launch's end."""

    def __init__(self, device: torch.device, shape: tuple[int, int] | None = None) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.shape = shape  # (block bytes, warps); None: by the plan's size

    def launch(self, plan: GatherPlan) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue `plan` on the lane's stream; the events bracket its kernel."""
        block_bytes, warps = self.shape or _shape(plan.nbytes)
        block = max(1, block_bytes // plan.word)
        meta_host, n_tasks = _meta(plan, block)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            meta = torch.from_numpy(meta_host).to(self.device)  # one upload
            start.record(self.stream)
            for page0 in range(0, plan.pages, _MAX_GRID_Y):
                grid = (n_tasks, min(_MAX_GRID_Y, plan.pages - page0))
                _kernel()[grid](
                    meta,
                    plan.buffers,
                    len(plan.src_pages),
                    plan.pages,
                    n_tasks,
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
        ended = asyncio.ensure_future(asyncio.to_thread(done.synchronize))
        try:
            await asyncio.shield(ended)
        except asyncio.CancelledError:
            await ended
            raise
        return start.elapsed_time(done) / 1e3
