"""Transfer plans: which bytes to read, computed without I/O.

A request's pages are the same on every layer, so the run structure (where the source
and destination page lists are both consecutive) is found once, then laid over every
layer and buffer kind with numpy broadcasting. Runs contiguous on both sides become one
descriptor: fewer, larger descriptors are what UCX is fast at.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from pdkv.errors import IncompatibleLayoutError, MetadataError, PageRangeError
from pdkv.layout import BufferKind
from transfer.engine_kv import KVBuffers
from transfer.metadata import EngineDescriptor, RankDescriptor

__all__ = [
    "PageRuns",
    "page_runs",
    "BufferPair",
    "ReadPlan",
    "ReadTable",
    "read_table",
    "read_plan",
    "build_read_plan",
    "GatherTable",
    "GatherPlan",
    "gather_table",
    "gather_plan",
    "build_gather_plan",
    "merge_gather_tables",
    "merge_gather_plans",
    "shares_source_pages",
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
    # One reduction: seen unsigned, a negative id is larger than any limit.
    if pages.size and int(pages.view(np.uint64).max()) >= limit:
        raise PageRangeError(f"{side} pages [{pages.min()}, {pages.max()}] outside [0, {limit})")


@dataclass(frozen=True)
class ReadTable:
    """The static half of a READ plan, built once per owner and layer range: per buffer
    (a column each) its bases, item length and devices, and the fewest items of a side."""

    lbase: np.ndarray  # int64 (buffers, 1)
    rbase: np.ndarray
    item: np.ndarray
    ldev: np.ndarray
    rdev: np.ndarray
    local_items: int
    remote_items: int

    @property
    def buffers(self) -> int:
        return len(self.item)


def read_table(buffers: list[BufferPair]) -> ReadTable:
    def column(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64).reshape(-1, 1)

    return ReadTable(
        column([b.local_addr for b in buffers]),
        column([b.remote_addr for b in buffers]),
        column([b.item_len for b in buffers]),
        column([b.local_dev for b in buffers]),
        column([b.remote_dev for b in buffers]),
        min((b.local_items for b in buffers), default=0),
        min((b.remote_items for b in buffers), default=0),
    )


def build_read_plan(
    buffers: list[BufferPair],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    merge: bool = True,
) -> ReadPlan:
    """Descriptors reading `src_pages` of every buffer into `dst_pages` of its local twin."""
    return read_plan(read_table(buffers), src_pages, dst_pages, merge)


def read_plan(table: ReadTable, src_pages: np.ndarray, dst_pages: np.ndarray, merge: bool = True) -> ReadPlan:
    """`table`'s descriptors for these pages; page ids checked against both sides."""
    runs = page_runs(src_pages, dst_pages, merge)
    src, dst = np.asarray(src_pages, np.int64), np.asarray(dst_pages, np.int64)
    if not table.buffers or len(runs) == 0:
        empty = np.zeros((0, 3), dtype=np.int64)
        return ReadPlan(empty, empty, 0)
    _check_pages(src, table.remote_items, "source")
    _check_pages(dst, table.local_items, "destination")
    item, lbase, rbase, ldev, rdev = table.item, table.lbase, table.rbase, table.ldev, table.rdev
    lengths = (runs.length[None, :] * item).reshape(-1)
    ones = np.ones((1, len(runs)), dtype=np.int64)
    local = np.stack([(lbase + runs.dst_start[None, :] * item).reshape(-1), lengths, (ldev * ones).reshape(-1)], axis=1)
    remote = np.stack(
        [(rbase + runs.src_start[None, :] * item).reshape(-1), lengths, (rdev * ones).reshape(-1)], axis=1
    )
    return ReadPlan(local, remote, int(lengths.sum()))


@dataclass(eq=False)  # identity: a lane keys its caches by the table object
class GatherTable:
    """The static half of a gather launch: built once per owner and layer range, kept on
    the GPU by the lane, so a launch carries only its page ids.

    `table` rows, one column a buffer: source base, destination base, item bytes, and the
    source page list the buffer reads (owners of one request may keep it in different
    pages). Every address is already local to the decode and checked.
    """

    table: np.ndarray  # int64 (4, buffers)
    src_items: np.ndarray  # per source page list: its buffers' fewest items (page ids stay below)
    dst_items: int  # the destination buffers' fewest items
    word: int  # bytes a load moves: the largest of 16, 8, 4, 2, 1 that every address and length allows
    on_device: dict[tuple[int, int], Any] = field(default_factory=dict, repr=False)  # the lane's upload

    @property
    def buffers(self) -> int:
        return self.table.shape[1]

    @property
    def lists(self) -> int:
        return len(self.src_items)

    @functools.cached_property
    def src_limits(self) -> tuple[int, ...]:
        """`src_items` as Python ints (a plan checks its pages against them)."""
        return tuple(int(n) for n in self.src_items)

    @functools.cached_property
    def page_bytes(self) -> int:
        return int(self.table[2].sum())


class GatherPlan(msgspec.Struct, frozen=True, eq=False):
    """One gather-kernel launch: a table and the request's pages, every page id checked.
    (A Struct: made on every lane fetch's path, where a frozen dataclass's init cost more.)"""

    table: GatherTable
    src_pages: np.ndarray  # int64 (table.lists, pages): one source page list per row
    dst_pages: np.ndarray

    @property
    def buffers(self) -> int:
        return self.table.buffers

    @property
    def pages(self) -> int:
        return len(self.dst_pages)

    @property
    def word(self) -> int:
        return self.table.word

    @property
    def nbytes(self) -> int:
        return self.table.page_bytes * self.pages


