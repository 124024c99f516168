"""A claim held across reads: a decode that must re-read a room, or that claimed it ahead.

async with await fetcher.claim(engine_id, room) as lease:
    result = await lease.read(dst_pages)    # as often as needed, one claim
# leaving the block releases: raises ClaimLostError if the pages did not stay pinned
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from pdkv.errors import ClaimLostError, ClosedError, InvalidPagesError, PdkvError, RoomAbortedError
from pdkv.pages import PageIds, bounded_ids, page_ids
from transfer.deadline import Deadline
from transfer.decode.claims import Claim, ClaimProtocol, owner_urls
from transfer.decode.landing import Landing
from transfer.decode.owners import Owner, pinned
from transfer.decode.tasks import Activity, DecodeContext, Fetch, budget
from transfer.decode.tickets import EarlyRead, PreparedTicket, TicketProtocol
from transfer.metadata import OwnerPin, RoomState, RoomStatus, RoomTicket
from transfer.metrics import fetching, observe_fetch, observe_fetch_failure
from transfer.results import FetchResult

logger = logging.getLogger(__name__)


class RoomLease:
    """A claim on one room held on every owner; its source pages stay pinned until
    `release()`. Reads under it may be repeated. Use `async with` or call `release()`."""

    def __init__(
        self,
        ctx: DecodeContext,
        activity: Activity,
        claims: ClaimProtocol,
        tickets: TicketProtocol,
        engine_id: str,
        owners: dict[int, Owner],
        claim: Claim,
    ) -> None:
        self._ctx, self._activity, self._claims, self._tickets = ctx, activity, claims, tickets
        self.engine_id, self._owners, self._claim = engine_id, owners, claim
        self._released: bool | None = None
        self._start: int | None = None  # the page every read under the claim starts from (its first read's skip)
        # The room's read as a ticket's and the owners' states it was made from: made as the
        # claim is granted, ahead of the pages (`_prepared_read`).
        self._prepared: tuple[tuple[RoomState | None, ...], PreparedTicket | None] | None = None
        with contextlib.suppress(PdkvError):  # not prepared now: the read tries again, and fails there
            self._prepared_read()

    @property
    def room(self) -> int:
        return self._claim.room

    async def read(
        self,
        dst_pages: PageIds,
        *,
        deadline: Deadline | None = None,
        timeout: float | None = None,
        skip: int = 0,
    ) -> FetchResult:
        """Read every layer of the room into `dst_pages` (waiting for layers still written);
        `skip`: the room's first pages are not read (the decode holds that prefix already),
        `dst_pages` receive the rest. The first read's `skip` is told to the owners, which
        free those pages once no reader of the room will read them: a later read under the
        lease may not skip fewer (`InvalidPagesError`).

        The bytes are the room's only if `release()` then succeeds: until then a reader
        must not hand them on.
        """
        self._check_read(skip)
        job = self._begin(dst_pages, budget(self._ctx.timeouts.fetch, deadline, timeout), skip=skip)
        return await self._observed(self._read(job))

    async def release(self) -> bool:
        """Release the claim on every owner; True if that freed the room (it was the last).

        Raises `ClaimLostError` if any owner had freed the pages first (aborted, expired):
        whatever was read under this lease must then be discarded. Idempotent.
        """
        if self._released is not None:
            return self._released
        claim = self._claim
        self._released = False
        self._forget()
        ranks, deadline = claim.open_ranks, Deadline.after(self._ctx.timeouts.request)
        outcomes = await asyncio.gather(
            *(self._claims.release(o, claim, deadline) for o in self._owners.values() if o.rank.cp_rank in ranks),
            return_exceptions=True,
        )
        failures = [e for e in outcomes if isinstance(e, BaseException)]
        if failures:
            raise failures[0]
        self._released = all(claim.released.get(r, False) for r in self._owners)
        return self._released

    async def give_up(self) -> None:
        """Give the claim up unread (the read failed or was cancelled): as a failed fetch
        does, so a room that no consumer read ends aborted on its owners. Idempotent."""
        if self._released is not None:
            return
        self._released = False
        self._forget()
        await self._claims.give_up_all(self._owners, self._claim)

    async def until_aborted(self) -> None:
        """Wait while the claim is held, unread: raise `RoomAbortedError` once an owner pushes
        the room's abort on its readiness stream, `PeerLostError` once an owner is lost
        (`ReadinessFeed.aborted`); the caller cancels it as it reads or gives the room up.
        A decode that claimed ahead then hears its prefill's abort before it names its pages."""
        await self._ctx.feed.aborted(owner_urls(self._owners), self.room)

    async def read_once(
        self,
        dst_pages: PageIds,
        *,
        deadline: Deadline | None = None,
        timeout: float | None = None,
        landing: Landing | None = None,
        skip: int = 0,
    ) -> FetchResult:
        """`read` (`skip` as there), then `release` (which proves the bytes): a fetch whose
        claim was taken ahead. On any failure, cancellation too, the claim is given up.

        Where every owner's claim found the room whole and named its pin, the room is read
        as a ticket's: every owner at once, each pin word proved after the data, the claims
        released by notifications after the return (`freed` is then unknown: False). A room
        read as it was written (by claims) is proved the same way where every owner's last
        state named its pin, rather than by a release round trip to each owner. `landing`:
        where such a read is one launch on the GPU lane, a polling caller's thread may see it
        land (`transfer.decode.landing`)."""

        async def begin(prepared: PreparedTicket | None) -> tuple[Fetch, EarlyRead | None]:
            return await self._launch_then_begin(prepared, dst_pages, deadline, timeout, landing, skip)

        return await self._once(begin, self._observed)

    async def fetch(self, job: Fetch) -> FetchResult:
        """`read_once` for `job`, a fetch by claims whose claim this lease holds since just now
        (`DecodeFetcher.fetch`, which times and counts it): its `control_messages` are the
        claim's (claims, polls, releases), its `seconds` run from the fetch's call to the proof."""

        async def adopt(_: PreparedTicket | None) -> tuple[Fetch, EarlyRead | None]:
            return self._adopt(job), None

        result = await self._once(adopt, _unobserved, to_proof=True)
        return msgspec.structs.replace(result, control_messages=self._claim.messages)

    async def __aenter__(self) -> RoomLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    # ---- internals -------------------------------------------------------------------------------
    async def _once(
        self,
        begin: Callable[[PreparedTicket | None], Awaitable[tuple[Fetch, EarlyRead | None]]],
        observed: Callable[[Awaitable[FetchResult]], Awaitable[FetchResult]],
        to_proof: bool = False,
    ) -> FetchResult:
        """One read, then the release that proves it (`read_once`); `begin` makes the read's
        job (given the read as a ticket's, it may launch it first), `observed` counts the
        read as a fetch (or not: the caller does). `to_proof`: a read by claims is timed up
        to its proof (a read as a ticket's always is)."""
        try:
            self._activity.check()
        except ClosedError:
            await self.give_up()  # as any read refused under the lease
            raise
        # Close waits for the read, and for a launch's end and the give-up after a failure.
        with self._activity.call():
            prepared, early = None, None
            try:
                prepared = self._prepared_read()
                if prepared is not None:
                    for lane, _, _ in prepared.together:
                        lane.prime()  # as a ticket fetch does: the GPU wakes while the pages are checked
                    job, early = await begin(prepared)
                    return await observed(self._read_pinned(prepared, job, early))
                job, _ = await begin(None)
                result = await observed(self._read(job))
                self._activity.check()  # a fetcher closed during the read: no proof, its claims given up
                freed = False if await self._proved_by_pins() else await self.release()
                if to_proof:
                    result = msgspec.structs.replace(result, seconds=time.perf_counter() - job.started)
            except BaseException:
                try:
                    if prepared is not None and early is not None:  # a launch no read took over ends first
                        await self._tickets.settle(prepared, early)
                finally:
                    await self.give_up()
                raise
            finally:
                self._forget()
        freed_on = tuple(sorted(r for r, last in self._claim.released.items() if last))
        return msgspec.structs.replace(result, freed=freed, freed_on=freed_on)

    async def _read(self, job: Fetch) -> FetchResult:
        """Read the room by claims under this lease's claim (released later)."""
        with self._activity.call():
            return await self._claims.fetch(self._owners, self._claim, job, release=False)

    async def _observed(self, read: Awaitable[FetchResult]) -> FetchResult:
        """`read`'s result, counted as a fetch (in flight meanwhile; a failure counted by its error)."""
        try:
            with fetching(self.engine_id):
                result = await read
        except PdkvError as exc:
            observe_fetch_failure(self.engine_id, exc)
            raise
        asyncio.get_running_loop().call_soon(observe_fetch, result)  # each read counts once, as a fetch
        return result

    def _adopt(self, job: Fetch) -> Fetch:
        """`job` as this lease's first read: a fetch's, whose pages are checked already."""
        if self._released is not None:
            raise ClosedError(f"lease on room {self.room} was already released")
        self._start = job.skip
        return job

    async def _launch_then_begin(
        self,
        prepared: PreparedTicket | None,
        dst_pages: PageIds,
        deadline: Deadline | None,
        timeout: float | None,
        landing: Landing | None,
        skip: int,
    ) -> tuple[Fetch, EarlyRead | None]:
        """`_begin`, with the read as a ticket's (`prepared`) launched first where it can be
        (`TicketProtocol.launch_prepared`), its destination ids bounded before: the pages'
        other checks and the bookkeeping then run while its kernel copies. A read refused by
        them has ended before the refusal is raised."""
        started = time.perf_counter()
        self._check_read(skip)
        limit = budget(self._ctx.timeouts.fetch, deadline, timeout)  # refused before any launch
        early, num_pages = None, self._ctx.pool.layout.num_pages
        launches = prepared is not None and self._tickets.launches(prepared)
        bounded = bounded_ids(dst_pages, num_pages, "destination pages") if launches else None
        if prepared is not None and bounded is not None:
            try:
                early = self._tickets.launch_prepared(prepared, bounded, skip, landing)
            except PdkvError as exc:  # the owners' side (a mapping dropped, a source id): the read's failure
                observe_fetch_failure(self.engine_id, exc)
                raise
        if early is None:
            return self._begin(dst_pages, limit, landing, skip, started), None
        try:
            return self._begin(early.dst, limit, landing, skip, started), early
        except BaseException:
            assert prepared is not None
            await self._tickets.settle(prepared, early)
            raise

    def _check_read(self, skip: int) -> None:
        """Refuse a read under a released lease, or one skipping another prefix than the first's."""
        if self._released is not None:
            raise ClosedError(f"lease on room {self.room} was already released")
        if skip < 0:
            raise InvalidPagesError(f"room {self.room}: a prefix of {skip} pages")
        if self._start is not None and skip < self._start:
            raise InvalidPagesError(f"room {self.room}: its owners were told its reads skip {self._start} pages")

    def _begin(
        self, dst_pages: PageIds, limit: Deadline, landing: Landing | None = None, skip: int = 0, started: float = 0.0
    ) -> Fetch:
        """A read's start, `_check_read` passed: its clock (from `started`, else now), its
        checked destination pages and its budget `limit`."""
        started, ctx = started or time.perf_counter(), self._ctx
        dst = page_ids(dst_pages, ctx.pool.layout.num_pages, "destination pages")
        if self._start is None:
            self._start = skip
            if skip > 0:  # the owners may free the prefix once every reader has said where it starts
                self._tickets.read_from(self._owners, self._claim, skip)
        return Fetch(self.engine_id, self.room, dst, limit, started, landing, skip)

    def _prepared_read(self) -> PreparedTicket | None:
        """The room's read as a ticket's (`TicketProtocol.prepare`), made once for the owners'
        states as they stand: usually as the claim is granted, on the decode's thread, so a
        read handed over later with its pages (SGLang's `send_metadata`) only checks them and
        launches. None unless the room reads as a ticket's (`_as_ticket`)."""
        states = tuple(self._state(r, o) for r, o in self._owners.items())
        if self._prepared is None or any(a is not b for a, b in zip(states, self._prepared[0])):
            ticket = self._as_ticket(states)
            prepared = None
            if ticket is not None:
                prepared = self._tickets.prepare(self._owners, ticket, _aux(self._owners, states))
            self._prepared = (states, prepared)
        return self._prepared[1]

    def _as_ticket(self, states: tuple[RoomState | None, ...]) -> RoomTicket | None:
        """The room as a ticket names it, from the owners' `states` (in `_owners`' order);
        None unless each found it whole (same pages everywhere) and named its own pin."""
        pins: list[OwnerPin] = []
        pages: list[int] | None = None
        for r, s in zip(self._owners, states):
            if s is None or s.pin is None or s.status is not RoomStatus.READY or pages not in (None, s.src_pages):
                return None
            if s.pin.cp_rank != r:  # a pin another rank's: read by claims, which need none
                return None
            pins.append(s.pin)
            pages = s.src_pages
        if pages is None or not pinned(self._owners):
            return None
        return RoomTicket(engine_id=self.engine_id, room=self.room, src_pages=pages, pins=pins)

    def _state(self, rank: int, owner: Owner) -> RoomState | None:
        """The room's newest state on `owner`: as its claim found it, or pushed since."""
        pushed = self._ctx.feed.latest(owner.rank.control_url, self.room)
        if pushed is not None and pushed.status is not RoomStatus.PENDING:
            return pushed
        return self._claim.states.get(rank)

    async def _read_pinned(self, prepared: PreparedTicket, job: Fetch, early: EarlyRead | None) -> FetchResult:
        with self._activity.call():  # the claim is given up before close can end the client
            try:
                result = await self._tickets.read(prepared, job, self._notify, early)
                self._released_by_notifications()
            except BaseException as exc:
                try:
                    if early is not None:  # refused before `read` waited for it: its copy ends first
                        await self._tickets.settle(prepared, early)
                finally:
                    await self.give_up()
                if isinstance(exc, ClaimLostError) and not isinstance(exc, RoomAbortedError):
                    # a pin word cleared under an open claim: aborted or expired
                    msg = f"room {self.room} was aborted (or its pin expired) while it was read"
                    raise RoomAbortedError(msg) from exc
                raise
        return result

    async def _proved_by_pins(self) -> bool:
        """After a read by claims: if every owner's last state found the room whole and named
        its pin, prove the read by the pin words and release by notification; False (nothing
        done) if not: `release` proves it then. A pin word unchanged after the data proves
        the room never ended while it was read: it is cleared before the pages are freed,
        and a room that ended never becomes whole again."""
        ticket = self._as_ticket(tuple(self._claim.final.get(r) for r in self._owners))
        if ticket is None:
            return False
        await self._tickets.prove(self._owners, ticket, Deadline.after(self._ctx.timeouts.request), self._notify)
        self._released_by_notifications()
        return True

    def _released_by_notifications(self) -> None:
        """The read was proved by the pin words: the claim counts as released from now (its
        notifications may leave a moment later), so neither `release` nor `give_up` asks the
        owners again."""
        self._released = False
        for r in self._owners:
            self._claim.released[r] = False

    def _notify(self, pinned_owners: list[tuple[Owner, OwnerPin]], room: int) -> None:
        """Release the claim on every owner by a notification (its bytes proved by the pin words)."""
        self._tickets.release_claims(pinned_owners, self._claim)

    def _forget(self) -> None:
        """Stop keeping the room's pushed states (wanted since the claim)."""
        for o in self._owners.values():
            self._ctx.feed.forget(o.rank.control_url, self.room)


async def _unobserved(read: Awaitable[FetchResult]) -> FetchResult:
    return await read


def _aux(owners: dict[int, Owner], states: tuple[RoomState | None, ...]) -> bytes | None:
    """The request's auxiliary bytes, from the lowest CP rank whose state carried them
    (`states` given in `owners`' order)."""
    by_rank = sorted(zip(owners, states), key=lambda rank_state: rank_state[0])
    return next((s.aux for _, s in by_rank if s is not None and s.aux is not None), None)
