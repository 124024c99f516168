"""Pages and buffers as every lane sees them: page runs, buffer pairs, page-id checks.

A request's pages are the same on every layer, so the run structure (where the source
and destination page lists are both consecutive) is found once, then laid over every
layer and buffer kind with numpy broadcasting. Runs contiguous on both sides become one
descriptor (or one gather task): fewer, larger pieces are what every lane is fast at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdkv.errors import PageRangeError


def mem_type(device: torch.device) -> str:
    """NIXL's memory type for buffers on `device`."""
    return "VRAM" if device.type == "cuda" else "DRAM"


def device_id(device: torch.device) -> int:
    """The GPU index NIXL descriptors carry; 0 for host memory."""
    return (device.index or 0) if device.type == "cuda" else 0


@dataclass(frozen=True)
class PageRuns:
    """Maximal runs where src and dst pages both step by one."""

    src_start: np.ndarray
    dst_start: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.length)


def page_runs(src_pages: np.ndarray, dst_pages: np.ndarray, merge: bool = True) -> PageRuns:
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise PageRangeError(f"{src.size} source pages but {dst.size} destination pages")
    if not merge or src.size == 0:
        return PageRuns(src, dst, np.ones_like(src))
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return PageRuns(src[starts], dst[starts], lengths)


@dataclass(frozen=True)
class BufferPair:
    """One layer's buffer of one kind on both sides: base addresses and page geometry."""

    local_addr: int
    remote_addr: int
    item_len: int
    local_items: int
    remote_items: int
    local_dev: int = 0  # GPU index, 0 for host memory
    remote_dev: int = 0


def check_pages(pages: np.ndarray, limit: int, side: str) -> None:
    # One reduction: seen unsigned, a negative id is larger than any limit.
    if pages.size and int(pages.view(np.uint64).max()) >= limit:
        raise PageRangeError(f"{side} pages [{pages.min()}, {pages.max()}] outside [0, {limit})")
