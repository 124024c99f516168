"""The decode's side of the per-owner protocol: claim, poll, read, release; or, with a
ticket, read and prove the pin.

`OwnerIO` is the half of `DecodeFetcher` that talks to one owner at a time: it claims the
room (the lowest CP rank first), polls readiness, reads ready layers (one batched UCX
READ, or one gather launch on the same-host GPU lane) and releases the claim, proving the
pages stayed pinned. `DecodeFetcher` supplies the state it reads (`pool`, `timeouts`,
`consumer_id`, `merge_runs`, `transport`, `_gpu`, `_client`, `_owner_tasks`, `_pin_word`).

With a `RoomTicket` (a finished room, handed over by its prefill through the router) a
fetch makes no control request at all: every owner is read at once, then each owner's
pin word is READ; the nonce still being there proves that no page was freed while it was
read. That last READ carries the release as its NIXL notification.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np
import torch

from pdkv.errors import ClaimLostError, ClosedError, MetadataError, PdkvError, PeerLostError, UnknownRoomError
from transfer.deadline import Deadline
from transfer.engine_kv import KVBuffers
from transfer.http import ControlClient
from transfer.metadata import (
    ClaimRequest,
    OwnerPin,
    RankDescriptor,
    ReleaseNotice,
    ReleaseReply,
    RoomState,
    RoomStatus,
    RoomTicket,
    TicketRelease,
    encode,
)
from transfer.metrics import READ_SECONDS, fetch_engine
from transfer.pin_table import MappedPins
from transfer.plan import BufferPair, ReadTable, read_plan, read_table
from transfer.readiness import ReadinessFeed
from transfer.results import FetchResult, OwnerStats
from transfer.timeouts import Timeouts
from transfer.ucx import UcxTransport, XferStats

if TYPE_CHECKING:
    from transfer.gpu_lane import GpuLane, IpcPeer, LaunchGroup, LaunchSlot

__all__ = ["Claim", "Owner", "OwnerIO", "lost_peer"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=msgspec.Struct)


@dataclass
class Owner:
    rank: RankDescriptor
    pairs: dict[int, tuple[BufferPair, BufferPair]]  # layer -> (latent, index), UCX addresses
    ipc: IpcPeer | None = None  # set when the same-host GPU lane reads this owner
    pins: MappedPins | None = None  # its pin table, mapped when it runs on this host
    tables: dict[tuple[int, int], ReadTable] = field(default_factory=dict)  # by layer range

    def read_table(self, layers: range) -> ReadTable:
        """The READ table of `layers` (built once: a fetch then only lays its pages over it)."""
        key = (layers.start, layers.stop)
        if key not in self.tables:
            self.tables[key] = read_table([p for layer in layers for p in self.pairs[layer]])
        return self.tables[key]


@dataclass
class Claim:
    """One fetch's (or lease's) claim on a room: a random token, and where it stands."""

    room: int
    readers: int = 1  # the claimant's group reads the room this many times (`ClaimRequest.readers`)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    asked: set[int] = field(default_factory=set)  # cp ranks a claim request went to
    granted: set[int] = field(default_factory=set)  # cp ranks that granted it
    released: dict[int, bool] = field(default_factory=dict)  # cp rank -> that release freed the room
    # cp rank -> the room as its claim found it, for the first read under the claim only (a
    # later read asks again, so a room aborted meanwhile is caught at once, not at release)
    states: dict[int, RoomState] = field(default_factory=dict)
    messages: int = 0  # control requests made under it (claims, polls, releases)

    @property
    def open_ranks(self) -> set[int]:
        return self.granted - self.released.keys()


class OwnerIO:
    """Per-owner claim, readiness, reads and release (see the module docstring)."""

    pool: KVBuffers
    timeouts: Timeouts
    consumer_id: str
    merge_runs: bool
    transport: UcxTransport | None
    _gpu: GpuLane | None
    _client: ControlClient
    _owner_tasks: set[asyncio.Future[Any]]
    _feed: ReadinessFeed  # readiness pushed by owners, where their streams are up

    def _pin_window(self) -> torch.Tensor:
        raise NotImplementedError

    # ---- with a ticket: no control request ---------------------------------------------------
    async def _fetch_ticket(
        self,
        owners: dict[int, Owner],
        engine_id: str,
        ticket: RoomTicket,
        dst: np.ndarray,
        deadline: Deadline,
        started: float,
        release: Callable[[list[tuple[Owner, OwnerPin]], int], None] | None = None,
    ) -> FetchResult:
        """Read every owner at once and prove each pin word after the data. `release`: how
        the room is released once proved (a ticket's notifications by default); with one,
        the reader holds claims (their owners push an abort, which stops the READs at once)
        and a failure releases nothing (the caller gives its claims up)."""
        src = np.asarray(ticket.src_pages, dtype=np.int64)
        if src.size != dst.size:
            raise MetadataError(f"room {ticket.room}: {src.size} source pages, {dst.size} destination pages")
        pins = {p.cp_rank: p for p in ticket.pins}
        lane = {r: o for r, o in owners.items() if o.ipc is not None}
        room = ticket.room
        reads = [self._read_with_pin(o, pins[r], room, src, dst, deadline) for r, o in owners.items() if r not in lane]
        every = [(o, pins[r]) for r, o in owners.items()]
        try:
            if not reads:  # every owner on this host's GPUs: one launch, awaited in this task
                per_task = [await self._read_lane_with_pins(lane, pins, room, src, dst, deadline)]
            else:
                if lane:
                    reads.append(self._read_lane_with_pins(lane, pins, room, src, dst, deadline))
                watch = self._feed.aborted(_owner_urls(owners), room) if release is not None else None
                per_task = await self._each_read(reads, watch)
        except BaseException:  # every READ has ended: release at once
            if release is None:
                self._release_pins(every, ticket.room)
            raise
        # Released once every pin was proved, after the fetch returns: notifications sent
        # while other owners were still being read slowed those reads.
        asyncio.get_running_loop().call_soon(release or self._release_pins, every, ticket.room)
        # One task (every owner in one launch) already lists its owners by CP rank.
        stats = per_task[0] if len(per_task) == 1 else sorted((s for t in per_task for s in t), key=_by_rank)
        nbytes = sum([s.nbytes for s in stats])
        return FetchResult(engine_id, ticket.room, nbytes, time.perf_counter() - started, tuple(stats), False, 0)

    async def _each_read(
        self, reads: Sequence[Awaitable[list[OwnerStats]]], abort: Awaitable[None] | None = None
    ) -> list[list[OwnerStats]]:
        """Run owners' reads as tasks the fetcher can cancel at close; all, or the first error
        (`abort` raising counts as one)."""
        tasks = [asyncio.ensure_future(read) for read in reads]
        self._owner_tasks.update(tasks)
        try:
            return await _all_or_cancel(tasks, abort)
        finally:
            self._owner_tasks.difference_update(tasks)

    async def _read_with_pin(
        self, owner: Owner, pin: OwnerPin, room: int, src: np.ndarray, dst: np.ndarray, deadline: Deadline
    ) -> list[OwnerStats]:
        """Read all of one owner's layers over UCX, then prove its pin."""
        assert self.transport is not None
        r = owner.rank
        t0 = time.perf_counter()
        layers = range(r.layer_start, r.layer_end)
        try:
            pieces = max(1, self.transport.lanes // r.cp_size)
            xfer = await self._read_layers(owner, layers, src, dst, deadline, pieces)
            await self._prove_pins([(owner, pin)], room, deadline)
        except PeerLostError as exc:
            raise lost_peer(r, exc) from exc
        span = (layers.start, layers.stop)
        return [OwnerStats(r.cp_rank, span, xfer.nbytes, xfer.descriptors, 1, time.perf_counter() - t0, xfer.seconds)]

    async def _read_lane_with_pins(
        self,
        owners: dict[int, Owner],
        pins: dict[int, OwnerPin],
        room: int,
        src: np.ndarray,
        dst: np.ndarray,
        deadline: Deadline,
    ) -> list[OwnerStats]:
        """Read every layer of these owners (all on this host) with one gather launch, then
        prove each one's pin; each owner's share of the GPU time is its share of the bytes."""
        assert self._gpu is not None
        t0 = time.perf_counter()
        route = self._gpu.route(tuple(o.ipc for o in owners.values() if o.ipc is not None))
        try:
            # `dst` came through `page_ids` against this pool: the plan need not check it again.
            seconds = await self._gpu.read_route(route, src, dst, self.pool.layout.num_pages)
            unmapped = self._prove_mapped_pins([(o, pins[r]) for r, o in owners.items()], room)
            if unmapped:  # not the usual case: owners on this host's GPUs map their pin tables too
                await self._prove_read_pins(unmapped, room, deadline)
        except PeerLostError as exc:
            lost = next((o.rank for o in owners.values() if o.rank.agent_name == exc.peer), None)
            raise (lost_peer(lost, exc) if lost is not None else exc) from exc
        asyncio.get_running_loop().call_soon(_observe_read, "cuda_ipc", seconds)  # after the fetch returns
        elapsed, n, per_byte = time.perf_counter() - t0, src.size, seconds / max(1, route.page_bytes)
        return [
            OwnerStats(p.cp_rank, (p.layers.start, p.layers.stop), b * n, 0, 1, elapsed, b * per_byte, "cuda_ipc")
            for p, b in route.shares
        ]

    async def _prove_pins(self, pinned: list[tuple[Owner, OwnerPin]], room: int, deadline: Deadline) -> None:
        """Check each owner's pin word for `room` after its data: still the nonce, or raise.
        A mapped word is a load; the others are READ, one after another."""
        await self._prove_read_pins(self._prove_mapped_pins(pinned, room), room, deadline)

    async def _prove_read_pins(self, unmapped: list[tuple[Owner, OwnerPin]], room: int, deadline: Deadline) -> None:
        """Check the pins `_prove_mapped_pins` left (slots already bounded), each word READ."""
        for owner, pin in unmapped:
            _check_pin_word(pin, room, await self._read_pin(owner, pin, deadline))

    @staticmethod
    def _prove_mapped_pins(pinned: list[tuple[Owner, OwnerPin]], room: int) -> list[tuple[Owner, OwnerPin]]:
        """Check the pins of owners on this host (their tables mapped here: a load each, no
        coroutine); returns the others, whose words must be READ."""
        unmapped = []
        for owner, pin in pinned:
            assert owner.rank.pins is not None
            if pin.slot >= owner.rank.pins.slots:
                raise MetadataError(f"room {room}: pin slot {pin.slot} outside cp rank {pin.cp_rank}'s pin table")
            if owner.pins is None:
                unmapped.append((owner, pin))
            else:
                _check_pin_word(pin, room, owner.pins.word(pin.slot))
        return unmapped

    async def _read_pin(self, owner: Owner, pin: OwnerPin, deadline: Deadline) -> int:
        """The pin word READ over UCX (an owner on another host)."""
        assert self.transport is not None and owner.rank.pins is not None
        # A window of words around the slot, not the word alone: on loopback an 8-byte READ
        # is emulated with messages the owner must progress (up to its 10 ms interval,
        # measured), while 16 KiB go by cma's zero copy like the data.
        local = self._pin_window()
        first = pin.slot - pin.slot % len(local)
        window = local[: min(len(local), owner.rank.pins.slots - first)]
        addr = owner.rank.pins.addr + 8 * first
        await self.transport.read_host(owner.rank.agent_name, addr, window, deadline.within(self.timeouts.request))
        return int(window[pin.slot - first])

    def _release_pins(self, pins: list[tuple[Owner, OwnerPin]], room: int) -> None:
        """Release a ticket's room on these owners: a notification each, no answer, queued
        without a wait. One that cannot be sent leaves the room to its pin's expiry there."""
        if self.transport is None:  # closed meanwhile
            logger.info("release of room %d: the fetcher is closed (its pins expire instead)", room)
            return
        fp = self.pool.layout.fingerprint
        messages = [
            (o.rank.agent_name, encode(TicketRelease(room=room, slot=p.slot, nonce=p.nonce), fp)) for o, p in pins
        ]
        try:
            self.transport.notify(messages)
        except PdkvError as exc:
            logger.info("release of room %d: %s (its pins expire instead)", room, exc)

    async def _fetch_from(
        self,
        owners: dict[int, Owner],
        engine_id: str,
        claim: Claim,
        dst: np.ndarray,
        deadline: Deadline,
        started: float,
        release: bool = True,
    ) -> FetchResult:
        messages_before = claim.messages
        tasks: list[asyncio.Task[OwnerStats]] = []
        for o in owners.values():
            self._feed.want(o.rank.control_url, claim.room)
        try:
            first = await self._tracked(self._claim_arbiter(owners, claim, deadline))
            known = {r: first.get(r) or claim.states.pop(r, None) for r in owners}
            group = self._launch_group(owners)
            tasks = [
                asyncio.create_task(
                    self._fetch_owner(o, claim, dst, deadline, release, known[r], group if o.ipc is not None else None)
                )
                for r, o in owners.items()
            ]
            self._owner_tasks.update(tasks)
            stats = await _all_or_cancel(tasks, self._feed.aborted(_owner_urls(owners), claim.room))
        except BaseException:  # cancellation too: never leave the room pinned
            if release:
                await self._release_all(owners, claim)
            raise
        finally:
            self._owner_tasks.difference_update(tasks)
            for o in owners.values():
                self._feed.forget(o.rank.control_url, claim.room)
        nbytes = sum(s.nbytes for s in stats)
        freed_on = tuple(sorted(r for r in owners if claim.released.get(r, False))) if release else ()
        messages = claim.messages - messages_before
        seconds = time.perf_counter() - started
        freed = len(freed_on) == len(owners)
        return FetchResult(engine_id, claim.room, nbytes, seconds, tuple(stats), freed, messages, freed_on)

    async def _tracked(self, work: Awaitable[T]) -> T:
        """`work` in a task that `aclose()` may cancel (the caller then gets `ClosedError`)."""
        task = asyncio.ensure_future(work)
        self._owner_tasks.add(task)
        try:
            return (await _all_or_cancel([task]))[0]
        finally:
            self._owner_tasks.discard(task)

    def _launch_group(self, owners: dict[int, Owner]) -> LaunchGroup | None:
        """A group for the owners the GPU lane reads, when there are several."""
        lane_owners = sum(o.ipc is not None for o in owners.values())
        if self._gpu is None or lane_owners < 2:
            return None
        from transfer.gpu_lane import LaunchGroup

        return LaunchGroup(self._gpu, lane_owners)

    async def _claim_arbiter(self, owners: dict[int, Owner], claim: Claim, deadline: Deadline) -> dict[int, RoomState]:
        """Claim on the lowest CP rank before any other: every claimant asks it first, so of
        two racing for a single-consumer room one wins everywhere and the other is refused
        there, rather than each winning some owners and both failing."""
        rank = min(owners)
        if rank in claim.granted:
            return {}
        return {rank: await self._claim_owner(owners[rank], claim, deadline)}

    async def _claim_owner(self, owner: Owner, claim: Claim, deadline: Deadline) -> RoomState:
        """Take one of the room's claims on `owner`, waiting (bounded) for it to be published."""
        r = owner.rank
        url = f"{r.control_url}/v1/rooms/{claim.room}/claim"
        ask = ClaimRequest(room=claim.room, consumer_id=self.consumer_id, claim=claim.token, readers=claim.readers)
        unknown_until = time.monotonic() + self.timeouts.publish
        claim.asked.add(r.cp_rank)  # from here on it may be granted there, answered or not
        while True:
            limit = deadline.left(self.timeouts.poll + self.timeouts.request)
            state = await self._control(claim, "POST", url, RoomState, ask, limit)
            if state.status is not RoomStatus.UNKNOWN:
                claim.granted.add(r.cp_rank)
                claim.states[r.cp_rank] = state
                return state
            if time.monotonic() > unknown_until:
                raise UnknownRoomError(f"room {claim.room} never appeared on cp rank {r.cp_rank}")

    async def _poll(
        self, owner: Owner, claim: Claim, after: int, deadline: Deadline, after_pages: int = -1
    ) -> RoomState:
        """The room's state once layers beyond `after` (or chunks' pages beyond
        `after_pages`) are ready: pushed on the owner's readiness stream, or (stream down,
        or a room that ended) one long-poll over HTTP."""
        url = owner.rank.control_url
        pushed = await self._feed.wait(url, claim.room, after, deadline.left(self.timeouts.poll), after_pages)
        if pushed is not None and pushed.status in (RoomStatus.PENDING, RoomStatus.READY):
            return pushed
        url = f"{url}/v1/rooms/{claim.room}?after={after}&after_pages={after_pages}&claim={claim.token}"
        limit = deadline.left(self.timeouts.poll + self.timeouts.request)
        return await self._control(claim, "GET", url, RoomState, None, limit)

    async def _control(
        self, claim: Claim, method: str, url: str, kind: type[M], body: msgspec.Struct | None, timeout: float
    ) -> M:
        """One control request to an owner under `claim`, in our layout's envelope both ways."""
        claim.messages += 1
        fp = self.pool.layout.fingerprint
        answer = await self._client.request(
            method, url, kind, body, fingerprint=fp, expect_fingerprint=fp, timeout=timeout
        )
        assert answer is not None
        return answer

    async def _fetch_owner(
        self,
        owner: Owner,
        claim: Claim,
        dst: np.ndarray,
        deadline: Deadline,
        release: bool,
        state: RoomState | None,
        group: LaunchGroup | None = None,
    ) -> OwnerStats:
        """Read one owner's layers, then release them there (while other owners still read)."""
        slot = group.slot() if group is not None else None
        try:
            stats = await self._read_owner_layers(owner, claim, dst, deadline, state, slot)
            if release:
                await self._release(owner, claim, deadline.left(self.timeouts.request))
            return stats
        except PeerLostError as exc:
            raise lost_peer(owner.rank, exc) from exc
        finally:
            if slot is not None:
                slot.close()  # others must not wait for an owner that read alone or failed

    async def _read_owner_layers(
        self,
        owner: Owner,
        claim: Claim,
        dst: np.ndarray,
        deadline: Deadline,
        state: RoomState | None,
        slot: LaunchSlot | None,
    ) -> OwnerStats:
        assert self.transport is not None
        r = owner.rank
        t0 = time.perf_counter()
        cursor, nbytes, descs, reads, busy = r.layer_start, 0, 0, 0, 0.0
        pieces = max(1, self.transport.lanes // r.cp_size)  # owners read at once: fill the lanes, no more
        if state is None and r.cp_rank in claim.granted:
            state = await self._poll(owner, claim, cursor - 1, deadline)
        elif state is None:
            state = await self._claim_owner(owner, claim, deadline)
        if state.ready_pages is not None:  # sent by chunks of pages, every layer at once
            if slot is not None:
                slot.close()
            nbytes, descs, reads, busy, aux = await self._read_chunks(owner, claim, dst, deadline, state, pieces)
            span, elapsed = (r.layer_start, r.layer_end), time.perf_counter() - t0
            return OwnerStats(r.cp_rank, span, nbytes, descs, reads, elapsed, busy, "ucx", aux)
        src = np.asarray(state.src_pages, dtype=np.int64)
        if src.size != dst.size:
            raise MetadataError(f"room {claim.room}: {src.size} source pages, {dst.size} destination pages")
        while True:
            if state.ready_upto > cursor:
                layers = range(cursor, state.ready_upto)
                if slot is not None and owner.ipc is not None and layers == range(r.layer_start, r.layer_end):
                    xfer = await slot.read(owner.ipc, layers, src, dst)  # every layer ready: one launch for all owners
                else:
                    if slot is not None:
                        slot.close()
                    xfer = await self._read_layers(owner, layers, src, dst, deadline, pieces)
                nbytes, descs, reads = nbytes + xfer.nbytes, descs + xfer.descriptors, reads + 1
                busy += xfer.seconds
                cursor = state.ready_upto
            if cursor >= r.layer_end:
                break
            state = await self._poll(owner, claim, cursor, deadline)
        return OwnerStats(
            r.cp_rank,
            (r.layer_start, r.layer_end),
            nbytes,
            descs,
            reads,
            time.perf_counter() - t0,
            busy,
            "cuda_ipc" if owner.ipc is not None else "ucx",
        )

    async def _read_chunks(
        self, owner: Owner, claim: Claim, dst: np.ndarray, deadline: Deadline, state: RoomState, pieces: int
    ) -> tuple[int, int, int, float, bytes | None]:
        """Read a room sent by chunks: each new chunk's pages in all of the owner's layers,
        until the room is complete. Returns bytes, descriptors, READs, their seconds, and
        the request's auxiliary bytes."""
        r = owner.rank
        layers = range(r.layer_start, r.layer_end)
        done, nbytes, descs, reads, busy = 0, 0, 0, 0, 0.0
        while True:
            src = np.asarray(state.src_pages, dtype=np.int64)
            if src.size > dst.size or (state.ready_upto >= r.layer_end and src.size != dst.size):
                raise MetadataError(f"room {claim.room}: {src.size} source pages, {dst.size} destination pages")
            if src.size > done:
                xfer = await self._read_layers(owner, layers, src[done:], dst[done : src.size], deadline, pieces)
                nbytes, descs, reads, busy = (
                    nbytes + xfer.nbytes,
                    descs + xfer.descriptors,
                    reads + 1,
                    busy + xfer.seconds,
                )
                done = src.size
            if state.ready_upto >= r.layer_end:  # the last chunk is in
                return nbytes, descs, reads, busy, state.aux
            state = await self._poll(owner, claim, state.ready_upto, deadline, after_pages=done)

    async def _read_layers(
        self, owner: Owner, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline, pieces: int
    ) -> XferStats:
        """Copy `layers` of one owner: one gather kernel on the GPU lane, or one batched READ."""
        if owner.ipc is not None:
            assert self._gpu is not None
            xfer = await self._gpu.read(owner.ipc, layers, src, dst)
            _observe_read("cuda_ipc", xfer.seconds)
            return xfer
        assert self.transport is not None
        plan = read_plan(owner.read_table(layers), src, dst, merge=self.merge_runs)
        xfer = await self.transport.read(owner.rank.agent_name, plan, deadline.within(self.timeouts.transfer), pieces)
        _observe_read("ucx", xfer.seconds)
        return xfer

    async def _release(self, owner: Owner, claim: Claim, timeout: float, give_up: bool = False) -> bool:
        """Release the claim on one owner; True if that freed the room there. `give_up`:
        the room was not read (a failed or cancelled fetch): it ends aborted there unless
        another consumer reads it.

        A refusal (`ClaimLostError`) raises: those pages may have been reused mid-read.
        """
        notice = ReleaseNotice(room=claim.room, consumer_id=self.consumer_id, claim=claim.token, abort=give_up)
        url = f"{owner.rank.control_url}/v1/rooms/{claim.room}/release"
        try:
            answer = await self._control(claim, "POST", url, ReleaseReply, notice, timeout)
        finally:
            claim.released.setdefault(owner.rank.cp_rank, False)  # asked once: never again
        claim.released[owner.rank.cp_rank] = answer.freed
        return answer.freed

    async def _release_all(self, owners: dict[int, Owner], claim: Claim, ranks: set[int] | None = None) -> None:
        """Give the claim up unread wherever it may be held, after a failed or cancelled
        fetch (`ranks`: these instead): the owners free the room's pages now, and a room
        that no consumer read ends aborted, so its prefill hears of the failure at once.

        Only ranks a claim request went to: another rank may still be about to grant the
        room's one claim to a decode that won it on the lowest rank. Each gets a full
        request timeout, not what is left of the fetch's deadline: the fetch may have
        failed on that deadline, and the pins must not be left behind.
        """
        limit = self.timeouts.request
        ranks = claim.asked - claim.released.keys() if ranks is None else ranks
        results = await asyncio.gather(
            *(self._release(o, claim, limit, give_up=True) for o in owners.values() if o.rank.cp_rank in ranks),
            return_exceptions=True,
        )
        for e in results:
            if isinstance(e, BaseException):
                logger.debug("giving up room %d after a failed fetch: %s", claim.room, e)


def lost_peer(rank: RankDescriptor, exc: PeerLostError) -> PeerLostError:
    """`exc` naming the engine and CP rank that was lost (once)."""
    owner = (rank.engine_id, rank.cp_rank)
    if exc.owner == owner:
        return exc
    return PeerLostError(
        f"engine {rank.engine_id} cp rank {rank.cp_rank} ({rank.control_url}) lost: {exc}", rank.agent_name, owner
    )


def _check_pin_word(pin: OwnerPin, room: int, word: int) -> None:
    """A pin word read after the data: still the ticket's nonce, or the bytes are not proved."""
    if word != pin.nonce:
        raise ClaimLostError(
            f"room {room}: its pages on cp rank {pin.cp_rank} were freed (aborted, expired or released "
            "by another holder of its ticket) before they were all read; the bytes may belong to another room"
        )


def _by_rank(stats: OwnerStats) -> int:
    return stats.cp_rank


def _observe_read(lane: str, seconds: float) -> None:
    READ_SECONDS.labels(fetch_engine(), lane).observe(seconds)  # the engine of the fetch it belongs to


async def _all_or_cancel(tasks: Sequence[asyncio.Future[T]], abort: Awaitable[None] | None = None) -> list[T]:
    """Await every task; on the first failure (or cancellation) cancel the rest and wait.
    `abort`: raises when the work must stop (the room was aborted), as a failure would.

    A task cancelled while this caller was not means the fetcher was closed under it.
    """
    watch = asyncio.ensure_future(abort) if abort is not None else None
    try:
        await _first_failure(tasks, watch)
    finally:
        if watch is not None and not watch.done():
            watch.cancel()
        if not all(t.done() for t in tasks):
            for t in tasks:
                t.cancel()
            # Collects every outcome; a cancel of our own arriving meanwhile propagates.
            await asyncio.gather(*tasks, return_exceptions=True)
    if watch is not None and watch.done() and not watch.cancelled() and (exc := watch.exception()) is not None:
        raise exc
    for t in tasks:
        if not t.cancelled() and (exc := t.exception()) is not None:
            raise exc
    if any(t.cancelled() for t in tasks):
        raise ClosedError("the DecodeFetcher was closed while this fetch was in flight")
    return [t.result() for t in tasks]


async def _first_failure(tasks: Sequence[asyncio.Future[T]], watch: asyncio.Future[None] | None) -> None:
    """Return once every task is done, one has failed, or `watch` has raised."""
    if watch is None:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        return
    pending: set[asyncio.Future[Any]] = {*tasks, watch}
    while True:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(not t.cancelled() and t.exception() is not None for t in done) or watch in done:
            return
        if pending == {watch}:
            return


def _owner_urls(owners: dict[int, Owner]) -> dict[str, int]:
    """Each owner's control URL and its CP rank."""
    return {o.rank.control_url: r for r, o in owners.items()}
