"""The claim protocol: claim the room on each owner, read layers as they become ready,
release, and so prove that the pages stayed pinned.

For all owners concurrently, a fetch claims the room (the lowest CP rank first), waits
for ready layers (pushed on the owner's event stream, or long-polled while that is down)
and reads them through the owner's lane, so it starts before the prefill has finished;
each owner's claim is released as soon as its layers are read, while other owners may
still be read. A release succeeds only while the claim still pins the room's pages, so
every successful release proves that no page read under it was freed or reused meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import numpy as np

from pdkv.errors import ClaimLostError, DeadlineExceeded, MetadataError, PdkvError, PeerLostError, UnknownRoomError
from transfer.deadline import Deadline
from transfer.decode.batches import BatchSlot, ReadBatch
from transfer.decode.owners import Owner, lost_peer, peers_of
from transfer.decode.tasks import DecodeContext, Fetch
from transfer.lanes.base import Lane, ReadStats
from transfer.metadata import (
    ClaimAll,
    ClaimAllReply,
    ClaimRequest,
    OwnerClaim,
    OwnerRef,
    ReleaseNotice,
    ReleaseReply,
    RoomState,
    RoomStatus,
    error_from,
)
from transfer.metrics import observe_read
from transfer.readiness import ReadinessFeed
from transfer.results import FetchResult, OwnerStats

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=msgspec.Struct)

_MARGIN = 0.2  # seconds of a claim-all's wait kept for the arbiter's answer to come back


def _unreached(error: PdkvError) -> bool:
    """An error of the arbiter's relay that says nothing of the room (the rank was not
    reached in time): the decode asks that rank itself."""
    return isinstance(error, (PeerLostError, DeadlineExceeded))


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
    # cp rank -> the room as the last read under the claim left it: whole, and with its pin
    # where the owner pins (a lease then proves the read by the pin words, `RoomLease`)
    final: dict[int, RoomState] = field(default_factory=dict)
    messages: int = 0  # control requests made under it (claims, polls, releases)
    # cp rank -> the token that rank holds this claim under, where not `token`: a claim the
    # rank held for the arbiter, which handed it to this claimant (`transfer.prefill.held`)
    tokens: dict[int, str] = field(default_factory=dict)

    def token_on(self, rank: int) -> str:
        return self.tokens.get(rank, self.token)

    @property
    def open_ranks(self) -> set[int]:
        return self.granted - self.released.keys()


class ClaimProtocol:
    """Claims, readiness, reads by layer batch and releases, for every owner of a fetch."""

    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx

    async def fetch(self, owners: dict[int, Owner], claim: Claim, job: Fetch, release: bool = True) -> FetchResult:
        """Read every owner's layers under `claim`; `release`: release each owner's claim as
        soon as its layers are read (a lease releases later)."""
        feed, messages_before = self.ctx.feed, claim.messages
        tasks: list[asyncio.Task[OwnerStats]] = []
        for o in owners.values():
            feed.want(o.rank.control_url, claim.room)
        try:
            first = await self.ctx.tasks.run(self.claim_arbiter(owners, claim, job.deadline))
            known = {r: first.get(r) or claim.states.pop(r, None) for r in owners}
            slots = _slots(owners, self.ctx.pool.layout.num_pages)
            tasks = [
                asyncio.create_task(self._fetch_owner(o, claim, job, release, known[r], slots.get(r)))
                for r, o in owners.items()
            ]
            stats = await self.ctx.tasks.gather(tasks, feed.aborted(owner_urls(owners), claim.room))
        except BaseException:  # cancellation too: never leave the room pinned
            if release:
                await self.give_up_all(owners, claim)
            raise
        finally:
            for o in owners.values():
                feed.forget(o.rank.control_url, claim.room)
        nbytes = sum(s.nbytes for s in stats)
        freed_on = tuple(sorted(r for r in owners if claim.released.get(r, False))) if release else ()
        messages = claim.messages - messages_before
        seconds = time.perf_counter() - job.started
        freed = len(freed_on) == len(owners)
        return FetchResult(job.engine_id, claim.room, nbytes, seconds, tuple(stats), freed, messages, freed_on)

    async def claim_all(self, owners: dict[int, Owner], claim: Claim, deadline: Deadline) -> None:
        """Take `claim` on every owner in one round trip: the arbiter (lowest rank) grants its
        own, relays it to the others and answers for all (`ClaimAll`). A rank the arbiter
        could not reach, or where the room is not published yet, is claimed directly.

        The owners' readiness streams are opened first (the caller forgets the room on
        failure): a stream opened only once the claims are held can come up after the room
        moved (an abort), and an owner pushes nothing to a consumer not listening yet."""
        for o in owners.values():
            self.ctx.feed.want(o.rank.control_url, claim.room)
        arbiter = min(owners)
        others = {r: o for r, o in owners.items() if r != arbiter and r not in claim.granted}
        if arbiter in claim.granted or not others:
            await self.ctx.tasks.run(self.claim_arbiter(owners, claim, deadline))
            rest = [self.claim_owner(o, claim, deadline) for r, o in others.items()]
            await self.ctx.tasks.run(asyncio.gather(*rest))
            return
        _, answers = await self.ctx.tasks.run(self._claim_through(owners[arbiter], others, claim, deadline))
        direct: list[Awaitable[RoomState]] = []
        refused: list[PdkvError] = []
        for r, answer in answers.items():
            if answer.state is not None and answer.state.status is not RoomStatus.UNKNOWN:
                claim.granted.add(r)
                claim.states[r] = answer.state
                if answer.claim is not None:
                    claim.tokens[r] = answer.claim
            elif answer.error is None or _unreached(error := error_from(answer.error, f"cp rank {r}")):
                direct.append(self.claim_owner(others[r], claim, deadline))  # not published there yet, or not reached
            else:
                refused.append(error)
        if refused:  # a rank refused the claim the arbiter granted: the room ended there, or another holds it
            raise refused[0]
        if direct:
            await self.ctx.tasks.run(asyncio.gather(*direct))

    async def _claim_through(
        self, arbiter: Owner, others: dict[int, Owner], claim: Claim, deadline: Deadline
    ) -> tuple[RoomState, dict[int, OwnerClaim]]:
        """A claim on `arbiter`'s channel, relayed from there to `others`, asked again while the
        room is not published there (bounded by `Timeouts.publish`): its state and each other
        rank's answer."""
        r, timeouts = arbiter.rank, self.ctx.timeouts
        url = f"{r.control_url}/v1/claims"
        ask = ClaimRequest(room=claim.room, consumer_id=self.ctx.consumer_id, claim=claim.token, readers=claim.readers)
        refs = [OwnerRef(cp_rank=o.rank.cp_rank, incarnation=o.rank.incarnation) for o in others.values()]
        unknown_until = Deadline.after(timeouts.publish)
        claim.asked.add(r.cp_rank)  # from here on it may be granted there, answered or not
        while True:
            limit = deadline.left(timeouts.poll + timeouts.request)
            # The arbiter answers within what is left less a margin, so that an owner that
            # never answers its relay is reported (and the fetch fails typed) before this
            # request's own bound.
            budget = ClaimAll(ask=ask, others=refs, budget_ms=max(1, int(1e3 * (limit - min(_MARGIN, limit / 4)))))
            try:
                claim.messages += 1
                fp = self.ctx.fingerprint
                reply = await self.ctx.client.call(
                    url, budget, ClaimAllReply, fingerprint=fp, expect_fingerprint=fp, timeout=limit
                )
            except (PeerLostError, DeadlineExceeded):  # the arbiter may have granted and relayed, unheard
                if others:
                    await self._unheard(arbiter, others, claim)
                raise
            if reply.arbiter.status is RoomStatus.UNKNOWN:
                if unknown_until.passed:
                    raise UnknownRoomError(f"room {claim.room} never appeared on cp rank {r.cp_rank}")
                continue
            claim.granted.add(r.cp_rank)
            claim.states[r.cp_rank] = reply.arbiter
            claim.asked.update(others)  # relayed: each may hold the claim now
            # the arbiter's relays, each a claim as if sent from here (a claim it handed out was none)
            claim.messages += sum(a.claim is None for a in reply.others)
            answers = {a.cp_rank: a for a in reply.others}
            if set(answers) != set(others):
                raise MetadataError(f"the arbiter answered for cp ranks {sorted(answers)}, asked {sorted(others)}")
            return reply.arbiter, answers

    async def _unheard(self, arbiter: Owner, others: dict[int, Owner], claim: Claim) -> None:
        """A claim-all whose answer was lost: give the claim up on the arbiter, and on the
        others only if this claimant held the arbiter's (a give-up there refused says another
        holds the room: its relays must not lose a claim to this claimant's give-ups)."""
        try:
            await self._give_up(arbiter, claim, Deadline.after(self.ctx.timeouts.request))
        except ClaimLostError:
            return
        except PdkvError as exc:  # unreachable: its pins expire; the others may hold ours
            logger.debug("giving up room %d on the arbiter after a lost answer: %s", claim.room, exc)
        claim.asked.update(others)

    async def claim_arbiter(self, owners: dict[int, Owner], claim: Claim, deadline: Deadline) -> dict[int, RoomState]:
        """Claim on the lowest CP rank before any other: every claimant asks it first, so of
        two racing for a single-consumer room one wins everywhere and the other is refused
        there, rather than each winning some owners and both failing."""
        rank = min(owners)
        if rank in claim.granted:
            return {}
        return {rank: await self.claim_owner(owners[rank], claim, deadline)}

    async def claim_owner(self, owner: Owner, claim: Claim, deadline: Deadline) -> RoomState:
        """Take one of the room's claims on `owner`, waiting (bounded) for it to be published."""
        state, _ = await self._claim_through(owner, {}, claim, deadline)
        return state

    async def _poll(
        self, owner: Owner, claim: Claim, after: int, deadline: Deadline, after_pages: int = -1
    ) -> RoomState:
        """The room's state once layers beyond `after` (or chunks' pages beyond
        `after_pages`) are ready: pushed on the owner's readiness stream, or (stream down,
        or a room that ended) one long-poll over HTTP."""
        url, timeouts = owner.rank.control_url, self.ctx.timeouts
        pushed = await self.ctx.feed.wait(url, claim.room, after, deadline.left(timeouts.poll), after_pages)
        if pushed is not None and pushed.status in (RoomStatus.PENDING, RoomStatus.READY):
            return pushed
        token = claim.token_on(owner.rank.cp_rank)
        url = f"{url}/v1/rooms/{claim.room}?after={after}&after_pages={after_pages}&claim={token}"
        limit = deadline.left(timeouts.poll + timeouts.request)
        return await self._control(claim, "GET", url, RoomState, None, limit)

    async def _control(
        self,
        claim: Claim,
        method: str,
        url: str,
        kind: type[M],
        body: msgspec.Struct | None,
        timeout: float,
        fingerprint: str | None = None,
    ) -> M:
        """One control request to an owner under `claim`, in our layout's envelope both ways
        (`fingerprint`: another's, for a request whose body names no layout)."""
        claim.messages += 1
        fp = fingerprint or self.ctx.fingerprint
        answer = await self.ctx.client.request(
            method, url, kind, body, fingerprint=fp, expect_fingerprint=fp, timeout=timeout
        )
        assert answer is not None
        return answer

    async def _fetch_owner(
        self, owner: Owner, claim: Claim, job: Fetch, release: bool, state: RoomState | None, slot: BatchSlot | None
    ) -> OwnerStats:
        """Read one owner's layers, then release them there (while other owners still read)."""
        try:
            stats = await self._read_owner(owner, claim, job, state, slot)
            if release:
                await self.release(owner, claim, job.deadline.within(self.ctx.timeouts.request))
            return stats
        except PeerLostError as exc:
            raise lost_peer(owner.rank, exc) from exc
        finally:
            if slot is not None:
                slot.close()  # others must not wait for an owner that read alone or failed

    async def _read_owner(
        self, owner: Owner, claim: Claim, job: Fetch, state: RoomState | None, slot: BatchSlot | None
    ) -> OwnerStats:
        r = owner.rank
        t0 = time.perf_counter()
        cursor, nbytes, descs, reads, busy = r.layer_start, 0, 0, 0, 0.0
        if state is None and r.cp_rank in claim.granted:
            state = await self._poll(owner, claim, cursor - 1, job.deadline)
        elif state is None:
            state = await self.claim_owner(owner, claim, job.deadline)
        if state.ready_pages is not None:  # sent by chunks of pages, every layer at once
            if slot is not None:
                slot.close()
            return await self._read_chunks(owner, claim, job, state, t0)
        src = job.wanted(np.asarray(state.src_pages, dtype=np.int64), claim.room)
        whole = range(r.layer_start, r.layer_end)
        while True:
            if state.ready_upto > cursor:
                layers = range(cursor, state.ready_upto)
                if slot is not None and layers == whole and owner.peer is not None:
                    xfer = await slot.read(owner.peer, src, job.dst, job.deadline)  # every layer ready: read as one
                else:
                    if slot is not None:
                        slot.close()
                    xfer = await read_layers(owner, layers, src, job.dst, job.deadline)
                nbytes, descs, reads = nbytes + xfer.nbytes, descs + xfer.descriptors, reads + 1
                busy += xfer.seconds
                cursor = state.ready_upto
            if cursor >= r.layer_end:
                break
            state = await self._poll(owner, claim, cursor, job.deadline)
        claim.final[r.cp_rank] = state
        span, elapsed = (r.layer_start, r.layer_end), time.perf_counter() - t0
        return OwnerStats(r.cp_rank, span, nbytes, descs, reads, elapsed, busy, owner.lane_name)

    async def _read_chunks(self, owner: Owner, claim: Claim, job: Fetch, state: RoomState, t0: float) -> OwnerStats:
        """Read a room sent by chunks: each new chunk's pages in all of the owner's layers,
        until the room is complete (the request's auxiliary bytes come with the last). The
        first `job.skip` pages (the decode's prefix) are not read."""
        r, dst, skip = owner.rank, job.dst, job.skip
        layers = range(r.layer_start, r.layer_end)
        done, nbytes, descs, reads, busy = 0, 0, 0, 0, 0.0
        while True:
            src = np.asarray(state.src_pages, dtype=np.int64)
            if state.ready_upto >= r.layer_end or src.size > skip + dst.size:
                job.wanted(src, claim.room)  # complete, or too long already: it must match
            start = max(done, skip)
            if src.size > start:
                xfer = await read_layers(owner, layers, src[start:], dst[start - skip : src.size - skip], job.deadline)
                nbytes, descs, reads = nbytes + xfer.nbytes, descs + xfer.descriptors, reads + 1
                busy += xfer.seconds
                done = src.size
            if state.ready_upto >= r.layer_end:  # the last chunk is in
                claim.final[r.cp_rank] = state
                span, elapsed = (r.layer_start, r.layer_end), time.perf_counter() - t0
                return OwnerStats(r.cp_rank, span, nbytes, descs, reads, elapsed, busy, owner.lane_name, state.aux)
            state = await self._poll(owner, claim, state.ready_upto, job.deadline, after_pages=done)

    async def release(self, owner: Owner, claim: Claim, deadline: Deadline, give_up: bool = False) -> bool:
        """Release the claim on one owner; True if that freed the room there. `give_up`:
        the room was not read (a failed or cancelled fetch): it ends aborted there unless
        another consumer reads it.

        A refusal (`ClaimLostError`) raises: those pages may have been reused mid-read.
        """
        token = claim.token_on(owner.rank.cp_rank)
        notice = ReleaseNotice(room=claim.room, consumer_id=self.ctx.consumer_id, claim=token, give_up=give_up)
        url = f"{owner.rank.control_url}/v1/rooms/{claim.room}/release"
        # A give-up names no layout (a room, a consumer, a token): it travels in the owner's
        # own envelope, so a decode whose layout the owner refuses still frees the room. It
        # ends only this token's claim or a free one, and the secret guards it as any request.
        fp = owner.rank.fingerprint if give_up else None
        sent = asyncio.ensure_future(self._control(claim, "POST", url, ReleaseReply, notice, deadline.left(), fp))
        try:
            # Seen through if the caller is cancelled (bounded by `deadline`): a release cut
            # off mid-request may never reach the owner, and one asked is never asked again,
            # so the room would stay pinned there until its pin expired.
            answer = await asyncio.shield(sent)
        except asyncio.CancelledError:
            await asyncio.wait([sent])
            if not sent.cancelled() and sent.exception() is not None:
                logger.debug("release of room %d after a cancel: %s", claim.room, sent.exception())
            raise
        finally:
            claim.released.setdefault(owner.rank.cp_rank, False)  # asked once: never again
        claim.released[owner.rank.cp_rank] = answer.freed
        return answer.freed

    async def _give_up(self, owner: Owner, claim: Claim, deadline: Deadline) -> bool:
        """`release(give_up=True)` on one owner, not waited for once the owner is lost."""
        url = owner.rank.control_url
        # It gave our claims up itself as our stream to it died: not one it held for the
        # arbiter, which no stream's loss ends (`transfer.prefill.held`).
        if self.ctx.feed.lost(url) and claim.token_on(owner.rank.cp_rank) == claim.token:
            return False
        return await _unless_lost(self.ctx.feed, url, self.release(owner, claim, deadline, give_up=True), deadline)

    async def give_up_all(self, owners: dict[int, Owner], claim: Claim, ranks: set[int] | None = None) -> None:
        """Give the claim up unread wherever it may be held, after a failed or cancelled
        fetch (`ranks`: these instead): the owners free the room's pages now, and a room
        that no consumer read ends aborted, so its prefill hears of the failure at once.

        Only ranks a claim request went to: another rank may still be about to grant the
        room's one claim to a decode that won it on the lowest rank. Each gets a full
        request timeout, not what is left of the fetch's deadline: the fetch may have
        failed on that deadline, and the pins must not be left behind.
        """
        deadline = Deadline.after(self.ctx.timeouts.request)
        ranks = claim.asked - claim.released.keys() if ranks is None else ranks
        results = await asyncio.gather(
            *(self._give_up(o, claim, deadline) for o in owners.values() if o.rank.cp_rank in ranks),
            return_exceptions=True,
        )
        for e in results:
            if isinstance(e, BaseException):
                logger.debug("giving up room %d after a failed fetch: %s", claim.room, e)


