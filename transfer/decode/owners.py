"""An engine's owners as a decode knows them: looked up once, checked, each with its lane.

A lookup asks the registry for the engine's ranks (waiting until all are in), checks that
they cover every layer once and match the local layout, then opens each owner on the first
lane of the fetcher's ordered list that can reach it. Owners that publish a pin table are
also connected for signals, whatever lane reads them: their pin words and releases go there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pdkv.errors import (
    ClosedError,
    DeadlineExceeded,
    IncompatibleLayoutError,
    MetadataError,
    PeerLostError,
    TransferError,
    UnknownRoomError,
)
from pdkv.layout import BufferKind
from transfer.deadline import Deadline
from transfer.engine_kv import KVBuffers
from transfer.lanes.base import Lane, Pairs, Peer, Signals
from transfer.lanes.runs import BufferPair, device_id
from transfer.metadata import EngineDescriptor, RankDescriptor, RoomTicket
from transfer.metrics import observe_lookup
from transfer.prefill.pins import MappedPins, map_pins
from transfer.registry import RegistryClient
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Owner:
    """One CP rank of an engine: what it published, its buffers paired with ours, and the
    lane that reads it."""

    rank: RankDescriptor
    pairs: Pairs  # layer -> (latent, index)
    lane: Lane[Any] | None = None
    peer: Peer | None = None  # what `lane` opened for it
    pins: MappedPins | None = None  # its pin table, mapped when it runs on this host
    signals_connected: bool = False  # connected for signals (pin words, notifications) beside its lane

    @property
    def lane_name(self) -> str:
        assert self.lane is not None
        return self.lane.name


class Owners:
    """The engines a fetcher has looked up, cached; concurrent fetches share one lookup.

    `lanes`: tried in order for each owner; `strict`: an owner none of them reaches fails
    the lookup (else the last lane is taken, which must reach every owner). `signals`
    carries notifications and remote pin words (`transfer.lanes.choice.lanes_for`).
    """

    def __init__(
        self,
        pool: KVBuffers,
        registry: RegistryClient,
        timeouts: Timeouts,
        lanes: list[Lane[Any]],
        signals: Signals,
        *,
        strict: bool = False,
    ) -> None:
        self.pool, self._registry, self.timeouts = pool, registry, timeouts
        self.lanes, self.signals, self.strict = lanes, signals, strict
        self.cached: dict[str, dict[int, Owner]] = {}
        self._lookups: dict[str, asyncio.Task[dict[int, Owner]]] = {}
        self.closing = False

    async def lookup(self, engine_id: str, deadline: Deadline) -> dict[int, Owner]:
        """The engine's owners, cached; concurrent fetches share one lookup in flight."""
        cached = self.cached.get(engine_id)
        if cached is not None:
            return cached
        task = self._lookups.get(engine_id)
        if task is None:
            task = self._lookups[engine_id] = asyncio.create_task(self._resolve(engine_id))
            task.add_done_callback(lambda _: self._lookups.pop(engine_id, None))
        try:
            return await asyncio.wait_for(asyncio.shield(task), deadline.left(self.timeouts.lookup))
        except asyncio.TimeoutError as exc:
            raise DeadlineExceeded(f"engine {engine_id}: lookup did not finish by the deadline") from exc
        except asyncio.CancelledError:
            if self.closing and task.cancelled():
                raise ClosedError(f"the DecodeFetcher was closed while looking up {engine_id}") from None
            raise

    async def _resolve(self, engine_id: str) -> dict[int, Owner]:
        owners = await self.describe(engine_id)
        await self._open(owners)
        self.cached[engine_id] = owners
        return owners

    async def describe(self, engine_id: str, within: Deadline | None = None) -> dict[int, Owner]:
        """Ask the registry for the engine's owners (waiting until all are in) and check them."""
        deadline = Deadline.after(self.timeouts.lookup) if within is None else within.within(self.timeouts.lookup)
        return self.check(await self._ask(engine_id, deadline))

    async def _ask(self, engine_id: str, deadline: Deadline) -> EngineDescriptor:
        """The registry's answer for the engine, its latency and failures observed. An engine
        the registry never saw fails at once (`UnknownEngineError`); one it cannot answer
        for yet is waited for until `deadline`."""
        started = time.perf_counter()
        try:
            found = await self._registry.lookup(engine_id, deadline)
        except Exception as exc:  # a cancelled lookup is no outcome
            observe_lookup(started, exc)
            raise
        observe_lookup(started)
        return found

    async def refused(self, engine_id: str, deadline: Deadline) -> dict[int, Owner]:
        """The engine's owners as the registry lists them, unchecked and on no lane: owners
        whose layout `lookup` refused, which a decode may still ask to give a room up
        (`ClaimProtocol.release`: a give-up travels in the owner's own envelope)."""
        desc = await self._ask(engine_id, deadline.within(self.timeouts.lookup))
        return {rank.cp_rank: Owner(rank, {}) for rank in desc.ranks}

    def check(self, desc: EngineDescriptor) -> dict[int, Owner]:
        """`desc`'s owners, checked against our pool and paired with its buffers."""
        check_owners(desc, self.pool)
        return {rank.cp_rank: Owner(rank, buffer_pairs(rank, self.pool)) for rank in desc.ranks}

    async def _open(self, owners: dict[int, Owner]) -> None:
        try:
            for o in owners.values():
                if o.rank.pins is not None:
                    o.pins = map_pins(o.rank.pins)
                await self._open_lane(o)
                if o.rank.pins is not None:  # its releases are notifications
                    await self.signals.connect(o.rank)
                    o.signals_connected = True
        except BaseException:
            await self._close(owners)
            raise

    async def _open_lane(self, owner: Owner) -> None:
        """Open `owner` on the first lane that reaches it (the last one, failing that)."""
        r, reasons = owner.rank, list[str]()
        for lane in self.lanes:
            why = lane.reach(r)
            if why is None:
                try:
                    owner.peer = await lane.open(r, owner.pairs)
                except PeerLostError as exc:
                    raise lost_peer(r, exc) from exc
                except TransferError as exc:
                    if lane is self.lanes[-1] and not self.strict:
                        raise
                    why = str(exc)
                else:
                    owner.lane = lane
                    if reasons:
                        logger.info("engine %s cp rank %d over %s: %s", r.engine_id, r.cp_rank, lane.name, reasons)
                    return
            reasons.append(f"{lane.name}: {why}")
        raise TransferError(f"engine {r.engine_id} cp rank {r.cp_rank}: no lane can read it: {'; '.join(reasons)}")

    async def forget(self, engine_id: str) -> None:
        """Drop a cached engine and its peers' connections and keys."""
        await self._close(self.cached.pop(engine_id, {}))

    async def _close(self, owners: dict[int, Owner]) -> None:
        for o in owners.values():
            if o.pins is not None:
                o.pins.close()
                o.pins = None
            if o.lane is not None:
                lane, o.lane = o.lane, None
                await lane.close(o.peer)  # a dead owner's memory is freed only then
            if o.signals_connected:
                o.signals_connected = False
                await self.signals.disconnect(o.rank)

    async def reregistered(
        self, engine_id: str, owners: dict[int, Owner], was_cached: bool, budget: Deadline
    ) -> dict[int, Owner] | None:
        """After a lost peer: the engine's owners anew if it re-registered since it was
        cached (a restart), else None."""
        await self.forget(engine_id)  # drop the dead peers' connections and keys
        if not was_cached:
            return None
        described = await self.describe(engine_id, budget)
        if _incarnations(described) == _incarnations(owners):
            return None
        return await self.lookup(engine_id, budget)

    async def for_ticket(
        self, engine_id: str, owners: dict[int, Owner], ticket: RoomTicket, budget: Deadline
    ) -> dict[int, Owner] | None:
        """The owners `ticket` can be read from, where `owners` are not (`ticket_readable`);
        None: read by claims instead.

        A ticket naming other incarnations than the cached ones makes one fresh lookup (the
        engine restarted since it was cached, or the cache is older than the ticket).
        """
        if not pinned(owners):
            return None  # an exporter without a pin table: claims
        await self.forget(engine_id)
        owners = await self.lookup(engine_id, budget)
        if ticket_readable(owners, ticket):
            return owners
        if not pinned(owners):
            return None
        raise UnknownRoomError(
            f"room {ticket.room}: its ticket names owners of {engine_id} that no longer run (restarted)"
        )

    def cancel(self) -> None:
        """Refuse to look up more; end the lookups in flight (their callers get `ClosedError`)."""
        self.closing = True
        for t in list(self._lookups.values()):
            t.cancel()

    async def aclose(self) -> None:
        self.cancel()
        for engine_id in list(self.cached):
            await self.forget(engine_id)


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


