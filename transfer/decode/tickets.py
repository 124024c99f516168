"""The ticket protocol: read a finished room without asking anyone, and prove the pin after.

With a `RoomTicket` (a finished room, handed over by its prefill through the router) a
fetch makes no control request at all: every owner is read at once (owners on a lane that
reads several together, as one batch), then each owner's pin word is checked; the
nonce still being there proves that no page was freed while it was read. Words of owners
on this host are loads from their mapped tables; others are READ through the signals. The
room is then released by a notification to each owner, `release_delay` seconds after the fetch
returned (see `TicketProtocol`), sent again while the owner's pin word shows it has not
taken (`transfer.decode.releases`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np
import torch

from pdkv.errors import ClaimLostError, MetadataError, PdkvError, PeerLostError
from transfer.deadline import Deadline
from transfer.decode.claims import Claim, owner_urls, read_layers
from transfer.decode.landing import Landing
from transfer.decode.owners import Owner, lost_peer, peers_of, pinned
from transfer.decode.releases import Releases
from transfer.decode.tasks import DecodeContext, Fetch, to_the_end
from transfer.lanes.base import Batch, Lane, Peer, Signals, Watch
from transfer.metadata import ClaimRelease, OwnerPin, ReadFrom, RoomTicket, TicketRelease, encode
from transfer.metrics import observe_read
from transfer.results import FetchResult, OwnerStats

logger = logging.getLogger(__name__)

PIN_WINDOW = 2048  # words of an owner's pin table READ around a slot (16 KiB)
PIN_WINDOWS = 64  # such READs in flight at once (reused in turn: a clash can only fail a check)
_ROUTES_KEPT = 64  # owner sets whose ticket route is kept

PinRelease = Callable[[list[tuple[Owner, OwnerPin]], int], None]  # how a proved room is released


@dataclass(frozen=True, eq=False)
class PreparedTicket:
    """A ticket's read laid out before its destination pages are known: its source pages
    as an array, each owner with its pin, and the owners each lane reads together with
    their batch (made once). A room claimed ahead is prepared as its claim is granted
    (`RoomLease`), so that once its pages are named only their check and the launch remain."""

    room: int
    urls: dict[str, int]  # each owner's control URL and CP rank (its pushed aborts)
    src: np.ndarray
    every: list[tuple[Owner, OwnerPin]]
    together: list[tuple[Lane[Any], list[tuple[Owner, OwnerPin]], Batch[Peer]]]  # a lane, its owners, their batch
    alone: list[tuple[Owner, OwnerPin]]  # owners read one at a time
    aux: bytes | None = None  # the request's auxiliary bytes, where the owners' states carried them


@dataclass(eq=False)
class EarlyRead:
    """A prepared ticket's read launched once its destination ids were bounded, before the
    rest of its checks (`TicketProtocol.launch_prepared`); owed `read` or `settle`."""

    src: np.ndarray  # the source ids launched (the room's, less the prefix skipped)
    dst: np.ndarray  # the destination ids launched: the caller's, bounded, not yet checked for repeats
    started: Any  # the batch's launch; None: nothing to launch
    t0: float  # when its launch began
    entered: bool = False  # `read` has taken it over


class Launching(Batch[Peer], Protocol):
    """A batch whose read is launched by a synchronous call and awaited apart (the same-host
    GPU lane's `GatherBatch`): a ticket's read then goes out before its bookkeeping."""

    def start(self, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None) -> Any:
        """Check the ids and launch the read now; None where there is nothing to launch."""
        ...

    def landed(self, started: Any, watch: Watch | None = None) -> Awaitable[float]:
        """Its seconds once the read has ended (raises only once it has, cancelled too)."""
        ...

    def settle(self, started: Any) -> Awaitable[None]:
        """Return once the read has ended, for a caller that failed before `landed`."""
        ...


@dataclass(frozen=True, eq=False)
class _Route:
    """How a ticket's read over one set of owners goes: one lane's batch over every owner
    that launches (`Launching`), else None (the read is prepared as any other)."""

    owners: dict[int, Owner]  # kept: the routes are cached by its identity
    lane: Lane[Any] | None = None
    batch: Launching | None = None
    incarnations: dict[int, str] | None = None  # each owner's, where every one is pinned (`ticket_readable`)


@dataclass(eq=False)
class Express:
    """A ticket's read launched as the fetch's first step (`TicketProtocol.launch`); the
    fetch then owes it `land` (or `abandon`, where it failed before)."""

    route: _Route
    ticket: RoomTicket
    src: np.ndarray
    dst: np.ndarray  # the destination ids launched
    started: Any  # the batch's launch; None: nothing was launched
    watch: Landing | None  # the fetch's landing, where every pin table is mapped
    t0: float  # when its launch began
    entered: bool = False  # `land` has taken over


class TicketProtocol:
    """Reads rooms by their tickets. `signals` READs remote pin words and sends the releases.

    `release_delay`: seconds a proved room's releases wait after the fetch returned. 0 (an
    async caller): at the loop's next turn, after the caller's own continuation. A caller
    polling from another thread (`transfer.sync`) needs the interpreter lock to see the
    outcome, and the releases' sends hold it: sent at once, they delayed SGLang's receiver
    seeing its read done, however often it polled. `flush`
    sends those still waiting (at close)."""

    def __init__(self, ctx: DecodeContext, signals: Signals, release_delay: float = 0.0) -> None:
        self.ctx, self.signals, self.release_delay = ctx, signals, release_delay
        # Owners' pin words land here; the last window is the releases' own (their checks).
        self.pin_windows = torch.zeros((PIN_WINDOWS + 1, PIN_WINDOW), dtype=torch.int64)
        self.releases = Releases(signals, ctx.timeouts, self.pin_windows[PIN_WINDOWS])
        self._next_window = 0
        self._deferred: dict[asyncio.TimerHandle, Callable[[], None]] = {}  # releases waiting out the delay
        self._routes: dict[int, _Route] = {}  # by the identity of an owners' dict (`_Route.owners`)

    def launch(
        self, owners: dict[int, Owner] | None, ticket: RoomTicket, dst: np.ndarray, landing: Landing | None = None
    ) -> Express | None:
        """Launch `ticket`'s read into `dst` (checked by `page_ids`) now, before the fetch's
        bookkeeping, where `owners` (cached, None if not) are one batch of a lane that launches
        and the ticket is theirs; else None, and nothing was launched. The source ids are
        checked first: a bad one raises before any launch. Owed `land` or `abandon`."""
        if owners is None:
            return None
        route = self._routes.get(id(owners))
        if route is None or route.owners is not owners:
            route = self._route(owners)
        batch = route.batch
        if batch is None or {p.cp_rank: p.incarnation for p in ticket.pins} != route.incarnations:
            return None  # not every owner pinned, or the ticket is of another incarnation: `ticket_readable`
        src = np.asarray(ticket.src_pages, dtype=np.int64)
        if src.size != dst.size:
            raise MetadataError(f"room {ticket.room}: {src.size} source pages but {dst.size} destination pages")
        # Told of the read's end on the lane's thread only where every proof is a load there.
        watch = landing if landing is not None and all(o.pins is not None for o in owners.values()) else None
        t0 = time.perf_counter()
        try:
            started = batch.start(src, dst, self.ctx.pool.layout.num_pages, watch)
        except PeerLostError as exc:
            pins = {p.cp_rank: p for p in ticket.pins}
            raise _lost_among([(o, pins[r]) for r, o in owners.items()], exc) from exc
        return Express(route, ticket, src, dst, started, watch, t0)

    def _route(self, owners: dict[int, Owner]) -> _Route:
        try:
            batches = _batches(owners)
        except PeerLostError:  # not cached: the usual path reports it
            return _Route(owners)
        route = _Route(owners)
        if len(batches) == 1:
            lane, (group, batch) = next(iter(batches.items()))
            if len(group) == len(owners) and callable(getattr(batch, "start", None)) and pinned(owners):
                incarnations = {r: o.rank.incarnation for r, o in owners.items()}
                route = _Route(owners, lane, batch, incarnations)  # type: ignore[arg-type]
        if len(self._routes) >= _ROUTES_KEPT:  # owner sets come and go with engines
            self._routes.clear()
        self._routes[id(owners)] = route
        return route

    async def land(self, express: Express, job: Fetch) -> FetchResult:
        """The rest of a read `launch`ed: await its end, prove each owner's pin word, release
        the room as `read` does; returns only once its kernel has ended, whatever happens."""
        express.entered = True
        route, ticket = express.route, express.ticket
        assert route.lane is not None and route.batch is not None
        pins = {p.cp_rank: p for p in ticket.pins}
        pinned = [(o, pins[r]) for r, o in route.owners.items()]
        try:
            stats = await self._launched(
                route.lane, pinned, route.batch, express.started, ticket.room, express.src, job, express.watch,
                None, express.t0,
            )  # fmt: skip
        except BaseException:  # the read has ended: release at once
            self.release_pins(pinned, ticket.room, "give_up")
            raise
        proved = express.watch.proved_result() if express.watch is not None else None
        send = functools.partial(self.release_pins, pinned, ticket.room)
        self._release_later(send, 0.0 if proved is not None else self.release_delay)
        return proved if proved is not None else _result(job, ticket.room, stats, None)

    async def abandon(self, express: Express, give_up: bool = True) -> None:
        """A fetch that failed between `launch` and `land`: return once its read has ended,
        and give the room up (as a failed read does) unless not `give_up` (the fetch's own
        arguments were refused: the room stays pinned for a fetch with good ones)."""
        if express.entered:
            return
        express.entered = True
        batch = express.route.batch
        if express.started is not None and batch is not None:
            await to_the_end(batch.settle(express.started))  # a cancel here must not outrun the copy
        if not give_up:
            return
        pins = {p.cp_rank: p for p in express.ticket.pins}
        self.release_pins([(o, pins[r]) for r, o in express.route.owners.items()], express.ticket.room, "give_up")

    def prepare(self, owners: dict[int, Owner], ticket: RoomTicket, aux: bytes | None = None) -> PreparedTicket:
        """`ticket`'s read over `owners`, laid out before its destination pages are known
        (`aux`: the request's auxiliary bytes, which the result then carries)."""
        pins = {p.cp_rank: p for p in ticket.pins}
        batches = _batches(owners)
        together = [(lane, [(o, pins[r]) for r, o in group.items()], batch) for lane, (group, batch) in batches.items()]
        alone = [(o, pins[r]) for r, o in owners.items() if o.lane not in batches]
        every = [(o, pins[r]) for r, o in owners.items()]
        src = np.asarray(ticket.src_pages, dtype=np.int64)
        return PreparedTicket(ticket.room, owner_urls(owners), src, every, together, alone, aux)

    @staticmethod
    def launches(prepared: PreparedTicket) -> bool:
        """Whether `prepared`'s read is one launch (`launch_prepared`): every owner one batch
        of a lane that launches by a call."""
        return not prepared.alone and len(prepared.together) == 1 and hasattr(prepared.together[0][2], "start")

    def launch_prepared(
        self, prepared: PreparedTicket, dst: np.ndarray, skip: int, landing: Landing | None = None
    ) -> EarlyRead | None:
        """Launch `prepared`'s read into `dst` now (ids `bounded_ids` checked against the
        pool), where it is one launch (`launches`); None, nothing launched, otherwise. A bad
        source id raises before any launch. Whether a destination id repeats is the caller's
        `page_ids` to say next, while the kernel copies: a refusal then owes `settle` before
        it is reported."""
        if not self.launches(prepared) or prepared.src.size != skip + dst.size:  # the read's own check says why
            return None
        _, pinned, batch = prepared.together[0]
        start = batch.start  # type: ignore[attr-defined]
        src = prepared.src[skip:]
        watch = landing if landing is not None and all(o.pins is not None for o, _ in pinned) else None
        t0 = time.perf_counter()
        try:
            started = start(src, dst, self.ctx.pool.layout.num_pages, watch)
        except PeerLostError as exc:
            raise _lost_among(pinned, exc) from exc
        return EarlyRead(src, dst, started, t0)

    async def settle(self, prepared: PreparedTicket, early: EarlyRead) -> None:
        """Return once `early`'s read has ended: its fetch failed before `read` took it over."""
        if early.entered:  # `read` waits for its end, whatever happens
            return
        early.entered = True
        _, _, batch = prepared.together[0]
        if early.started is not None:
            await to_the_end(batch.settle(early.started))  # type: ignore[attr-defined]

    async def fetch(
        self, owners: dict[int, Owner], ticket: RoomTicket, job: Fetch, release: PinRelease | None = None
    ) -> FetchResult:
        """Read every owner at once and prove each pin word after the data (`read`)."""
        return await self.read(self.prepare(owners, ticket), job, release)

    async def read(
        self,
        prepared: PreparedTicket,
        job: Fetch,
        release: PinRelease | None = None,
        early: EarlyRead | None = None,
    ) -> FetchResult:
        """Read a prepared ticket's owners at once and prove each pin word after the data.
        `release`: how the room is released once proved (a ticket's notifications by
        default); with one, the reader holds claims (their owners push an abort, which stops
        the reads at once) and a failure releases nothing (the caller gives its claims up).
        `early`: its read, launched already into `job`'s pages (`launch_prepared`)."""
        room = prepared.room
        src = job.wanted(prepared.src, room)
        reads = [self._read_with_pin(o, pin, room, src, job) for o, pin in prepared.alone]
        try:
            if not reads and len(prepared.together) == 1:  # every owner on one lane: one read, awaited in this task
                lane, pinned, batch = prepared.together[0]
                landing = job.landing if all(o.pins is not None for o, _ in pinned) else None
                if early is not None:
                    early.entered = True
                    launching: Launching = batch  # type: ignore[assignment]  # `launch_prepared` found `start`
                    batch_read = self._launched(
                        lane, pinned, launching, early.started, room, early.src, job, landing, prepared.aux, early.t0
                    )
                else:
                    batch_read = self._read_batch_with_pins(lane, pinned, batch, room, src, job, landing, prepared.aux)
                per_task = [await batch_read]
            else:
                reads += [self._read_batch_with_pins(*together, room, src, job) for together in prepared.together]
                aborted = self.ctx.feed.aborted(prepared.urls, room) if release is not None else None
                per_task = await self.ctx.tasks.each(reads, aborted)
        except BaseException:  # every read has ended: release at once
            if release is None:
                self.release_pins(prepared.every, room, "give_up")
            raise
        # Released once every pin was proved, after the fetch returns: notifications sent
        # while other owners were still being read slowed those reads. A read the lane's
        # thread told its caller of has waited out the delay already (`Landing`).
        proved = job.landing.proved_result() if job.landing is not None else None
        send = functools.partial(release or self.release_pins, prepared.every, room)
        self._release_later(send, 0.0 if proved is not None else self.release_delay)
        if proved is not None:  # the caller's result, timed where it was proved
            return proved
        # One task (every owner in one read) already lists its owners by CP rank.
        stats = per_task[0] if len(per_task) == 1 else sorted((s for t in per_task for s in t), key=_by_rank)
        return _result(job, room, stats, prepared.aux)

    async def prove(
        self, owners: dict[int, Owner], ticket: RoomTicket, deadline: Deadline, release: PinRelease
    ) -> None:
        """Prove a read of `ticket`'s room that has already landed (by claims, every owner
        read) by each owner's pin word, then `release` the room as `read` does: no round
        trip to any owner."""
        pins = {p.cp_rank: p for p in ticket.pins}
        pinned = [(o, pins[r]) for r, o in owners.items()]
        try:
            await self._prove_pins(pinned, ticket.room, deadline)
        except PeerLostError as exc:
            raise _lost_among(pinned, exc) from exc
        self._release_later(functools.partial(release, pinned, ticket.room))

    async def _read_with_pin(
        self, owner: Owner, pin: OwnerPin, room: int, src: np.ndarray, job: Fetch
    ) -> list[OwnerStats]:
        """Read all of one owner's layers through its lane, then prove its pin."""
        r = owner.rank
        t0 = time.perf_counter()
        layers = range(r.layer_start, r.layer_end)
        try:
            xfer = await read_layers(owner, layers, src, job.dst, job.deadline)
            await self._prove_pins([(owner, pin)], room, job.deadline)
        except PeerLostError as exc:
            raise lost_peer(r, exc) from exc
        span, elapsed = (layers.start, layers.stop), time.perf_counter() - t0
        return [OwnerStats(r.cp_rank, span, xfer.nbytes, xfer.descriptors, 1, elapsed, xfer.seconds, owner.lane_name)]

    async def _read_batch_with_pins(
        self,
        lane: Lane[Any],
        pinned: list[tuple[Owner, OwnerPin]],
        batch: Batch[Peer],
        room: int,
        src: np.ndarray,
        job: Fetch,
        landing: Landing | None = None,
        aux: bytes | None = None,
    ) -> list[OwnerStats]:
        """Read every layer of these owners (one lane's, `batch` over them) as one
        operation, then prove each one's pin; each owner's share of the time is its share of
        the bytes. With a `landing` (every pin table mapped: the proof is loads), the lane's
        own thread may prove the bytes as they land and leave the result for a polling caller
        (`Landing`); the proof is made once."""
        t0 = time.perf_counter()
        start = getattr(batch, "start", None)
        if start is not None:  # launched first: the rest runs while it copies
            try:
                started = start(src, job.dst, self.ctx.pool.layout.num_pages, landing)
            except PeerLostError as exc:
                raise _lost_among(pinned, exc) from exc
            return await self._launched(lane, pinned, batch, started, room, src, job, landing, aux, t0)  # type: ignore[arg-type]
        # `dst` came through `page_ids` against this pool: the plan need not check it again.
        read = functools.partial(batch.read, src, job.dst, self.ctx.pool.layout.num_pages, landing)
        return await self._proved(lane, pinned, batch, room, src, job, landing, aux, t0, read)

    async def _launched(
        self,
        lane: Lane[Any],
        pinned: list[tuple[Owner, OwnerPin]],
        batch: Launching,
        started: Any,
        room: int,
        src: np.ndarray,
        job: Fetch,
        landing: Landing | None,
        aux: bytes | None,
        t0: float,
    ) -> list[OwnerStats]:
        """`_read_batch_with_pins` once its read was launched (`started`): everything else
        runs while the kernel copies; then its end is awaited and each pin proved."""
        landed = _nothing_read if started is None else functools.partial(batch.landed, started, landing)
        return await self._proved(lane, pinned, batch, room, src, job, landing, aux, t0, landed)

    async def _proved(
        self,
        lane: Lane[Any],
        pinned: list[tuple[Owner, OwnerPin]],
        batch: Batch[Peer],
        room: int,
        src: np.ndarray,
        job: Fetch,
        landing: Landing | None,
        aux: bytes | None,
        t0: float,
        read: Callable[[], Awaitable[float]],
    ) -> list[OwnerStats]:
        """Await `read` (the lane's, of these owners' layers: its seconds), then prove each
        owner's pin. A `landing` is armed first, before the lane's thread can tell it (in
        `read`): that thread may then prove the bytes as they land (`Landing`)."""
        prove = None
        if landing is not None:
            prove = functools.partial(_prove_all_mapped, pinned, room)

            def proved_result() -> FetchResult:  # the result as the lane's thread reports it
                elapsed = time.perf_counter() - t0  # the read's seconds too: the GPU's own are read on the loop
                return _result(job, room, _batch_stats(lane, batch, src.size, elapsed, elapsed), aux)

            landing.arm(prove, proved_result)
        try:
            seconds = await read()
            if landing is not None and prove is not None:
                landing.check(prove)
            elif unmapped := _prove_mapped_pins(pinned, room):  # not the usual case: owners here map their pin tables
                await self._prove_read_pins(unmapped, room, job.deadline)
        except PeerLostError as exc:
            raise _lost_among(pinned, exc) from exc
        asyncio.get_running_loop().call_soon(observe_read, lane.name, seconds)  # after the fetch returns
        return _batch_stats(lane, batch, src.size, time.perf_counter() - t0, seconds)

    async def _prove_pins(self, pinned: list[tuple[Owner, OwnerPin]], room: int, deadline: Deadline) -> None:
        """Check each owner's pin word for `room` after its data: still the nonce, or raise.
        A mapped word is a load; the others are READ, one after another."""
        await self._prove_read_pins(_prove_mapped_pins(pinned, room), room, deadline)

    async def _prove_read_pins(self, unmapped: list[tuple[Owner, OwnerPin]], room: int, deadline: Deadline) -> None:
        """Check the pins `_prove_mapped_pins` left (slots already bounded), each word READ."""
        for owner, pin in unmapped:
            _check_pin_word(pin, room, await self._read_pin(owner, pin, deadline))

    async def _read_pin(self, owner: Owner, pin: OwnerPin, deadline: Deadline) -> int:
        """The pin word READ through the signals (an owner on another host)."""
        assert owner.rank.pins is not None
        # A window of words around the slot, not the word alone: a transport may emulate an
        # 8-byte READ with messages the owner must progress (UCX on loopback), while 16 KiB
        # go by zero copy like the data.
        self._next_window = (self._next_window + 1) % PIN_WINDOWS
        local = self.pin_windows[self._next_window]
        first = pin.slot - pin.slot % len(local)
        window = local[: min(len(local), owner.rank.pins.slots - first)]
        addr = owner.rank.pins.addr + 8 * first
        await self.signals.read_word(owner.rank.agent_name, addr, window, deadline.within(self.ctx.timeouts.request))
        return int(window[pin.slot - first])

    def _release_later(self, send: Callable[[], None], delay: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        delay = self.release_delay if delay is None else delay
        if delay <= 0:
            loop.call_soon(send)
            return

        def fire() -> None:
            self._deferred.pop(timer, None)
            send()

        timer = loop.call_later(delay, fire)
        self._deferred[timer] = send

    def flush(self) -> None:
        """Send the releases still waiting out `release_delay` now (the fetcher is closing:
        a release that never went would leave its room pinned until the pin expired); none
        is sent again after (the connections go)."""
        deferred, self._deferred = self._deferred, {}
        for timer, send in deferred.items():
            timer.cancel()
            send()
        self.releases.close()

    def release_pins(self, pins: list[tuple[Owner, OwnerPin]], room: int, kind: str = "release") -> None:
        """Release a ticket's room on these owners (`kind` give_up: after a failed read, the
        same message): a notification each, no answer, queued without a wait, and sent again
        until each owner's pin word shows it took (`Releases`)."""
        fp = self.ctx.fingerprint
        notes = [(o, p, encode(TicketRelease(room=room, slot=p.slot, nonce=p.nonce), fp)) for o, p in pins]
        self.releases.send(notes, room, kind)

    def release_claims(self, pins: list[tuple[Owner, OwnerPin]], claim: Claim) -> None:
        """Release `claim` on these owners by a notification each (its bytes proved by their
        pin words, so no answer is needed), sent again as `release_pins`' until it took."""
        fp = self.ctx.fingerprint
        notes = [(o, p, encode(ClaimRelease(room=claim.room, claim=claim.token_on(p.cp_rank)), fp)) for o, p in pins]
        self.releases.send(notes, claim.room)

    def read_from(self, owners: dict[int, Owner], claim: Claim, start: int) -> None:
        """Tell each owner that `claim`'s reads start at page `start` (the decode holds the
        pages below): a notification each, no answer, not sent again. An owner frees those
        pages once every reader of the room has said where it starts; one that never hears
        keeps them pinned until the release (only owners with a pin table are connected here)."""
        fp = self.ctx.fingerprint
        told = [
            (o.rank.agent_name, encode(ReadFrom(room=claim.room, claim=claim.token_on(r), start=start), fp))
            for r, o in owners.items()
            if o.rank.pins is not None and r in claim.granted
        ]
        try:
            unsent = self.signals.notify(told) if told and not self.signals.closed else []
        except PdkvError as exc:
            logger.info("room %d: its read start not told (%s): the prefix stays pinned", claim.room, exc)
            return
        for agent in unsent:
            logger.info("room %d: no connection to %s: it keeps the prefix pinned", claim.room, agent)


async def _nothing_read() -> float:
    """A launch that moved nothing (no pages): no end to await."""
    return 0.0


def _lost_among(pinned: list[tuple[Owner, OwnerPin]], exc: PeerLostError) -> PeerLostError:
    """`exc` naming the engine and CP rank of the owner it lost, where it is one of these."""
    lost = next((o.rank for o, _ in pinned if o.rank.agent_name == exc.peer), None)
    return lost_peer(lost, exc) if lost is not None else exc


def _batches(owners: dict[int, Owner]) -> dict[Lane[Any], tuple[dict[int, Owner], Batch[Peer]]]:
    """Owners whose lane reads several as one batch, by lane, with their batch."""
    by_lane: dict[Lane[Any], dict[int, Owner]] = {}
    for r, o in owners.items():
        if o.lane is None:  # forgotten meanwhile (its engine re-registered or a peer was lost)
            raise PeerLostError(f"cp rank {r}: its connection was dropped", o.rank.agent_name)
        by_lane.setdefault(o.lane, {})[r] = o
    batches = {}
    for lane, group in by_lane.items():
        batch = lane.batch(peers_of(group.values()))
        if batch is not None:
            batches[lane] = (group, batch)
    return batches


def _batch_stats(lane: Lane[Any], batch: Batch[Peer], pages: int, elapsed: float, seconds: float) -> list[OwnerStats]:
    """Each owner of a batch read of `pages` pages (by CP rank), its share of the time its
    share of the bytes."""
    per_byte = seconds / max(1, batch.page_bytes)
    return [
        OwnerStats(p.cp_rank, (p.layers.start, p.layers.stop), b * pages, 0, 1, elapsed, b * per_byte, lane.name)
        for p, b in batch.shares
    ]


def _result(job: Fetch, room: int, stats: list[OwnerStats], aux: bytes | None) -> FetchResult:
    """A proved read's result (`stats` by CP rank; the lowest carries `aux`)."""
    if aux is not None and stats:
        stats = [msgspec.structs.replace(stats[0], aux=aux), *stats[1:]]
    nbytes = sum([s.nbytes for s in stats])
    return FetchResult(job.engine_id, room, nbytes, time.perf_counter() - job.started, tuple(stats), False, 0)


def _prove_all_mapped(pinned: list[tuple[Owner, OwnerPin]], room: int) -> None:
    """Check pins whose tables were all mapped here as the read began (loads only, so any
    thread may). An owner forgotten since (its table dropped) cannot be proved by a load:
    its peer counts as lost, and the read fails."""
    for owner, _ in _prove_mapped_pins(pinned, room):
        raise PeerLostError("its pin table was dropped while the room was read", owner.rank.agent_name)


def _prove_mapped_pins(pinned: list[tuple[Owner, OwnerPin]], room: int) -> list[tuple[Owner, OwnerPin]]:
    """Check the pins of owners on this host (their tables mapped here: a load each, no
    coroutine); returns the others, whose words must be READ."""
    unmapped = []
    for owner, pin in pinned:
        assert owner.rank.pins is not None
        if pin.slot >= owner.rank.pins.slots:
            raise MetadataError(f"room {room}: pin slot {pin.slot} outside cp rank {pin.cp_rank}'s pin table")
        mapped = owner.pins  # read once: the lane's thread proves while the loop may forget the owner
        if mapped is None:
            unmapped.append((owner, pin))
        else:
            _check_pin_word(pin, room, mapped.word(pin.slot))
    return unmapped


def _check_pin_word(pin: OwnerPin, room: int, word: int) -> None:
    """A pin word read after the data: still the ticket's nonce, or the bytes are not proved."""
    if word != pin.nonce:
        raise ClaimLostError(
            f"room {room}: its pages on cp rank {pin.cp_rank} were freed (aborted, expired or released "
            "by another holder of its ticket) before they were all read; the bytes may belong to another room"
        )


def _by_rank(stats: OwnerStats) -> int:
    return stats.cp_rank