async def _unless_lost(feed: ReadinessFeed, url: str, request: Awaitable[bool], deadline: Deadline) -> bool:
    """`request`'s answer, unless the owner at `url` is lost first (its readiness stream broke):
    then False at once, the request left to run out behind (it is bounded). Such an owner gives
    this reader's claims up itself as the stream dies, so a give-up has nothing to wait for."""
    sent = asyncio.ensure_future(request)
    if not await _first(sent, feed.until_lost(url, deadline.remaining())):
        return await sent
    _BEHIND.add(sent)
    sent.add_done_callback(_BEHIND.discard)
    sent.add_done_callback(lambda t: t.cancelled() or t.exception())  # read: never "never retrieved"
    return False


_BEHIND: set[asyncio.Future[bool]] = set()  # give-ups left running behind (a task needs a reference)


async def _first(sent: asyncio.Future[bool], lost: Awaitable[bool]) -> bool:
    """Whether `lost` came true before `sent` ended."""
    watch = asyncio.ensure_future(lost)
    try:
        await asyncio.wait([sent, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    return not sent.done() and watch.done() and not watch.cancelled() and watch.result()


async def read_layers(owner: Owner, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline) -> ReadStats:
    """Copy `layers` of one owner through its lane."""
    if owner.lane is None:  # forgotten meanwhile (its engine re-registered or a peer was lost)
        raise PeerLostError(f"cp rank {owner.rank.cp_rank}: its connection was dropped", owner.rank.agent_name)
    xfer = await owner.lane.read(owner.peer, layers, src, dst, deadline)
    observe_read(owner.lane.name, xfer.seconds)
    return xfer


def _slots(owners: dict[int, Owner], dst_below: int) -> dict[int, BatchSlot]:
    """A slot in a read batch of its lane for each owner whose lane reads several as one
    (`dst_below`: the destination page ids lie below it, checked against the pool)."""
    by_lane: dict[Lane[Any], list[Owner]] = {}
    for o in owners.values():
        if o.lane is not None:
            by_lane.setdefault(o.lane, []).append(o)
    slots: dict[int, BatchSlot] = {}
    for lane, group in by_lane.items():
        if len(group) >= 2 and lane.batch(peers_of(group)) is not None:
            batch = ReadBatch(lane, len(group), dst_below)
            slots.update((o.rank.cp_rank, batch.slot()) for o in group)
    return slots


def owner_urls(owners: dict[int, Owner]) -> dict[str, int]:
    """Each owner's control URL and its CP rank."""
    return {o.rank.control_url: r for r, o in owners.items()}
