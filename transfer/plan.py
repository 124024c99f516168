"""Transfer plans: which bytes to read, computed without I/O.

A request's pages are the same on every layer, so the run structure (where the source
and destination page lists are both consecutive) is found once, then laid over every
layer and buffer kind with numpy broadcasting. Runs contiguous on both sides become one
descriptor: fewer, larger descriptors are what UCX is fast at.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdkv.errors import IncompatibleLayoutError, MetadataError, PageRangeError
from pdkv.layout import BufferKind
from pdkv.pool import DSAKVPool
from transfer.metadata import EngineDescriptor, RankDescriptor

__all__ = [
    "PageRuns",
    "page_runs",
    "BufferPair",
    "ReadPlan",
    "build_read_plan",
    "GatherPlan",
    "build_gather_plan",
    "merge_gather_plans",
    "check_owners",
    "buffer_pairs",
    "device_id",
    "mem_type",
]


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


@dataclass(frozen=True)
class ReadPlan:
    """Descriptor arrays (addr, len, dev) for one batched READ, local and remote."""

    local: np.ndarray
    remote: np.ndarray
    nbytes: int

    @property
    def descriptors(self) -> int:
        return len(self.local)


def _check_pages(pages: np.ndarray, limit: int, side: str) -> None:
    if pages.size and (pages.min() < 0 or pages.max() >= limit):
        raise PageRangeError(f"{side} pages [{pages.min()}, {pages.max()}] outside [0, {limit})")


def build_read_plan(
    buffers: list[BufferPair],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    merge: bool = True,
) -> ReadPlan:
    """Descriptors reading `src_pages` of every buffer into `dst_pages` of its local twin."""
    runs = page_runs(src_pages, dst_pages, merge)
    src, dst = np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64)
    if not buffers or len(runs) == 0:
        empty = np.zeros((0, 3), dtype=np.int64)
        return ReadPlan(empty, empty, 0)
    _check_pages(src, min(b.remote_items for b in buffers), "source")
    _check_pages(dst, min(b.local_items for b in buffers), "destination")
    item = np.array([b.item_len for b in buffers], dtype=np.int64)[:, None]
    lbase = np.array([b.local_addr for b in buffers], dtype=np.int64)[:, None]
    rbase = np.array([b.remote_addr for b in buffers], dtype=np.int64)[:, None]
    ldev = np.array([b.local_dev for b in buffers], dtype=np.int64)[:, None]
    rdev = np.array([b.remote_dev for b in buffers], dtype=np.int64)[:, None]
    lengths = (runs.length[None, :] * item).reshape(-1)
    ones = np.ones((1, len(runs)), dtype=np.int64)
    local = np.stack([(lbase + runs.dst_start[None, :] * item).reshape(-1), lengths, (ldev * ones).reshape(-1)], axis=1)
    remote = np.stack(
        [(rbase + runs.src_start[None, :] * item).reshape(-1), lengths, (rdev * ones).reshape(-1)], axis=1
    )
    return ReadPlan(local, remote, int(lengths.sum()))


@dataclass(frozen=True)
class GatherPlan:
    """One gather-kernel launch, every address already local to the decode and checked.

    `table` rows, one column a buffer: source base, destination base, item bytes, and the
    offset of the buffer's source page list in `src_pages` (owners of one request may
    keep it in different pages; every list has `pages` entries, one per `dst_pages`).
    """

    table: np.ndarray  # int64 (4, buffers)
    src_pages: np.ndarray  # the source page lists, concatenated
    dst_pages: np.ndarray
    word: int  # bytes a load moves: the largest of 8, 4, 2, 1 that every address and length allows

    @property
    def buffers(self) -> int:
        return self.table.shape[1]

    @property
    def pages(self) -> int:
        return len(self.dst_pages)

    @property
    def nbytes(self) -> int:
        return int(self.table[2].sum()) * self.pages


def _word(*arrays: np.ndarray) -> int:
    every = np.concatenate(arrays)
    return next(w for w in (8, 4, 2, 1) if not (every % w).any())


def build_gather_plan(buffers: list[BufferPair], src_pages: np.ndarray, dst_pages: np.ndarray) -> GatherPlan:
    """The launch that copies `src_pages` of every buffer into `dst_pages` of its twin.

    `remote_addr` of each pair must already be the address the decode's GPU reads the
    owner's buffer at. Page ids are checked against both sides' item counts here, on the
    host: a kernel given a bad one would fault the decode's GPU context.
    """
    src, dst = np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise PageRangeError(f"{src.size} source pages but {dst.size} destination pages")
    if not buffers or src.size == 0:
        return GatherPlan(np.zeros((4, 0), np.int64), src[:0], dst, 1)
    _check_pages(src, min(b.remote_items for b in buffers), "source")
    _check_pages(dst, min(b.local_items for b in buffers), "destination")
    rbase = np.array([b.remote_addr for b in buffers], dtype=np.int64)
    lbase = np.array([b.local_addr for b in buffers], dtype=np.int64)
    item = np.array([b.item_len for b in buffers], dtype=np.int64)
    table = np.stack([rbase, lbase, item, np.zeros_like(item)])
    return GatherPlan(table, src, dst, _word(rbase, lbase, item))


def merge_gather_plans(plans: list[GatherPlan]) -> GatherPlan:
    """One launch for several plans into the same destination pages (owners of one room)."""
    plans = [p for p in plans if p.buffers]
    if not plans:
        raise ValueError("nothing to merge")
    dst = plans[0].dst_pages
    if any(not np.array_equal(p.dst_pages, dst) for p in plans):
        raise PageRangeError("merged gather plans must share their destination pages")
    tables, srcs, offset = [], [], 0
    for p in plans:
        t = p.table.copy()
        t[3] += offset
        tables.append(t)
        srcs.append(p.src_pages)
        offset += len(p.src_pages)
    table = np.concatenate(tables, axis=1)
    return GatherPlan(table, np.concatenate(srcs), dst, min(p.word for p in plans))


def check_owners(desc: EngineDescriptor, pool: DSAKVPool) -> None:
    """An engine a decode with `pool` can read: every rank of our geometry, every layer
    owned by exactly one rank."""
    layout = pool.layout
    covered: list[int] = []
    for rank in desc.ranks:
        rank.layout.check_against(layout)
        covered += range(rank.layer_start, rank.layer_end)
    if sorted(covered) != list(range(layout.start_layer, layout.end_layer)):
        raise MetadataError(f"engine {desc.engine_id}: owners do not cover every layer exactly once")


def buffer_pairs(rank: RankDescriptor, pool: DSAKVPool) -> dict[int, tuple[BufferPair, BufferPair]]:
    """For each layer `rank` owns: its (latent, indexer) buffers paired with `pool`'s."""
    layout = pool.layout
    local = {
        BufferKind.LATENT: (pool.kv_buffer, layout.kv_page_bytes),
        BufferKind.INDEX: (pool.index_buffer, layout.index_page_bytes),
    }
    pairs = {}
    for layer in range(rank.layer_start, rank.layer_end):
        both = []
        for kind in (BufferKind.LATENT, BufferKind.INDEX):
            remote = rank.buffer(kind, layer)
            bufs, item = local[kind]
            if remote.item_len != item:
                raise IncompatibleLayoutError(f"{kind.value} item_len {remote.item_len} != local {item}", ("item_len",))
            tensor = bufs[layer - layout.start_layer]
            both.append(
                BufferPair(
                    tensor.data_ptr(),
                    remote.addr,
                    item,
                    tensor.nbytes // item,
                    remote.num_items,
                    device_id(tensor.device),
                    remote.device_id,
                )
            )
        pairs[layer] = (both[0], both[1])
    return pairs
