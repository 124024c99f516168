"""Contiguous layer shards across the CP ranks of one prefill engine.

The plan matches SGLang's `get_layer_shard_range` exactly, so that a pdkv prefill rank
owns the same layers an SGLang one would.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pdkv.errors import LayoutError, PageRangeError

__all__ = ["get_layer_shard_range", "get_layer_owner", "ShardPlan"]


def _check(shard_size: int, total_layers: int) -> None:
    if shard_size <= 0 or total_layers <= 0:
        raise LayoutError(f"shard_size and total_layers must be positive, got {shard_size}, {total_layers}")


def get_layer_shard_range(rank: int, shard_size: int, total_layers: int) -> tuple[int, int]:
    """The local layers [start, end) that `rank` of `shard_size` ranks owns."""
    _check(shard_size, total_layers)
    if not 0 <= rank < shard_size:
        raise LayoutError(f"rank {rank} outside [0, {shard_size})")
    base, rem = divmod(total_layers, shard_size)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def get_layer_owner(layer_idx: int, shard_size: int, total_layers: int) -> int:
    """The rank that owns local layer `layer_idx`, in O(1)."""
    _check(shard_size, total_layers)
    if not 0 <= layer_idx < total_layers:
        raise PageRangeError(f"layer {layer_idx} outside [0, {total_layers})")
    base, rem = divmod(total_layers, shard_size)
    # The first `rem` ranks own base+1 layers each, the rest own base.
    wide = rem * (base + 1)
    if layer_idx < wide:
        return layer_idx // (base + 1)
    return rem + (layer_idx - wide) // base


@dataclass(frozen=True)
class ShardPlan:
    """One rank's view of the layer split, in global layer ids."""

    rank: int
    size: int
    layer_num: int
    start_layer: int = 0

    def __post_init__(self) -> None:
        get_layer_shard_range(self.rank, self.size, self.layer_num)  # validates

    def range_of(self, rank: int) -> tuple[int, int]:
        start, end = get_layer_shard_range(rank, self.size, self.layer_num)
        return self.start_layer + start, self.start_layer + end

    # Cached: the layer-split pool asks these several times a layer on the prefill's
    # critical path.
    @cached_property
    def owned(self) -> range:
        return range(*self.range_of(self.rank))

    @cached_property
    def _owners(self) -> tuple[int, ...]:
        return tuple(get_layer_owner(i, self.size, self.layer_num) for i in range(self.layer_num))

    def owner_of(self, layer_id: int) -> int:
        local = layer_id - self.start_layer
        if not 0 <= local < self.layer_num:
            raise PageRangeError(f"layer {local} outside [0, {self.layer_num})")
        return self._owners[local]

    def owns(self, layer_id: int) -> bool:
        return layer_id in self.owned

    def ranges(self) -> list[tuple[int, int]]:
        return [self.range_of(r) for r in range(self.size)]

    def describe(self) -> str:
        parts = "; ".join(f"r{r}:[{s},{e})" for r, (s, e) in enumerate(self.ranges()))
        return f"layers={self.layer_num} cp={self.size} rank={self.rank} plan={parts}"
