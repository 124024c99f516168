"""The layer-split DSA pool: each CP rank holds only the layers it owns.

A read of a layer this rank does not own is served by the owner's broadcast into a
per-rank scratch buffer (two slots each for latent KV and the indexer). A prefetch starts
that broadcast early; a write to the layer invalidates the copy. A whole layer travels as
one broadcast of its [latent | indexer] region when both kinds land in slots of the same
number, whose scratch lies side by side as the owner's layer does.

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

from pdkv.broadcast import CollectiveHandle, OwnerBroadcaster
from pdkv.buffers import alloc_layers, byte_rows, check_locations, put, take
from pdkv.layout import BufferKind, KVLayout
from pdkv.pool import DSAKVPool
from pdkv.sharding import ShardPlan

__all__ = ["LayerSplitDSAKVPool", "RemoteLayerCache"]

logger = logging.getLogger(__name__)

SCRATCH_SLOTS = 2  # per kind: layer l+1 lands while layer l is read


def _nothing() -> None:
    """What a whole-layer broadcast needs once it landed."""


@dataclass
class _Flight:
    """A broadcast on its way: what it carries and what to do once it landed."""

    handle: CollectiveHandle
    finish: Callable[[], None]


@dataclass(eq=False)  # slots are told apart by identity
class _Slot:
    """One scratch buffer and the layer it holds (or is receiving)."""

    number: int  # the same on every rank, and for both kinds of a layer read whole
    scratch: torch.Tensor | None
    layer_id: int | None = None
    target: torch.Tensor | None = None  # what a read of layer_id returns: the owner's own buffer, else scratch
    pages: torch.Tensor | None = None  # the pages of layer_id it holds; None: all of them
    flight: _Flight | None = None
    used: int = 0  # logical clock of the last prefetch or read, for LRU

    def holds(self, layer_id: int, pages: torch.Tensor | None) -> bool:
        """Whether this slot has (or is receiving) `pages` of `layer_id` (None: all)."""
        if self.layer_id != layer_id:
            return False
        if self.pages is None or pages is self.pages:
            return True
        # Every rank reaches the same answer: the same calls leave the same slot state.
        return pages is not None and bool(torch.isin(pages.reshape(-1), self.pages.reshape(-1)).all())


class RemoteLayerCache:
    """Scratch buffers that hold (pages of) non-owned layers, one layer each.

    Two slots by default, so the broadcast of layer l+1 can land while layer l is still
    being read (the reference keeps one, which serialises the two). A broadcast carries
    either the whole layer or only the pages a reader asked for: the owner packs those
    pages into a staging tensor, the others unpack it into the same pages of their slot.
    """

    def __init__(
        self,
        kind: str,
        plan: ShardPlan,
        owned: list[torch.Tensor],
        scratch: list[torch.Tensor],
        broadcaster: OwnerBroadcaster | None,
        page_rows: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.kind = kind
        self._plan = plan
        self._owned = owned  # indexed by local layer; 0-row where not owned
        self._slots = [_Slot(i, t) for i, t in enumerate(scratch)] or [_Slot(0, None), _Slot(1, None)]
        self._broadcaster = broadcaster
        self._page_rows = page_rows  # a buffer as (pages, bytes per page) uint8
        self._clock = 0
        self.broadcasts = 0
        self.bytes_broadcast = 0

    @property
    def scratch_bytes(self) -> int:
        return sum(s.scratch.nbytes for s in self._slots if s.scratch is not None)

    def _slot_of(self, layer_id: int) -> _Slot | None:
        for slot in self._slots:
            if slot.layer_id == layer_id:
                return slot
        return None

    def _least_recent(self) -> _Slot:
        """The slot to reuse: an empty one, else the one used longest ago."""
        best = self._slots[0]
        for slot in self._slots:
            if slot.layer_id is None:
                return slot
            if slot.used < best.used:
                best = slot
        return best

    def _touch(self, slot: _Slot) -> None:
        self._clock += 1
        slot.used = self._clock

    def _payload(
        self, slot: _Slot, layer_id: int, pages: torch.Tensor | None
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """What travels into claimed `slot` (all of its layer, or its `pages`), and what to do
        once it landed."""
        target = slot.target
        assert target is not None
        if pages is None:
            self.count_whole(slot)
            return target.view(torch.uint8), _nothing  # as bytes: gloo knows no float8
        idx = pages.reshape(-1).long()
        rows = self._page_rows(target)
        if self._plan.owns(layer_id):
            payload, finish = take(rows, idx), _nothing
        else:
            payload = torch.empty((idx.numel(), rows.shape[1]), dtype=torch.uint8, device=rows.device)
            finish = lambda: put(rows, (idx,), payload)  # noqa: E731
        self.bytes_broadcast += payload.nbytes
        return payload, finish

    def count_whole(self, slot: _Slot) -> None:
        """Count the bytes of a whole layer's broadcast into claimed `slot`."""
        assert slot.target is not None
        self.bytes_broadcast += slot.target.nbytes

    @staticmethod
    def _settle(slot: _Slot) -> None:
        if slot.flight is not None:
            flight, slot.flight = slot.flight, None
            flight.handle.wait()
            flight.finish()

    def prefetch(self, layer_id: int, pages: torch.Tensor | None = None) -> None:
        """Start the broadcast of `layer_id` (or of its `pages`) unless held or on its way.

        A slot holding other pages of the layer is refilled with the ones asked for.
        """
        if (slot := self._claim(layer_id, pages)) is not None:
            payload, finish = self._payload(slot, layer_id, pages)
            _start(self, [slot], [payload], layer_id, [finish])

    def _claim(self, layer_id: int, pages: torch.Tensor | None) -> _Slot | None:
        """Claim a slot for `layer_id` (or its `pages`); None: held or on its way already."""
        if self._broadcaster is None:
            return None
        slot = self._slot_of(layer_id)
        if slot is not None and slot.holds(layer_id, pages):
            return None
        victim = slot or self._least_recent()
        if victim.flight is not None:
            self._settle(victim)  # a broadcast into it must land before it is reused
        victim.layer_id, victim.pages = layer_id, pages
        owned = self._plan.owns(layer_id)
        victim.target = self._owned[layer_id - self._plan.start_layer] if owned else victim.scratch
        self.broadcasts += 1
        self._clock += 1  # `_touch`, inline: this runs for every layer on the prefill's critical path
        victim.used = self._clock
        return victim

    def read(self, layer_id: int) -> torch.Tensor:
        """The buffer holding `layer_id`, broadcasting it first if needed (blocking).

        Where only some pages were prefetched or awaited, only those pages are valid in
        it. It stays valid until two other layers have been prefetched or read since.
        """
        if self._broadcaster is None:
            return self._owned[layer_id - self._plan.start_layer]
        slot = self._slot_of(layer_id)
        if slot is None:
            self.prefetch(layer_id)
            slot = self._slot_of(layer_id)
            assert slot is not None
        if slot.flight is not None:
            self._settle(slot)
        self._touch(slot)
        assert slot.target is not None
        return slot.target

    async def read_async(self, layer_id: int, pages: torch.Tensor | None = None) -> torch.Tensor:
        """As `read`, awaiting the broadcast without blocking the event loop."""
        if self._broadcaster is None:
            return self._owned[layer_id - self._plan.start_layer]
        self.prefetch(layer_id, pages)
        slot = self._slot_of(layer_id)
        assert slot is not None
        if slot.flight is not None:
            await slot.flight.handle
            self._settle(slot)
        self._touch(slot)
        assert slot.target is not None
        return slot.target

    def invalidate(self, layer_id: int) -> None:
        """Forget a copy of `layer_id`; a broadcast of it in flight is let land first."""
        slot = self._slot_of(layer_id)
        if slot is not None:
            self._settle(slot)
            slot.layer_id = None

    def clear(self) -> None:
        """Forget every copy (letting broadcasts in flight land)."""
        for slot in self._slots:
            self._settle(slot)
            slot.layer_id = None


