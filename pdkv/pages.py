"""Page bookkeeping: checked page-id lists and a free-list allocator."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Union

import numpy as np
import torch

from pdkv.errors import CapacityError, InvalidPagesError, PageRangeError

__all__ = ["PageAllocator", "PageIds", "bounded_ids", "has_repeats", "page_ids"]

PageIds = Union[Sequence[int], np.ndarray, torch.Tensor]

logger = logging.getLogger(__name__)


def page_ids(pages: PageIds, num_pages: int, what: str = "pages") -> np.ndarray:
    """`pages` as a 1-D int64 array of distinct ids in [0, num_pages), or a typed error.

    Accepts a sequence of Python or numpy integers, an integer numpy array, or an integer
    torch tensor on any device. Refuses floats and bools (`[1.7]` must not read into page
    1), other shapes, and duplicates (two pages of a request landing in one page lose KV).
    The array is always this call's own, never a view of the caller's: what was checked
    here stays checked (a GPU lane plan trusts these bounds) whatever the caller changes.
    """
    items: list[int] | None = None
    if isinstance(pages, torch.Tensor):
        if pages.dtype.is_floating_point or pages.dtype.is_complex or pages.dtype == torch.bool:
            raise InvalidPagesError(f"{what}: a tensor of {pages.dtype}, not of integers")
        pages = pages.detach().to("cpu", torch.int64).numpy()
    elif not isinstance(pages, np.ndarray):
        items = list(pages) if isinstance(pages, (Sequence, range)) and not isinstance(pages, (str, bytes)) else None
        # The items' distinct types, not each item: a 512-page list took 155 us item by item.
        if items is None or not all(_integer_type(t) for t in set(map(type, items))):
            raise InvalidPagesError(f"{what}: expected a 1-D sequence of integer page ids")
        pages = np.array(items, dtype=np.int64).reshape(-1)
    if pages.ndim != 1:
        raise InvalidPagesError(f"{what}: expected 1-D page ids, got shape {pages.shape}")
    if pages.size and pages.dtype.kind not in "iu":
        raise InvalidPagesError(f"{what}: page ids of dtype {pages.dtype}, not integers")
    out = pages.astype(np.int64, copy=items is None)  # a list's array is ours already
    if out.size:
        # A set of Python ints answers both checks. Not a sort: on a host just woken from idle
        # (a decode between requests) numpy's sort and compares ran twice as long, their code
        # cold; a set of a request's pages costs a few microseconds more when warm.
        distinct = set(out.tolist() if items is None else items)
        if min(distinct) < 0 or max(distinct) >= num_pages:
            raise PageRangeError(f"{what}: page ids outside [0, {num_pages})")
        if len(distinct) != out.size:
            raise InvalidPagesError(f"{what}: page ids repeat (two pages would land in one)")
    return out


def bounded_ids(pages: PageIds, num_pages: int, what: str = "pages") -> np.ndarray | None:
    """The ids of a 1-D integer numpy array or CPU tensor as an int64 array of this call's
    own, each in [0, num_pages), or a `PageRangeError`; None for pages in any other form
    (a list, a GPU tensor, a numpy subclass such as a masked array). The part of `page_ids`
    that a copy into the pool needs to touch only its pages: one reduction, for a caller
    that launches a copy before the rest (`page_ids` on what this returns: whether an id
    repeats)."""
    if isinstance(pages, torch.Tensor) and pages.device.type == "cpu" and pages.dtype in _TORCH_INTEGERS:
        pages = pages.detach().numpy()
    if type(pages) is not np.ndarray or pages.ndim != 1 or pages.dtype.kind not in "iu":
        return None
    out = pages.astype(np.int64)
    # Seen unsigned, a negative id (or a uint64 past int64's range) is above any bound.
    if out.size and int(out.view(np.uint64).max()) >= num_pages:
        raise PageRangeError(f"{what}: page ids outside [0, {num_pages})")
    return out


_TORCH_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _integer_type(t: type) -> bool:
    """An integer type other than bool (`True` must not read into page 1)."""
    return issubclass(t, (int, np.integer)) and not issubclass(t, (bool, np.bool_))


def has_repeats(ids: np.ndarray) -> bool:
    """Whether any id occurs twice. A sort and a neighbour compare: numpy's `unique`
    hashes and took 20x as long for a 32k-token request's 4,096 pages (641 vs 34 us)."""
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


class PageAllocator:
    """Hands out page indices of one pool; page 0 stays reserved as SGLang's padding page."""

    def __init__(self, num_pages: int, order: np.ndarray | None = None) -> None:
        """`order`: the free list to start from (pages 1..num_pages-1, each once); default ascending."""
        if num_pages < 2:
            raise CapacityError(f"a pool needs at least 2 pages, got {num_pages}")
        self.num_pages = num_pages
        pages = np.arange(1, num_pages, dtype=np.int64)
        if order is not None:
            if not np.array_equal(np.sort(np.asarray(order, dtype=np.int64)), pages):
                raise PageRangeError(f"an allocator's order must hold pages 1..{num_pages - 1} once each")
            pages = np.asarray(order, dtype=np.int64)
        self._free: deque[int] = deque(pages.tolist())
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise CapacityError(f"asked for {n} pages, {len(self._free)} free")
        out = np.fromiter((self._free.popleft() for _ in range(n)), dtype=np.int64, count=n)
        self._used.update(out.tolist())
        return out

    def free(self, pages: np.ndarray | list[int]) -> None:
        items = [int(p) for p in pages]
        unknown = [p for p in items if p not in self._used]
        if unknown:
            raise PageRangeError(f"freeing pages that are not allocated: {unknown[:8]}")
        self._used.difference_update(items)
        self._free.extend(items)
