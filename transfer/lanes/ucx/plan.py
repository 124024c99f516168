"""READ plans: the descriptors of one batched one-sided READ, computed without I/O."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transfer.lanes.runs import BufferPair, check_pages, page_runs


@dataclass(frozen=True)
class ReadPlan:
    """Descriptor arrays (addr, len, dev) for one batched READ, local and remote."""

    local: np.ndarray
    remote: np.ndarray
    nbytes: int

    @property
    def descriptors(self) -> int:
        return len(self.local)


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
    check_pages(src, table.remote_items, "source")
    check_pages(dst, table.local_items, "destination")
    item, lbase, rbase, ldev, rdev = table.item, table.lbase, table.rbase, table.ldev, table.rdev
    lengths = (runs.length[None, :] * item).reshape(-1)
    ones = np.ones((1, len(runs)), dtype=np.int64)
    local = np.stack([(lbase + runs.dst_start[None, :] * item).reshape(-1), lengths, (ldev * ones).reshape(-1)], axis=1)
    remote = np.stack(
        [(rbase + runs.src_start[None, :] * item).reshape(-1), lengths, (rdev * ones).reshape(-1)], axis=1
    )
    return ReadPlan(local, remote, int(lengths.sum()))
