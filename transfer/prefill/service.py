"""What decodes ask of a prefill rank: its HTTP routes and its release notifications.

    POST /v1/rooms/{room}/claim      ClaimRequest -> RoomState, once published (long-poll)
    GET  /v1/claims                  a channel (`transfer.control.serve_channel`) of calls
                                     ClaimAll -> ClaimAllReply: a claim here (as POST .../claim)
                                     and, asked of the arbiter (the lowest CP rank), relayed to
                                     the other ranks it names (`transfer.prefill.peers`), or
                                     answered by the claims they hold for it;
                                     HeldClaim -> HeldReply: a higher rank holds one for it
                                     (`transfer.prefill.held`); ReturnHeld -> HeldReply:
                                     the arbiter will not hand out the one held here
    GET  /v1/events?consumer=C       a stream of RoomState frames for the rooms C claimed
    GET  /v1/rooms/{room}?after=N&after_pages=P&claim=T
                                     RoomState once layers beyond N (or, for a room sent
                                     by chunks, pages beyond P) are ready (long-poll);
                                     with a claim, ClaimLostError if it no longer pins the room
    POST /v1/rooms/{room}/release    ReleaseNotice -> ReleaseReply
    POST /v1/rooms/{room}/abort      free the room now (the router cancelled it)
    GET  /v1/stats                   pinned pages and counters (JSON)
    GET  /ready                      200 once decodes can find and read this rank, else 503
    GET  /health

Releases also arrive as UCX notifications (`on_notification`): a ticket's, and a claim
holder's that proved its read by the pin word; so does a claim holder's `ReadFrom` (its
decode holds the room's first pages: they are freed once no reader will read them).
Every answer is about the rank's rooms (`RoomTable`); the exporter
(`transfer.prefill.exporter`) owns this service and its rooms.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import cast

import msgspec
from aiohttp import web

from pdkv.errors import MetadataError, NotReadyError, PdkvError
from transfer.control import health, path_int, query_int, read_body, reply, serve_channel
from transfer.deadline import Deadline
from transfer.logctx import request_context
from transfer.metadata import (
    ClaimAll,
    ClaimAllReply,
    ClaimRelease,
    ClaimRequest,
    HeldClaim,
    HeldReply,
    OwnerClaim,
    OwnerPin,
    OwnerRef,
    ReadFrom,
    ReleaseNotice,
    ReturnHeld,
    RoomState,
    RoomStatus,
    TicketRelease,
    claim_token,
    consumer_name,
    decode_any,
    encode,
)
from transfer.prefill.held import HeldClaims
from transfer.prefill.rooms import HELD, RoomTable
from transfer.readiness import HEARTBEAT, STREAM_TYPE, ReadinessHub, frame
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, str]]
"""(ready, why): whether decodes can find and read this rank (`PrefillExporter.readiness`)."""
Stats = Callable[[], dict[str, int]]
"""What `/v1/stats` reports (the rooms' counters and the registered bytes)."""
Relay = Callable[[ClaimRequest, list[OwnerRef], Deadline], Awaitable[list[OwnerClaim]]]
"""A claim relayed to the engine's other ranks, each one's answer (`Peers.relay`)."""
GiveBack = Callable[[int, list[HeldClaim]], None]
"""Claims held for this rank, as the arbiter, that it will not hand out: back to their ranks
(`Peers.return_held`, in the background)."""


class PrefillService:
    """The routes of one CP rank's control endpoint, over its rooms and readiness streams.

    `cp_rank` and `incarnation` name the rank in the pins it hands out (`OwnerPin`).
    """

    def __init__(
        self,
        rooms: RoomTable,
        hub: ReadinessHub,
        fingerprint: str,
        timeouts: Timeouts,
        *,
        cp_rank: int,
        incarnation: str,
        engine_id: str,
        relay: Relay | None = None,
        give_back: GiveBack = lambda room, held: None,
    ) -> None:
        """`relay`: how this rank, as its engine's arbiter, relays a claim to the other
        ranks (`ClaimAll`); None: it refuses such requests (`NotReadyError`)."""
        self.rooms, self._hub, self._fp, self._timeouts = rooms, hub, fingerprint, timeouts
        self._cp_rank, self._incarnation, self._engine_id = cp_rank, incarnation, engine_id
        self._relay, self._give_back = relay, give_back
        self.held = HeldClaims(timeouts.pin)  # as the arbiter: the claims the other ranks hold for it
        self._channels: set[web.WebSocketResponse] = set()

    def add_routes(self, app: web.Application, readiness: Readiness, stats: Stats) -> None:
        """Serve the routes above on `app`; `/ready` answers `readiness()`, `/v1/stats` `stats()`."""

        async def ready(request: web.Request) -> web.Response:
            is_ready, why = readiness()
            body = {"status": "ready" if is_ready else "not ready", "why": why}
            return web.json_response(body, status=200 if is_ready else 503)

        async def stats_route(request: web.Request) -> web.Response:
            return web.json_response(stats())

        app.router.add_get("/v1/rooms/{room}", self._wait)
        app.router.add_get("/v1/events", self._events)
        app.router.add_post("/v1/rooms/{room}/claim", self._claim)
        app.router.add_get("/v1/claims", self._channel)
        app.router.add_post("/v1/rooms/{room}/release", self._release)
        app.router.add_post("/v1/rooms/{room}/abort", self._abort)
        app.router.add_get("/v1/stats", stats_route)
        app.router.add_get("/health", health)
        app.router.add_get("/ready", ready)  # 503 until registered with UCX up (`readiness`)

    def owner_pin(self, slot: int, nonce: int) -> OwnerPin:
        """This rank's pin for a room that holds `slot` with `nonce`."""
        return OwnerPin(cp_rank=self._cp_rank, incarnation=self._incarnation, slot=slot, nonce=nonce)

    def with_pin(self, state: RoomState) -> RoomState:
        """`state` as a claim holder gets it: with the room's pin, once it is whole, so the
        holder may prove its read by the pin word and release by notification, as a ticket's."""
        pin = self.rooms.pin_of(state.room) if state.status is RoomStatus.READY else None
        if pin is None:
            return state
        return msgspec.structs.replace(state, pin=self.owner_pin(*pin))

    def push(self, state: RoomState, consumers: set[str]) -> None:
        """A room moved: tell the readiness streams of `consumers`; every stream where one of
        them holds a claim the arbiter may have handed out (its holder is not known here: a
        decode keeps only the rooms it reads)."""
        self._hub.publish(self.with_pin(state), self._hub.consumers if HELD in consumers else consumers)

    def on_notification(self, peer: str, message: bytes) -> None:
        """A UCX notification: a release (a ticket's, or a claim's), or where a claim holder's
        read starts (`ReadFrom`)."""
        try:
            kinds = (TicketRelease, ClaimRelease, ReadFrom)  # as one of them; mypy infers only their base
            notice = cast("TicketRelease | ClaimRelease | ReadFrom", decode_any(message, kinds, self._fp))
        except PdkvError as exc:
            logger.warning("dropping a malformed notification from %s: %s", peer, exc)
            return
        with self.about(notice.room):
            if isinstance(notice, TicketRelease):
                self.rooms.release_ticket(notice.room, notice.slot, notice.nonce)
                return
            if isinstance(notice, ReadFrom):
                try:
                    self.rooms.read_from(notice.room, notice.claim, notice.start)
                except PdkvError as exc:  # the room ended first, or a bad start: its pin stays as it is
                    logger.debug("a read start that narrows nothing: %s", exc)
                return
            try:
                self.rooms.release(notice.room, notice.claim)
            except PdkvError as exc:  # its reader proved its bytes by the pin word: nothing to answer
                # Mostly a copy sent again before the reader saw the first take (`Releases`).
                logger.debug("a claim release that pins nothing: %s", exc)

    def about(self, room: int) -> contextlib.AbstractContextManager[None]:
        """Log lines inside name this engine, rank and `room`."""
        return request_context(engine=self._engine_id, rank=self._cp_rank, room=room)

    # ---- routes ------------------------------------------------------------------------------
    async def _wait(self, request: web.Request) -> web.Response:
        room = path_int(request, "room")
        after = query_int(request, "after", -1, lo=-1, hi=2**31 - 1)
        after_pages = query_int(request, "after_pages", -1, lo=-1, hi=2**31 - 1)
        claim = request.query.get("claim")
        if claim is not None:
            claim = claim_token(claim)
        state = await self.rooms.wait(room, after, self._timeouts.poll, after_pages)
        if claim is not None:
            self.rooms.check_claim(room, claim)
            state = self.with_pin(state)  # a claim holder's, as its pushed states are
        return reply(state, self._fp)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """The consumer's readiness stream: its claimed rooms now, then every move."""
        consumer = consumer_name(request.query.get("consumer", ""))
        sub = self._hub.subscribe(consumer)
        resp = web.StreamResponse(headers={"Content-Type": STREAM_TYPE})
        try:
            await resp.prepare(request)
            for claimed in map(self.with_pin, self.rooms.claimed_by(consumer)):
                await resp.write(frame(claimed, self._fp))
            await resp.write(HEARTBEAT)  # the consumer knows the stream is up
            while not sub.closed.is_set():
                state = await sub.next(self._timeouts.heartbeat)
                await resp.write(HEARTBEAT if state is None else frame(state, self._fp))
        except ConnectionResetError:  # the consumer went away; it reconnects or polls
            logger.debug("readiness stream to %s closed by the peer", consumer)
        finally:
            self._hub.unsubscribe(consumer, sub)
        return resp

    async def _claim(self, request: web.Request) -> web.Response:
        room = path_int(request, "room")
        ask = await read_body(request, ClaimRequest, self._fp)
        if ask.room != room:
            raise MetadataError(f"claim names room {ask.room}, path names {room}")
        await self.rooms.wait(room, -1, self._timeouts.poll)  # until it is published
        state = self.rooms.claim(room, ask.claim, ask.consumer_id, ask.readers)
        return reply(self.with_pin(state), self._fp)

    async def _channel(self, request: web.Request) -> web.StreamResponse:
        return await serve_channel(request, self._call, self._channels)

    def _call(self, data: bytes) -> bytes | Awaitable[bytes]:
        """A call on the claim channel: answered at once, or (a claim that waits for its room,
        or is relayed) an awaitable of the answer."""
        kinds = (ClaimAll, HeldClaim, ReturnHeld)  # as one of them; mypy infers only their base
        asked = cast("ClaimAll | HeldClaim | ReturnHeld", decode_any(data, kinds, self._fp))
        if isinstance(asked, HeldClaim):
            return self._keep(asked)
        if isinstance(asked, ReturnHeld):
            with self.about(asked.room):
                dropped = self.rooms.drop_held(asked.room, asked.claim, ended=True)
            return encode(HeldReply(room=asked.room, kept=dropped), self._fp)
        return self._claim_all(asked)

    def _keep(self, held: HeldClaim) -> bytes:
        """A higher rank holds a claim of a whole room for this rank to hand out: kept unless
        this rank's room was claimed or ended first (then the rank drops it)."""
        if held.cp_rank <= self._cp_rank:
            raise MetadataError(f"cp rank {self._cp_rank} keeps claims held by higher ranks only, not {held.cp_rank}")
        room = held.state.room
        if self._cp_rank != 0:  # not the arbiter (rank 0 was not registered when it was looked up)
            return encode(HeldReply(room=room, kept=False), self._fp)
        ended = self.rooms.state(room).status in (RoomStatus.RELEASED, RoomStatus.ABORTED)
        usable = self.rooms.granted(room) <= 0 and not ended
        kept, replaced = (False, None) if not usable or self._relay is None else self.held.keep(held)
        if replaced is not None:
            self._give_back(room, [replaced])
        return encode(HeldReply(room=room, kept=kept, ended=ended), self._fp)

    def _claim_all(self, asked: ClaimAll) -> bytes | Awaitable[bytes]:
        """A claim here, then on every other rank the call names: one call for the decode.

        Granted here first: a claimant refused here (another won the room) is refused before
        any other rank is asked, so of two racing for a room one holds it everywhere. Every
        claimant asks the same rank first (the lowest), so a rank refuses to arbitrate for a
        lower one. The room's first claimant, where every other rank holds a claim for this
        one, gets those: no relay (`transfer.prefill.held`), and the answer is made at once."""
        ranks = [o.cp_rank for o in asked.others]
        if len(set(ranks)) != len(ranks) or any(r <= self._cp_rank for r in ranks):
            raise MetadataError(f"cp rank {self._cp_rank} arbitrates only for distinct higher ranks, asked {ranks}")
        if self._relay is None and asked.others:
            raise NotReadyError(f"cp rank {self._cp_rank} relays no claims")
        deadline = Deadline.from_wire(asked.budget_ms)
        deadline.left()  # a budget spent on the way: refused before anything is granted
        if not self.rooms.moved(asked.ask.room, -1):
            return self._claim_all_published(asked, deadline)
        return self._grant(asked, deadline)

    async def _claim_all_published(self, asked: ClaimAll, deadline: Deadline) -> bytes:
        """`_claim_all` once the room is published here (or, still unpublished after the call's
        budget or `Timeouts.poll`, whichever is shorter, answered UNKNOWN: the decode asks again)."""
        await self.rooms.wait(asked.ask.room, -1, deadline.left(self._timeouts.poll))
        answer = self._grant(asked, deadline)
        return answer if isinstance(answer, bytes) else await answer

    def _grant(self, asked: ClaimAll, deadline: Deadline) -> bytes | Awaitable[bytes]:
        """Grant the claim here; the answer, with the other ranks' claims held for the room's
        first claimant if it is that (a group's size must reach every rank: a group is
        relayed), else an awaitable of it once the claim is relayed to them."""
        ask, room = asked.ask, asked.ask.room
        with self.about(room):
            first = self.rooms.granted(room) == 0
            state = self.rooms.claim(room, ask.claim, ask.consumer_id, ask.readers)
            relayed: list[OwnerClaim] | None = None
            if first and ask.readers == 1 and state.status is RoomStatus.READY and asked.others:
                relayed = self.held.hand_out(room, asked.others, state.src_pages, ask.claim)
        if relayed is None and state.status is not RoomStatus.UNKNOWN and asked.others:
            return self._relayed(asked, state, deadline)
        return encode(ClaimAllReply(arbiter=self.with_pin(state), others=relayed or []), self._fp)

    async def _relayed(self, asked: ClaimAll, state: RoomState, deadline: Deadline) -> bytes:
        """The answer once the claim granted here (`state`) was relayed to the other ranks."""
        assert self._relay is not None  # checked before anything was granted
        with self.about(asked.ask.room):
            relayed = await self._relay(asked.ask, list(asked.others), deadline)
        return encode(ClaimAllReply(arbiter=self.with_pin(state), others=relayed), self._fp)

    def room_ended(self, room: int) -> None:
        """`room` ended here: the claims held for it go back, those handed to a claimant too
        where nobody read it here (the claimant's answer was lost, or it is gone)."""
        unread = self.rooms.state(room).status is RoomStatus.ABORTED
        returned = self.held.pop(room, unread)
        if returned:
            self._give_back(room, returned)

    def claim_given_up(self, room: int, token: str) -> None:
        """Claim `token` of `room` ended unread here: the held claims handed to it go back."""
        returned = self.held.given_up(room, token)
        if returned:
            self._give_back(room, returned)

    async def close(self) -> None:
        """End the open channels (a closing service must not wait for their peers)."""
        for ws in list(self._channels):
            await ws.close()

    async def _release(self, request: web.Request) -> web.Response:
        room = path_int(request, "room")
        notice = await read_body(request, ReleaseNotice, self._fp)
        if notice.room != room:
            raise MetadataError(f"release names room {notice.room}, path names {room}")
        with self.about(room):
            end = self.rooms.give_up if notice.give_up else self.rooms.release
            answer = end(room, notice.claim)
        return reply(answer, self._fp)

    async def _abort(self, request: web.Request) -> web.Response:
        self.rooms.abort(path_int(request, "room"))
        return web.Response(status=200)