def _word(*arrays: np.ndarray) -> int:
    every = np.concatenate(arrays)
    return next(w for w in (16, 8, 4, 2, 1) if not (every % w).any())


def gather_table(buffers: list[BufferPair]) -> GatherTable:
    """The table of a launch that copies pages of every buffer into its twin (one page list).

    `remote_addr` of each pair must already be the address the decode's GPU reads the
    owner's buffer at.
    """
    if not buffers:
        return GatherTable(np.zeros((4, 0), np.int64), np.zeros(0, np.int64), 0, 1)
    rbase = np.array([b.remote_addr for b in buffers], dtype=np.int64)
    lbase = np.array([b.local_addr for b in buffers], dtype=np.int64)
    item = np.array([b.item_len for b in buffers], dtype=np.int64)
    table = np.stack([rbase, lbase, item, np.zeros_like(item)])
    src_items = np.array([min(b.remote_items for b in buffers)], dtype=np.int64)
    return GatherTable(table, src_items, min(b.local_items for b in buffers), _word(rbase, lbase, item))


def merge_gather_tables(tables: list[GatherTable], shared_pages: bool) -> GatherTable:
    """One table for several (owners of one room). `shared_pages`: every part reads the
    same source page list (a ticket's room is in the same pages on every owner)."""
    tables = [t for t in tables if t.buffers]
    if not tables:
        return gather_table([])
    parts, offset = [], 0
    for t in tables:
        part = t.table.copy()
        part[3] = 0 if shared_pages else part[3] + offset
        parts.append(part)
        offset += t.lists
    src_items = np.concatenate([t.src_items for t in tables])
    if shared_pages:
        src_items = src_items.min(keepdims=True)
    dst_items = min(t.dst_items for t in tables)
    return GatherTable(np.concatenate(parts, axis=1), src_items, dst_items, min(t.word for t in tables))


def gather_plan(
    table: GatherTable, src_lists: list[np.ndarray], dst_pages: np.ndarray, *, dst_below: int | None = None
) -> GatherPlan:
    """`table`'s launch for these pages. Page ids are checked against both sides' item
    counts here, on the host: a kernel given a bad one would fault the decode's GPU context.
    `dst_below`: the destination ids are already known to lie in [0, dst_below) (a fetch's
    `page_ids`); within the table's items they are not checked again."""
    dst = np.asarray(dst_pages, np.int64)
    if dst.ndim != 1:
        raise PageRangeError(f"destination pages of shape {dst.shape}")
    if len(src_lists) != table.lists:
        raise ValueError(f"{len(src_lists)} source page lists for a table of {table.lists}")
    rows = [np.asarray(s, np.int64) for s in src_lists]
    for row in rows:
        if row.shape != dst.shape:
            raise PageRangeError(f"{row.size} source pages but {dst.size} destination pages")
    if table.buffers and dst.size:
        for row, limit in zip(rows, table.src_limits):
            _check_pages(row, limit, "source")
        if dst_below is None or dst_below > table.dst_items:
            _check_pages(dst, table.dst_items, "destination")
    src = rows[0].reshape(1, -1) if len(rows) == 1 else np.stack(rows) if rows else np.zeros((0, dst.size), np.int64)
    return GatherPlan(table, src, dst)


def build_gather_plan(buffers: list[BufferPair], src_pages: np.ndarray, dst_pages: np.ndarray) -> GatherPlan:
    """The launch that copies `src_pages` of every buffer into `dst_pages` of its twin."""
    table = gather_table(buffers)
    return gather_plan(table, [src_pages] * table.lists, dst_pages)


def merge_gather_plans(plans: list[GatherPlan], table: GatherTable | None = None) -> GatherPlan:
    """One launch for several plans into the same destination pages (owners of one room);
    `table`: their tables already merged (a lane's cached one), else merged here."""
    plans = [p for p in plans if p.buffers]
    if not plans:
        raise ValueError("nothing to merge")
    dst = plans[0].dst_pages
    if any(not np.array_equal(p.dst_pages, dst) for p in plans):
        raise PageRangeError("merged gather plans must share their destination pages")
    shared = shares_source_pages(plans)
    if table is None:
        table = merge_gather_tables([p.table for p in plans], shared)
    src = plans[0].src_pages[:1] if shared else np.concatenate([p.src_pages for p in plans])
    return GatherPlan(table, src, dst)


def shares_source_pages(plans: list[GatherPlan]) -> bool:
    """Whether every plan reads one and the same source page list."""
    first = plans[0].src_pages
    return all(p.src_pages.shape[0] == 1 and np.array_equal(p.src_pages, first) for p in plans)


def check_owners(desc: EngineDescriptor, pool: KVBuffers) -> None:
    """An engine a decode with `pool` can read: every rank of our geometry, every layer
    owned by exactly one rank."""
    layout = pool.layout
    covered: list[int] = []
    for rank in desc.ranks:
        rank.layout.check_against(layout)
        covered += range(rank.layer_start, rank.layer_end)
    if sorted(covered) != list(range(layout.start_layer, layout.end_layer)):
        raise MetadataError(f"engine {desc.engine_id}: owners do not cover every layer exactly once")


def buffer_pairs(rank: RankDescriptor, pool: KVBuffers) -> dict[int, tuple[BufferPair, BufferPair]]:
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
