"""Gather plans: one kernel launch's table and page lists, computed without I/O."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from pdkv.errors import PageRangeError
from transfer.lanes.runs import BufferPair, check_pages


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
            check_pages(row, limit, "source")
        if dst_below is None or dst_below > table.dst_items:
            check_pages(dst, table.dst_items, "destination")
    src = rows[0].reshape(1, -1) if len(rows) == 1 else np.stack(rows) if rows else np.zeros((0, dst.size), np.int64)
    return GatherPlan(table, src, dst)


def route_pages(
    table: GatherTable, src: np.ndarray, dst: np.ndarray, dst_below: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One source page list and its destinations for `table` (a route's: one list), checked
    as `gather_plan` checks them, without building a plan: int64 arrays of one shape, each
    id below its side's items (`dst_below`: the destinations already lie below it; None:
    check them too)."""
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    if dst.ndim != 1 or src.shape != dst.shape:
        raise PageRangeError(f"{src.size} source pages but {dst.size} destination pages of shape {dst.shape}")
    if table.buffers and table.lists != 1:
        raise ValueError(f"one source page list for a table of {table.lists}")
    if table.buffers and dst.size:
        check_pages(src, table.src_limits[0], "source")
        if dst_below is None or dst_below > table.dst_items:
            check_pages(dst, table.dst_items, "destination")
    return src, dst


def build_gather_plan(buffers: list[BufferPair], src_pages: np.ndarray, dst_pages: np.ndarray) -> GatherPlan:
    """The launch that copies `src_pages` of every buffer into `dst_pages` of its twin."""
    table = gather_table(buffers)
    return gather_plan(table, [src_pages] * table.lists, dst_pages)
