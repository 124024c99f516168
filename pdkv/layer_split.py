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

_Staged = tuple["_Slot", torch.Tensor, Callable[[], None]]  # a claimed slot, its payload, its finish

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

    scratch: torch.Tensor | None
    layer_id: int | None = None
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
        self._slots = [_Slot(t) for t in scratch] or [_Slot(None), _Slot(None)]
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

    def _target(self, slot: _Slot, layer_id: int) -> torch.Tensor:
        if self._plan.owns(layer_id):
            return self._owned[layer_id - self._plan.start_layer]
        assert slot.scratch is not None  # a rank that owns not every layer has scratch
        return slot.scratch

    def _payload(
        self, slot: _Slot, layer_id: int, pages: torch.Tensor | None
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """What travels for `layer_id` into `slot`, and what to do once it landed."""
        target = self._target(slot, layer_id)
        if pages is None:
            return target, _nothing
        if self._plan.owns(layer_id):
            return take(self._page_rows(target), pages), _nothing
        rows = self._page_rows(target)
        payload = torch.empty((pages.numel(), rows.shape[1]), dtype=torch.uint8, device=rows.device)
        return payload, (lambda: put(rows, (pages,), payload))

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
        if (stage := self._stage(layer_id, pages)) is not None:
            _start(self, [stage], [stage[1]], layer_id)

    def slot_number(self, slot: _Slot) -> int:
        return self._slots.index(slot)

    def _stage(self, layer_id: int, pages: torch.Tensor | None) -> _Staged | None:
        """Claim a slot for `layer_id` and say what must travel into it; None: held already."""
        if self._broadcaster is None:
            return None
        slot = self._slot_of(layer_id)
        if slot is not None and slot.holds(layer_id, pages):
            return None
        victim = slot or self._least_recent()
        self._settle(victim)  # a broadcast into it must land before it is reused
        victim.layer_id, victim.pages = layer_id, pages
        idx = None if pages is None else pages.reshape(-1).long()
        payload, finish = self._payload(victim, layer_id, idx)
        self.broadcasts += 1
        self.bytes_broadcast += payload.nbytes
        self._touch(victim)
        return victim, payload, finish

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
        return self._target(slot, layer_id)

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
        return self._target(slot, layer_id)

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


def _start(cache: RemoteLayerCache, staged: list[_Staged], payloads: list[torch.Tensor], layer_id: int) -> None:
    """Broadcast `payloads` from the owner of `layer_id` as one collective into the staged slots."""
    broadcaster = cache._broadcaster
    assert broadcaster is not None
    try:
        handle = broadcaster.start(payloads, cache._plan.owner_of(layer_id), f"layer {layer_id}")
    except BaseException:
        for slot, _, _ in staged:  # nothing is on its way into them
            slot.layer_id = None
        raise
    for slot, _, finish in staged:
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
        self.remote_kv = RemoteLayerCache(
            "kv", plan, self.kv_buffer, [self._scratch.kv[i] for i in slots], bc, lambda t: byte_rows(t).view(pages, -1)
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
        kv, index = self.remote_kv._stage(layer_id, pages), self.remote_index._stage(layer_id, pages)
        staged = [s for s in (kv, index) if s is not None]
        if not staged:
            return
        payloads = [payload for _, payload, _ in staged]
        if pages is None and kv is not None and index is not None:
            # Every rank takes the same slots (the same calls leave the same state), so all
            # of them choose one buffer or two alike, as the collective needs.
            slot = self.remote_kv.slot_number(kv[0])
            if slot == self.remote_index.slot_number(index[0]):
                payloads = [self._region(layer_id, slot)]
                self.whole_layer_broadcasts += 1
        _start(self.remote_kv, staged, payloads, layer_id)

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