def buffer_pairs(rank: RankDescriptor, pool: KVBuffers) -> Pairs:
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


def lost_peer(rank: RankDescriptor, exc: PeerLostError) -> PeerLostError:
    """`exc` naming the engine and CP rank that was lost (once)."""
    owner = (rank.engine_id, rank.cp_rank)
    if exc.owner == owner:
        return exc
    return PeerLostError(
        f"engine {rank.engine_id} cp rank {rank.cp_rank} ({rank.control_url}) lost: {exc}", rank.agent_name, owner
    )


def peers_of(owners: Iterable[Owner]) -> tuple[Peer, ...]:
    """What the lanes opened for `owners`, by CP rank (a batch of them is made once for these)."""
    peers = []
    for o in sorted(owners, key=lambda o: o.rank.cp_rank):
        if o.peer is None or o.lane is None:  # forgotten meanwhile (its engine re-registered or a peer was lost)
            raise PeerLostError(f"cp rank {o.rank.cp_rank}: its connection was dropped", o.rank.agent_name)
        peers.append(o.peer)
    return tuple(peers)


def pinned(owners: dict[int, Owner]) -> bool:
    """Whether every owner publishes a pin table (which a ticket's read is proved by)."""
    return all(o.rank.pins is not None for o in owners.values())


def ticket_readable(owners: dict[int, Owner], ticket: RoomTicket) -> bool:
    """Whether `ticket` can be read from `owners`: each pinned, and its incarnation the ticket's."""
    pins = {p.cp_rank: p.incarnation for p in ticket.pins}
    return pinned(owners) and pins == {r: o.rank.incarnation for r, o in owners.items()}


def _incarnations(owners: dict[int, Owner]) -> list[str]:
    return [o.rank.incarnation for _, o in sorted(owners.items())]
