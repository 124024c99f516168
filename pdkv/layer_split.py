"""The layer-split DSA pool: each CP rank holds only the layers it owns.

A read of a layer this rank does not own is served by the owner's broadcast into a
per-rank scratch buffer (one for latent KV, one for the indexer). A prefetch starts that
broadcast early; a write to the layer invalidates the copy.

Reads, prefetches and writes are collective: every rank of the CP group issues them in
the same order, as the ranks of one model forward do. The owner takes part too; it sends
straight from its own buffer and reads that buffer without a copy. Because every rank
runs the same calls, the scratch state below evolves identically on all of them, which
is what keeps the collectives matched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdkv.broadcast import BroadcastHandle, OwnerBroadcaster
from pdkv.buffers import alloc_zeros, byte_rows, check_locations, put, take
from pdkv.layout import KVLayout
from pdkv.pool import DSAKVPool
from pdkv.sharding import ShardPlan

__all__ = ["LayerSplitDSAKVPool", "RemoteLayerCache"]

logger = logging.getLogger(__name__)


@dataclass
class _Flight:
    """A broadcast on its way: what it carries and what to do once it landed."""

    layer_id: int
    handle: BroadcastHandle
    finish: Callable[[], None]


class RemoteLayerCache:
    """One scratch buffer that holds (pages of) at most one non-owned layer.

    A broadcast carries either the whole layer or only the pages a reader asked for:
    the owner packs those pages into a staging tensor, the others unpack it into the
    same pages of their scratch. For a short read of a large pool that is the
    difference between moving the read and moving the pool.
    """

    def __init__(
        self,
        kind: str,
        plan: ShardPlan,
        owned: list[torch.Tensor],
        scratch: torch.Tensor | None,
        broadcaster: OwnerBroadcaster | None,
        page_rows: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.kind = kind
        self._plan = plan
        self._owned = owned  # indexed by local layer; 0-row where not owned
        self._scratch = scratch
        self._broadcaster = broadcaster
        self._page_rows = page_rows  # a buffer as (pages, bytes per page) uint8
        self.valid_layer: int | None = None
        self._pending: _Flight | None = None
        self.broadcasts = 0
        self.bytes_broadcast = 0

    def _target(self, layer_id: int) -> torch.Tensor:
        if self._plan.owns(layer_id):
            return self._owned[layer_id - self._plan.start_layer]
        assert self._scratch is not None  # a rank that owns not every layer has scratch
        return self._scratch

    def _start(self, layer_id: int, pages: torch.Tensor | None) -> _Flight:
        assert self._broadcaster is not None
        target = self._target(layer_id)
        owner = self._plan.owner_of(layer_id)
        what = f"{self.kind} layer {layer_id}"
        if pages is None:
            payload, finish = target, (lambda: None)
        elif self._plan.owns(layer_id):
            payload, finish = take(self._page_rows(target), pages), (lambda: None)
        else:
            rows = self._page_rows(target)
            payload = torch.empty((pages.numel(), rows.shape[1]), dtype=torch.uint8, device=rows.device)
            finish = lambda: put(rows, (pages,), payload)  # noqa: E731
        self.broadcasts += 1
        self.bytes_broadcast += payload.nbytes
        return _Flight(layer_id, self._broadcaster.start(payload, owner, what), finish)

    def _settle_pending(self, keep: bool) -> None:
        if self._pending is None:
            return
        flight, self._pending = self._pending, None
        flight.handle.wait()
        flight.finish()
        self.valid_layer = flight.layer_id if keep else None

    def prefetch(self, layer_id: int, pages: torch.Tensor | None = None) -> None:
        """Start the broadcast of `layer_id` (or of its `pages`) unless cached or on its way."""
        if self._broadcaster is None or self.valid_layer == layer_id:
            return
        if self._pending is not None:
            if self._pending.layer_id == layer_id:
                return
            self._settle_pending(keep=False)  # the scratch is about to be overwritten
        self.valid_layer = None
        idx = None if pages is None else pages.reshape(-1).long()
        self._pending = self._start(layer_id, idx)

    def read(self, layer_id: int) -> torch.Tensor:
        """The buffer holding `layer_id`, broadcasting it first if needed (blocking).

        Where only some pages were prefetched, only those pages are valid in it.
        """
        if self._broadcaster is None:
            return self._owned[layer_id - self._plan.start_layer]
        self.prefetch(layer_id)
        self._settle_pending(keep=True)
        return self._target(layer_id)

    async def read_async(self, layer_id: int, pages: torch.Tensor | None = None) -> torch.Tensor:
        """As `read`, awaiting the broadcast without blocking the event loop."""
        if self._broadcaster is None:
            return self._owned[layer_id - self._plan.start_layer]
        self.prefetch(layer_id, pages)
        if self._pending is not None:
            await self._pending.handle
            self._settle_pending(keep=True)
        return self._target(layer_id)

    def invalidate(self, layer_id: int) -> None:
        """Forget a copy of `layer_id`; a broadcast of it in flight is let land first."""
        if self._pending is not None and self._pending.layer_id == layer_id:
            self._settle_pending(keep=False)
        if self.valid_layer == layer_id:
            self.valid_layer = None


class LayerSplitDSAKVPool(DSAKVPool):
    """A DSA pool for CP rank `plan.rank`: owned layers real, the others read by broadcast."""

    def __init__(
        self, layout: KVLayout, plan: ShardPlan, broadcaster: OwnerBroadcaster | None = None
    ) -> None:
        if plan.layer_num != layout.layer_num or plan.start_layer != layout.start_layer:
            raise ValueError(f"shard plan {plan} does not fit layout {layout}")
        if plan.size > 1 and broadcaster is None:
            raise ValueError("a CP group of more than one rank needs an OwnerBroadcaster")
        super().__init__(layout, plan.owned)
        self.plan = plan
        logger.info("layer-split pool: %s", plan.describe())
        needs_scratch = len(plan.owned) < layout.layer_num
        kv_scratch = index_scratch = None
        if needs_scratch:
            kv_scratch = alloc_zeros(
                (layout.kv_rows, 1, layout.kv_cache_dim), layout.torch_store_dtype, layout.device
            )
            index_scratch = alloc_zeros(
                (layout.index_num_pages, layout.index_page_bytes), torch.uint8, layout.device
            )
        bc = broadcaster if plan.size > 1 else None
        pages = layout.num_pages
        self.remote_kv = RemoteLayerCache(
            "kv", plan, self.kv_buffer, kv_scratch, bc, lambda t: byte_rows(t).view(pages, -1)
        )
        self.remote_index = RemoteLayerCache("index", plan, self.index_buffer, index_scratch, bc, byte_rows)

    def _remote(self, kind: str) -> RemoteLayerCache:
        return self.remote_kv if kind == "kv" else self.remote_index

    def _kv_for_read(self, layer_id: int) -> torch.Tensor:
        self._local(layer_id)
        return self.remote_kv.read(layer_id)

    def _index_for_read(self, layer_id: int) -> torch.Tensor:
        self._local(layer_id)
        return self.remote_index.read(layer_id)

    def _before_write(self, layer_id: int, kind: str) -> None:
        self._local(layer_id)
        self._remote(kind).invalidate(layer_id)

    def invalidate_layer(self, layer_id: int) -> None:
        """Note a write of `layer_id` that happened on its owner only.

        Lets a non-owner keep the collective state in step without building data it
        would drop; equivalent to calling the write methods with the owner's data.
        """
        self._before_write(layer_id, "kv")
        self._before_write(layer_id, "index")

    def prefetch(self, layer_id: int, pages: torch.Tensor | None = None) -> None:
        """Start the broadcasts (latent KV and indexer) of `layer_id`; return at once.

        With `pages`, only those pages travel, and only they are valid in the copy.
        """
        self._local(layer_id)
        self._check_pages(pages)
        self.remote_kv.prefetch(layer_id, pages)
        self.remote_index.prefetch(layer_id, pages)

    async def wait_layer(self, layer_id: int, pages: torch.Tensor | None = None) -> None:
        """Make `layer_id` (or its `pages`) readable without blocking: await its broadcasts.

        After this returns, the pool's read methods for `layer_id` return at once.
        """
        self._local(layer_id)
        self._check_pages(pages)
        await self.remote_kv.read_async(layer_id, pages)
        await self.remote_index.read_async(layer_id, pages)

    def _check_pages(self, pages: torch.Tensor | None) -> None:
        if pages is not None:
            check_locations(pages, self.layout.num_pages, "broadcast pages")

    @property
    def scratch_bytes(self) -> int:
        return sum(
            t.nbytes
            for t in (self.remote_kv._scratch, self.remote_index._scratch)
            if t is not None
        )
