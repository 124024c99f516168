"""The decode's public face: fetch a request's full KV from every CP owner into local pages.

    async with DecodeFetcher(pool, registry_url) as fetcher:
        result = await fetcher.fetch(engine_id, room, dst_pages, ticket=ticket)

A fetch looks the engine up (cached, `owners`) and checks that its owners cover every
layer once and match the local layout. With the room's ticket (a finished room, handed
over by its prefill) it then reads every owner at once and checks each owner's pin word
after the data, asking nobody (`tickets`). Without one it claims the room on each owner
(`claims`); a room the claims found whole is then read as a ticket's and released by
notifications, one still being written layer by layer as it becomes ready, then proved by
the pin words or released over HTTP (`RoomLease.fetch`).

The guarantee: a fetch that returns delivered exactly the bytes of its room into
`dst_pages`. A claim pins the room's source pages on its owner; a release succeeds only
while the claim still pins them, so every successful release proves that no page read
under the claim was freed or reused meanwhile. A ticket's pin word is cleared before its
pages are freed, so finding it unchanged after the data proves the same. If any owner
refuses the release (`ClaimLostError`: aborted, expired, forgotten) the fetch raises,
whatever it read. A room published for `consumers` claims grants no more: a duplicate
decode or a second fetch of a single-consumer room is refused with `RoomClaimedError`
before anything is read.

To re-read a room (after a check of its own failed, say) a decode holds a lease instead
(`fetcher.claim`, `transfer.decode.lease`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import overload

import torch

from pdkv.errors import IncompatibleLayoutError, PdkvError, PeerLostError
from pdkv.pages import PageIds, bounded_ids, page_ids
from transfer.control import ControlClient
from transfer.deadline import Deadline
from transfer.decode.claims import Claim, ClaimProtocol
from transfer.decode.landing import Landing, StreamFetch, StreamLanding, consumer_stream
from transfer.decode.lease import RoomLease
from transfer.decode.owners import Owner, Owners, ticket_readable
from transfer.decode.tasks import Activity, DecodeContext, Fetch, budget
from transfer.decode.tickets import Express, TicketProtocol
from transfer.engine_kv import KVBuffers
from transfer.lanes.base import Signals, Transport
from transfer.lanes.choice import LANES, check_lane, lanes_for
from transfer.logctx import failure_fields, request_context
from transfer.metadata import RankDescriptor, RoomTicket
from transfer.metrics import fetching, observe_fetch, observe_fetch_failure
from transfer.readiness import ReadinessFeed
from transfer.registry import registry_client
from transfer.results import FetchResult
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)


class DecodeFetcher:
    """Fetches KV of prefill rooms into `pool`. Many fetches may run at once.

    `lane` picks the lanes an owner may be read by, in order (one of `LANES`: "auto"
    prefers a lane of this host where one reaches the owner, the others force one lane);
    `ucx_workers`, `merge_runs` and `time_kernels` tune them (`transfer.lanes.choice`;
    timed kernels, in `OwnerStats.read_seconds`, cost each fetch host time).
    `release_delay`: seconds a room read as a ticket's waits after the fetch returned
    before its releases go (`TicketProtocol`; for callers polling from another thread).
    """

    LANES = LANES

    # Made by start(); the activity check keeps every call out until then.
    _owners: Owners
    _tickets: TicketProtocol
    _signals: Signals

    def __init__(
        self,
        pool: KVBuffers,
        registry_url: str,
        *,
        consumer_id: str | None = None,
        timeouts: Timeouts = Timeouts(),
        secret: str | None = None,
        ucx_workers: int | None = None,
        merge_runs: bool = True,
        lane: str = "auto",
        time_kernels: bool = False,
        release_delay: float = 0.0,
    ) -> None:
        check_lane(lane, pool)
        if len(pool.owned) != pool.layout.layer_num:
            raise IncompatibleLayoutError("a decode pool must hold every layer")
        self.lane, self.time_kernels, self.merge_runs = lane, time_kernels, merge_runs
        self._release_delay = release_delay
        self.pool, self.timeouts = pool, timeouts
        self.consumer_id = consumer_id or f"decode-{uuid.uuid4().hex[:8]}"
        self._registry = registry_client(registry_url, timeouts, secret)
        self._workers, self._secret = ucx_workers, secret
        client = ControlClient(timeouts, secret)
        feed = ReadinessFeed(client, self.consumer_id, pool.layout.fingerprint, timeouts.heartbeat)
        self._ctx = DecodeContext(pool, timeouts, self.consumer_id, client, feed)
        self._activity = Activity(self.consumer_id)
        self._claims = ClaimProtocol(self._ctx)

    async def start(self) -> None:
        lanes, self._signals, strict = lanes_for(
            self.pool,
            self.lane,
            self.consumer_id,
            timeouts=self.timeouts,
            workers=self._workers,
            merge_runs=self.merge_runs,
            time_kernels=self.time_kernels,
            secret=self._secret,
        )
        self._tickets = TicketProtocol(self._ctx, self._signals, self._release_delay)
        self._signals.register(self._tickets.pin_windows)
        self._owners = Owners(self.pool, self._registry, self.timeouts, lanes, self._signals, strict=strict)
        self._activity.open = True

    async def aclose(self) -> None:
        """Refuse new fetches, end those in flight with `ClosedError` (their claims given
        up), then drop connections and registrations. A read that cannot be stopped (a batch
        of every owner on a lane of this host, well under a millisecond) ends first."""
        activity = self._activity
        started, activity.closing = activity.open, True
        if started:
            self._owners.cancel()
        self._ctx.tasks.cancel_all()
        try:
            await asyncio.wait_for(activity.idle.wait(), self.timeouts.request)
        except asyncio.TimeoutError:
            logger.warning("closing with %d fetches still in flight", activity.active)
        await self._ctx.feed.aclose()
        await self._registry.aclose()
        await self._ctx.client.aclose()
        if started:
            self._tickets.flush()  # before the connections go, and driven out before they do
            await self._signals.drain()
            await self._owners.aclose()
            for lane in self._owners.lanes:
                await lane.aclose()
            await self._signals.aclose()
            activity.open = False

    async def __aenter__(self) -> DecodeFetcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def transport(self) -> Transport | None:
        """The transport of the signals and the UCX lane (READ workers, connections), once
        started and until closed."""
        return self._signals.transport if self._activity.open else None

    async def forget(self, engine_id: str) -> None:
        """Drop a cached engine and its peers' connections and keys."""
        await self._owners.forget(engine_id)

    # ---- the fetch -----------------------------------------------------------------------------
    @overload
    async def fetch(
        self,
        engine_id: str,
        room: int,
        dst_pages: PageIds,
        *,
        deadline: Deadline | None = None,
        timeout: float | None = None,
        ticket: RoomTicket | None = None,
        readers: int = 1,
        landing: Landing | None = None,
        stream: None = None,
    ) -> FetchResult: ...

    @overload
    async def fetch(
        self,
        engine_id: str,
        room: int,
        dst_pages: PageIds,
        *,
        deadline: Deadline | None = None,
        timeout: float | None = None,
        ticket: RoomTicket | None = None,
        readers: int = 1,
        stream: torch.cuda.Stream | int,
    ) -> StreamFetch: ...

    async def fetch(
        self,
        engine_id: str,
        room: int,
        dst_pages: PageIds,
        *,
        deadline: Deadline | None = None,
        timeout: float | None = None,
        ticket: RoomTicket | None = None,
        readers: int = 1,
        landing: Landing | None = None,
        stream: torch.cuda.Stream | int | None = None,
    ) -> FetchResult | StreamFetch:
        """Read every layer of `room` from `engine_id`'s owners into `dst_pages`.

        `dst_pages`: distinct integer page ids (a list, a numpy array, or a CPU or GPU
        tensor), one per source page, checked before anything is asked (a ticket's read on
        the GPU lane may launch before the check that none repeats: refused for a repeat,
        it raises once its copy has ended, having written only pages it names). `deadline` (a
        request's end-to-end budget, passed through unchanged) or `timeout` (seconds from
        now): give at most one; with neither, `Timeouts.fetch` applies. `ticket`: the
        room's ticket from its prefill (through the router): the fetch then asks nobody;
        it reads every owner at once and proves the pin by each owner's pin word. Returns
        only when every byte of the room was read while its source pages stayed pinned
        (proved by a release, or by a pin word READ after the data); otherwise raises a
        `PdkvError` and the destination pages hold no valid KV. `readers`: this fetch is
        one of that many reads of the room by one group (a decode's attention-TP ranks,
        each reading it whole by claims): the room grants at least that many claims.
        `landing`: for a caller polling from another thread (`transfer.sync`), where a
        ticket's read is one batch on a lane that hears it land, that thread may see it land.

        `stream` (a `torch.cuda.Stream`, or a `cudaStream_t` as an int): returns a `StreamFetch`
        once the read is queued, its event behind the bytes and waited on by `stream`; await
        it for the result, proved (or the failure). Work on `stream` may run on bytes that the
        proof rejects: use none of it unless that returned (docs/gpu-lane.md#stream-ordered-completion).
        """
        if stream is not None:
            if landing is not None:
                raise ValueError("give a landing or a stream, not both")
            order = StreamLanding(consumer_stream(stream, self.pool.device))
            read = self.fetch(
                engine_id, room, dst_pages, deadline=deadline, timeout=timeout, ticket=ticket, readers=readers,
                landing=order,
            )  # fmt: skip
            return await order.hand_over(asyncio.ensure_future(read))
        started = time.perf_counter()
        with self._activity.call():  # close waits for this fetch, a launch's end after a failure too
            if deadline is not None and timeout is not None:  # refused before any launch (`budget`)
                raise ValueError("give a deadline or a timeout, not both")
            bounded = None
            if ticket is not None:
                if (ticket.engine_id, ticket.room) != (engine_id, room):
                    raise ValueError(
                        f"the ticket is for room {ticket.room} of {ticket.engine_id}, not {room} of {engine_id}"
                    )
                # A read follows within a fraction of a millisecond: where the GPU has another
                # process's work to switch from, it switches while the host checks the pages.
                for lane in self._owners.lanes:
                    lane.prime()
                bounded = bounded_ids(dst_pages, self.pool.layout.num_pages, "destination pages")
            express: Express | None = None
            refused = False  # the caller's pages: not the fetch's failure, and its room stays pinned
            try:
                if ticket is not None and bounded is not None:
                    # A finished room whose owners are one lane's batch (cached) is launched next,
                    # its ids bounded: whether one repeats is checked, and the bookkeeping below
                    # done, while its kernel copies. Such pages are the caller's own and in range.
                    try:
                        express = self._tickets.launch(self._owners.cached.get(engine_id), ticket, bounded, landing)
                    except PeerLostError:  # a mapping dropped: launched nothing
                        await self._owners.forget(engine_id)  # a failed connection serves no later fetch
                        raise
                try:
                    checked = dst_pages if bounded is None else bounded  # an array of its own already
                    dst = page_ids(checked, self.pool.layout.num_pages, "destination pages")
                except PdkvError:
                    refused = True
                    raise
                job = Fetch(engine_id, room, dst, budget(self.timeouts.fetch, deadline, timeout), started, landing)
                with request_context(engine=engine_id, room=room, consumer=self.consumer_id), fetching(engine_id):
                    if express is not None:
                        result = await self._tickets.land(express, job)
                    else:
                        result = await self._fetch(job, ticket, readers)
            except BaseException as exc:
                if express is not None:
                    await self._tickets.abandon(express, give_up=not refused)  # no byte lands after the outcome
                    if isinstance(exc, PeerLostError):
                        await self._owners.forget(engine_id)  # a failed connection serves no later fetch
                if isinstance(exc, PdkvError) and not refused:  # a refusal of its pages is the caller's
                    observe_fetch_failure(engine_id, exc)
                    fields = failure_fields(exc, room=room, engine=engine_id, consumer=self.consumer_id)
                    logger.warning("fetch of room %d from %s failed: %s", room, engine_id, exc, extra=fields)
                raise
        # Recorded once the caller has its result: a fetch of a finished room through a lane
        # of this host takes well under a millisecond, and on a CPU just woken each step costs more.
        asyncio.get_running_loop().call_soon(observe_fetch, result)
        return result

    async def _fetch(self, job: Fetch, ticket: RoomTicket | None, readers: int) -> FetchResult:
        # A cached engine and a ticket of its owners cost no coroutine of their own: on a host
        # just woken each one is microseconds of a lane fetch that takes a fraction of a millisecond.
        engine_id, owners_of = job.engine_id, self._owners
        owners = owners_of.cached.get(engine_id)
        was_cached = owners is not None
        if owners is None:
            owners = await self._lookup(engine_id, job.room, job.deadline)
        if ticket is not None:
            readable: dict[int, Owner] | None = owners
            if not ticket_readable(owners, ticket):
                readable = await owners_of.for_ticket(engine_id, owners, ticket, job.deadline)
            if readable is not None:
                try:
                    return await self._tickets.fetch(readable, ticket, job)
                except PeerLostError:
                    await owners_of.forget(engine_id)  # a failed connection serves no later fetch
                    raise
            owners = await owners_of.lookup(engine_id, job.deadline)
        try:
            return await self._by_claims(owners, Claim(job.room, readers), job)
        except PeerLostError:
            fresh = await owners_of.reregistered(engine_id, owners, was_cached, job.deadline)
            if fresh is None:
                raise
            logger.info("engine %s re-registered since it was cached; retrying room %d", engine_id, job.room)
            return await self._by_claims(fresh, Claim(job.room, readers), job)

    async def _by_claims(self, owners: dict[int, Owner], claim: Claim, job: Fetch) -> FetchResult:
        """A fetch without a ticket: take `claim` on every owner, then read the room once under
        it (`RoomLease.fetch`). A room that every owner's claim found whole and pinned is read
        as a ticket's, proved by the pin words and released by notifications, so that its only
        round trips are the claims (`freed` is then unknown: False); any other room is read by
        claims as it is written, then proved by the pin words or released over HTTP."""
        feed = self._ctx.feed
        for o in owners.values():  # the room's states are pushed from the first claim on
            feed.want(o.rank.control_url, claim.room)
        try:
            await self._claims.claim_all(owners, claim, job.deadline)
        except BaseException:  # cancellation too: never leave the room pinned
            for o in owners.values():
                feed.forget(o.rank.control_url, claim.room)
            await self._claims.give_up_all(owners, claim)
            raise
        lease = RoomLease(self._ctx, self._activity, self._claims, self._tickets, job.engine_id, owners, claim)
        return await lease.fetch(job)

    async def describe(self, engine_id: str, *, timeout: float | None = None) -> dict[int, RankDescriptor]:
        """The engine's ranks as this fetcher reads them (looked up and checked as for a
        fetch, cached): a serving engine's routing reads them (`RankDescriptor.group_size`)."""
        with self._activity.call():
            owners = await self._owners.lookup(engine_id, budget(self.timeouts.lookup, None, timeout))
        return {r: o.rank for r, o in owners.items()}

    async def give_up_room(self, engine_id: str, room: int, *, timeout: float | None = None) -> None:
        """This decode will not read `room` (its request was aborted): every owner gives up
        one of the room's claims, so the room ends aborted there at once (its pages freed,
        its prefill told) instead of staying pinned until its pin expires. A room not yet
        published is refused when it is. Owners that cannot be reached are logged."""
        deadline = budget(self.timeouts.request, None, timeout)
        with self._activity.call():
            try:
                owners = await self._owners.lookup(engine_id, deadline)
            except IncompatibleLayoutError:  # owners of another layout still take a give-up
                owners = await self._owners.refused(engine_id, deadline)
            with request_context(engine=engine_id, room=room, consumer=self.consumer_id):
                await self._claims.give_up_all(owners, Claim(room), set(owners))

    async def _lookup(self, engine_id: str, room: int, deadline: Deadline) -> dict[int, Owner]:
        """The engine's owners (`Owners.lookup`). Owners of another layout are refused with
        `IncompatibleLayoutError` once `room` was given up on each of them, before anything
        was claimed: this decode can never read it, and its prefill must not keep its pages
        pinned until they expire (nor wait that long to hear of it)."""
        try:
            return await self._owners.lookup(engine_id, deadline)
        except IncompatibleLayoutError as exc:
            logger.warning("room %d: engine %s has another KV layout, giving the room up: %s", room, engine_id, exc)
            try:
                owners = await self._owners.refused(engine_id, Deadline.after(self.timeouts.lookup))
            except PdkvError as lost:
                logger.info("room %d: could not give it up on %s: %s", room, engine_id, lost)
                raise exc from None
            with request_context(engine=engine_id, room=room, consumer=self.consumer_id):
                await self._claims.give_up_all(owners, Claim(room), set(owners))
            raise

    async def claim(
        self,
        engine_id: str,
        room: int,
        *,
        deadline: Deadline | None = None,
        timeout: float | None = None,
        readers: int = 1,
    ) -> RoomLease:
        """Claim `room` on every owner (waiting for it to be published) and hold the claim.

        The source pages stay pinned until `RoomLease.release()` (or the owners' pin
        deadline): the lease may read the room any number of times meanwhile. Claimed
        ahead (before the destination pages are known), a read then costs no claim.
        `readers`: as for `fetch`.
        """
        limit = budget(self.timeouts.fetch, deadline, timeout)
        with self._activity.call():
            cached = self._owners.cached.get(engine_id, {})
            if self._ctx.feed.take_lost(o.rank.control_url for o in cached.values()):
                await self._owners.forget(engine_id)  # out of reach since: its connections may have failed
            owners = await self._lookup(engine_id, room, limit)
            claim = Claim(room, readers)
            try:
                await self._claims.claim_all(owners, claim, limit)
                for o in owners.values():  # the room's later states are pushed to this claim holder
                    self._ctx.feed.want(o.rank.control_url, room)
                return RoomLease(self._ctx, self._activity, self._claims, self._tickets, engine_id, owners, claim)
            except BaseException:
                for o in owners.values():
                    self._ctx.feed.forget(o.rank.control_url, room)
                await self._claims.give_up_all(owners, claim)
                raise