def _start(
    cache: RemoteLayerCache,
    slots: list[_Slot],
    payloads: list[torch.Tensor],
    layer_id: int,
    finishes: list[Callable[[], None]] | None = None,
) -> None:
    """Broadcast `payloads` from the owner of `layer_id` as one collective into the claimed
    `slots`; each slot's finish (default: nothing) runs once it landed."""
    broadcaster = cache._broadcaster
    assert broadcaster is not None
    try:
        handle = broadcaster.start(payloads, cache._plan.owner_of(layer_id), f"layer {layer_id}")
    except BaseException:
        for slot in slots:  # nothing is on its way into them
            slot.layer_id = None
        raise
    if finishes is None:
        slots[0].flight = flight = _Flight(handle, _nothing)
        for slot in slots[1:]:
            slot.flight = flight
    else:
        for slot, finish in zip(slots, finishes):
            slot.flight = _Flight(handle, finish)


class LayerSplitDSAKVPool(DSAKVPool):
    """A DSA pool for CP rank `plan.rank`: owned layers real, the others read by broadcast."""

    def __init__(self, layout: KVLayout, plan: ShardPlan, broadcaster: OwnerBroadcaster | None = None) -> None:
        if plan.layer_num != layout.layer_num or plan.start_layer != layout.start_layer:
            raise ValueError(f"shard plan {plan} does not fit layout {layout}")
        if plan.size > 1 and broadcaster is None:
            raise ValueError("a CP group of more than one rank needs an OwnerBroadcaster")
        super().__init__(layout, plan.owned)
        self.plan = plan
        logger.info("layer-split pool: %s", plan.describe())
        # Slot i of both kinds side by side, as in an owned layer's region.
        self._scratch = alloc_layers(layout, SCRATCH_SLOTS if len(plan.owned) < layout.layer_num else 0)
        slots = range(self._scratch.slab.shape[0])
        bc = broadcaster if plan.size > 1 else None
        pages = layout.num_pages
        scratch_kv = [self._model_dtype(self._scratch.kv[i]) for i in slots]  # read as owned layers are
        self.remote_kv = RemoteLayerCache(
            "kv", plan, self.kv_read, scratch_kv, bc, lambda t: byte_rows(t).view(pages, -1)
        )
        self.remote_index = RemoteLayerCache(
            "index", plan, self.index_buffer, [self._scratch.index[i] for i in slots], bc, byte_rows
        )
        self.whole_layer_broadcasts = 0  # layers that went as one buffer, both kinds

    def _remote(self, kind: BufferKind) -> RemoteLayerCache:
        return self.remote_kv if kind is BufferKind.LATENT else self.remote_index

    def _kv_for_read(self, layer_id: int) -> torch.Tensor:
        self._local(layer_id)
        return self.remote_kv.read(layer_id)

    def _index_for_read(self, layer_id: int) -> torch.Tensor:
        self._local(layer_id)
        return self.remote_index.read(layer_id)

    def _before_write(self, layer_id: int, kind: BufferKind) -> None:
        self._local(layer_id)
        self._remote(kind).invalidate(layer_id)

    def invalidate_layer(self, layer_id: int) -> None:
        """Note a write of `layer_id` that happened on its owner only.

        Lets a non-owner keep the collective state in step without building data it
        would drop; equivalent to calling the write methods with the owner's data.
        """
        self._before_write(layer_id, BufferKind.LATENT)
        self._before_write(layer_id, BufferKind.INDEX)

    def prefetch(self, layer_id: int, pages: torch.Tensor | None = None) -> None:
        """Start the broadcasts (latent KV and indexer) of `layer_id`; return at once.

        With `pages`, only those pages travel, and only they are valid in the copy.
        """
        self._local(layer_id)
        self._check_pages(pages)
        self._prefetch_both(layer_id, pages)

    def _prefetch_both(self, layer_id: int, pages: torch.Tensor | None) -> None:
        """Start the broadcasts of both kinds of `layer_id` as one collective (one launch,
        one event, half the Python of one each on the prefill's critical path); a whole
        layer as one buffer where it can."""
        kv, index = self.remote_kv._claim(layer_id, pages), self.remote_index._claim(layer_id, pages)
        if kv is None or index is None or pages is not None or kv.number != index.number:
            self._prefetch_apart(layer_id, pages, kv, index)
            return
        # The common case, kept short: this runs once a layer on the prefill's critical path.
        # Every rank takes the same slots (the same calls leave the same state), so all of
        # them choose one buffer or two alike, as the collective needs.
        self.remote_kv.count_whole(kv)
        self.remote_index.count_whole(index)
        self.whole_layer_broadcasts += 1
        _start(self.remote_kv, [kv, index], [self._region(layer_id, kv.number)], layer_id)

    def _prefetch_apart(self, layer_id: int, pages: torch.Tensor | None, kv: _Slot | None, index: _Slot | None) -> None:
        """The two kinds in their own buffers (some pages, or slots of other numbers), as
        one collective still."""
        moves = [
            (slot, *cache._payload(slot, layer_id, pages))
            for cache, slot in ((self.remote_kv, kv), (self.remote_index, index))
            if slot is not None
        ]
        if moves:
            finishes = [finish for _, _, finish in moves]
            _start(self.remote_kv, [slot for slot, _, _ in moves], [p for _, p, _ in moves], layer_id, finishes)

    def _region(self, layer_id: int, slot: int) -> torch.Tensor:
        """Where a whole `layer_id` travels from (its owner) or into (scratch slot `slot`)."""
        if self.plan.owns(layer_id):
            return self.regions.region(layer_id - self.owned.start)
        return self._scratch.region(slot)

    async def wait_layer(self, layer_id: int, pages: torch.Tensor | None = None) -> None:
        """Make `layer_id` (or its `pages`) readable without blocking: await its broadcasts.

        After this returns, the pool's read methods for `layer_id` return at once.
        """
        self._local(layer_id)
        self._check_pages(pages)
        self._prefetch_both(layer_id, pages)
        await self.remote_kv.read_async(layer_id, pages)
        await self.remote_index.read_async(layer_id, pages)

    def _check_pages(self, pages: torch.Tensor | None) -> None:
        if pages is not None:
            check_locations(pages, self.layout.num_pages, "broadcast pages")

    @property
    def scratch_bytes(self) -> int:
        return self.remote_kv.scratch_bytes + self.remote_index.scratch_bytes
