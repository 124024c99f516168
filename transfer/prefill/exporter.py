"""The prefill side: one exporter per CP rank.

It registers only the rank's owned KV buffers (and its pin table) with UCX, publishes a
`RankDescriptor` to the registry and keeps renewing it, serves decodes' control requests
(readiness long-polls, releases), keeps each room's source pages pinned until released,
aborted or expired, and keeps its UCX worker progressing (a target is not always passive);
ticket releases arrive there, as UCX notifications.

    POST /v1/rooms/{room}/claim      ClaimRequest -> RoomState, once published (long-poll)
    GET  /v1/events?consumer=C       a stream of RoomState frames for the rooms C claimed
    GET  /v1/rooms/{room}?after=N&after_pages=P&claim=T
                                     RoomState once layers beyond N (or, for a room sent
                                     by chunks, pages beyond P) are ready (long-poll);
                                     with a claim, ClaimLostError if it no longer pins the room
    POST /v1/rooms/{room}/release    ReleaseNotice -> ReleaseReply
    POST /v1/rooms/{room}/abort      free the room now (the router cancelled it)
    GET  /v1/stats                   pinned pages and counters (JSON)
    GET  /health
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import cast

import msgspec
import numpy as np
import torch
from aiohttp import web

from pdkv.errors import MetadataError, PdkvError
from pdkv.layout import BufferKind
from transfer.addresses import advertised_for
from transfer.control import ControlClient, HttpService, health, make_app, path_int, query_int, read_body, reply
from transfer.engine_kv import KVBuffers
from transfer.lanes.cuda_ipc.export import IpcExporter
from transfer.lanes.runs import device_id, mem_type
from transfer.lanes.ucx.nixl import protect_owner_heap
from transfer.lanes.ucx.transport import UcxTransport
from transfer.logctx import request_context
from transfer.metadata import (
    ClaimRelease,
    ClaimRequest,
    LayoutSpec,
    MemoryDescriptor,
    OwnerPin,
    RankDescriptor,
    ReleaseNotice,
    RoomState,
    RoomStatus,
    TicketRelease,
    claim_token,
    consumer_name,
    decode_any,
)
from transfer.metrics import track_exporter, untrack_exporter
from transfer.prefill.pins import PinWords
from transfer.prefill.rooms import OnEnd, RoomTable
from transfer.readiness import HEARTBEAT, STREAM_TYPE, ReadinessHub, frame
from transfer.registry import register_until, registry_client
from transfer.timeouts import Timeouts

__all__ = ["PrefillExporter"]

logger = logging.getLogger(__name__)

INCARNATION_HEX = 12  # an incarnation is this many hex digits (it fits an int64)
PIN_SLOTS = 4096  # rooms a rank can pin with a ticket at once; beyond, rooms are read by claims


def _descriptors(pool: KVBuffers) -> list[MemoryDescriptor]:
    dev = device_id(pool.device)
    out = []
    for kind in (BufferKind.LATENT, BufferKind.INDEX):
        infos = pool.infos(kind)
        for layer, ptr, length, item in zip(infos.layer_ids, infos.data_ptrs, infos.data_lens, infos.item_lens):
            out.append(
                MemoryDescriptor(kind=kind, layer_id=layer, addr=ptr, length=length, item_len=item, device_id=dev)
            )
    return out


class PrefillExporter:
    """Exports one CP rank's owned KV to decodes. Use `async with` or start()/aclose()."""

    def __init__(
        self,
        pool: KVBuffers,
        engine_id: str,
        cp_rank: int,
        cp_size: int,
        registry_url: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        timeouts: Timeouts = Timeouts(),
        secret: str | None = None,
        on_free: Callable[[int, np.ndarray], None] = lambda room, pages: None,
        group_size: int = 1,
    ) -> None:
        """`host`: where the control endpoint listens (loopback by default; the wildcard for
        every interface); `advertise`: the address it registers for decodes, by default `host`
        (a wildcard bind: the address that routes to the registry). Loopback or the wildcard
        is refused (`AddressError`) unless the registry is on loopback too."""
        advertised = advertised_for(host, advertise, registry_url)
        self.pool = pool
        self._group_size = group_size  # engines in its serving group (`RankDescriptor.group_size`)
        self.engine_id, self.cp_rank, self.cp_size = engine_id, cp_rank, cp_size
        self._registry = registry_client(registry_url, timeouts, secret)
        self.timeouts = timeouts
        self.incarnation = uuid.uuid4().hex[:INCARNATION_HEX]
        # Host memory whatever the pool's device: decodes check a word of it after their data.
        self._pins = PinWords(PIN_SLOTS)
        # A reader gone for a heartbeat (its releases had time to land) no longer holds its claims.
        self._readiness = ReadinessHub(lambda consumer: self.rooms.give_up_consumer(consumer), timeouts.heartbeat)
        self.rooms = RoomTable(pool.owned, pool.layout.num_pages, timeouts.pin, on_free, self._pins.words, self._push)
        self._client = ControlClient(timeouts, secret)
        self._ipc = IpcExporter(secret, timeouts)
        app = make_app(secret, engine=engine_id, rank=cp_rank)
        app.router.add_get("/v1/rooms/{room}", self._wait)
        app.router.add_get("/v1/events", self._events)
        app.router.add_post("/v1/rooms/{room}/claim", self._claim)
        app.router.add_post("/v1/rooms/{room}/release", self._release)
        app.router.add_post("/v1/rooms/{room}/abort", self._abort)
        app.router.add_get("/v1/stats", self._stats)
        app.router.add_get("/health", health)
        app.router.add_get("/ready", self._ready)  # 503 until registered with UCX up (`readiness`)
        self._bind_host = host
        # A stream's heartbeats unacknowledged for three intervals: its reader is out of reach.
        unacked = 3 * timeouts.heartbeat
        self._http = HttpService(app, host, port, advertise=advertised, unacked_timeout=unacked, timeouts=timeouts)
        self.transport: UcxTransport | None = None
        self.descriptor: RankDescriptor | None = None
        self._registered: float | None = None  # when the registry last took this rank (monotonic)
        self._ucx_failing: str | None = None  # why UCX progress last failed, while it fails
        self._tasks: list[asyncio.Task[None]] = []
        self._written: asyncio.Queue[tuple[int, int | None, torch.cuda.Event, Callable[[], None]]] = asyncio.Queue()

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.aclose()
            raise

    async def _start(self) -> None:
        name = f"{self.engine_id}.cp{self.cp_rank}.{self.incarnation}"
        protect_owner_heap(self.pool.device.type, self._bind_host)  # where UCX may serve it over TCP
        self.transport = UcxTransport(name, workers=1, mem_type=mem_type(self.pool.device), timeouts=self.timeouts)
        # The owned slab is the owned layers' buffers and the alignment padding between them
        # (never written): nothing else is exposed.
        self.transport.register([*self.pool.registered_buffers(), self._pins.tensor])
        url = await self._http.start()
        layout = self.pool.layout
        self.descriptor = RankDescriptor(
            engine_id=self.engine_id,
            cp_rank=self.cp_rank,
            cp_size=self.cp_size,
            layer_start=self.pool.owned.start,
            layer_end=self.pool.owned.stop,
            fingerprint=layout.fingerprint,
            layout=LayoutSpec.of(layout),
            buffers=_descriptors(self.pool),
            agent_name=self.transport.agent_name,
            agent_metadata=self.transport.agent_metadata(),
            control_url=url,
            incarnation=self.incarnation,
            ipc=await self._ipc.start(self.pool),
            pins=self._pins.wire(),
            group_size=self._group_size,
        )
        await register_until(
            self._registry, self.descriptor, time.monotonic() + self.timeouts.lookup, self.timeouts.retry_pause
        )
        self._registered = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._renew_forever()),
            asyncio.create_task(self._progress_forever()),
            asyncio.create_task(self._expire_forever()),
            asyncio.create_task(self._ready_after_writes()),
        ]
        track_exporter(self)
        logger.info("exporter %s/cp%d serving layers %s on %s", self.engine_id, self.cp_rank, self.pool.owned, url)

    async def aclose(self) -> None:
        self._pins.clear()  # from now on no read proves itself by a word of this owner
        untrack_exporter(self)
        self._readiness.close()  # event streams end before the HTTP server stops
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(PdkvError):
            await self._registry.leave(self.engine_id, self.cp_rank)
        await self._registry.aclose()
        await self._client.aclose()
        await self._http.aclose()
        if self.transport is not None:
            await self.transport.aclose()
            self.transport = None
        await self._ipc.aclose()
        self._pins.close()

    async def __aenter__(self) -> PrefillExporter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def control_url(self) -> str:
        return self._http.url

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): ready while the registry holds this rank (registered, its lease
        renewed within `Timeouts.lease`) and its UCX transport is up and progressing. `/health`
        says only that the process answers; this says whether decodes can find and read it."""
        if self.transport is None:
            return False, "the UCX transport is not up"
        if self._ucx_failing is not None:
            return False, f"UCX progress fails: {self._ucx_failing}"
        if self._registered is None:
            return False, "not registered with the registry"
        since = time.monotonic() - self._registered
        if since > self.timeouts.lease:
            return False, f"the registry has not taken a renewal for {since:.1f}s (its lease lapsed)"
        return True, "registered, UCX up"

    async def _ready(self, request: web.Request) -> web.Response:
        ready, why = self.readiness()
        body = {"status": "ready" if ready else "not ready", "why": why}
        return web.json_response(body, status=200 if ready else 503)

    # ---- the model side ----------------------------------------------------------------------
    # A publication id (what publish_* return) names one publication of a room id: calls
    # that pass it act on that publication only, never on another of the same room id.
    def publish_room(self, room: int, src_pages: np.ndarray, consumers: int = 1, on_end: OnEnd | None = None) -> int:
        """`room`'s KV will be in `src_pages`; pin them until released or expired. Returns
        the publication's id; `on_end(status, reason)` runs (on this loop) as it ends."""
        return self.rooms.publish(room, src_pages, consumers, on_end)

    def mark_ready(
        self, room: int, upto_layer: int, written: torch.cuda.Event | None = None, pub: int | None = None
    ) -> None:
        """Owned layers below `upto_layer` (global id) of `room` are written.

        On a GPU the writes were only queued: the layers become readable for decodes once
        `written` (by default an event recorded now on the current stream) has completed.
        """
        self._after_writes(room, pub, lambda: self.rooms.mark_ready(room, upto_layer, pub), written)

    def publish_chunked(self, room: int, total_pages: int, consumers: int = 1, on_end: OnEnd | None = None) -> int:
        """`room` arrives in chunks of pages (a chunked prefill), `total_pages` in all;
        returns the publication's id, as `publish_room`."""
        return self.rooms.publish_chunked(room, total_pages, consumers, on_end)

    def add_chunk(
        self,
        room: int,
        pages: np.ndarray,
        written: torch.cuda.Event | None = None,
        aux: bytes | None = None,
        pub: int | None = None,
    ) -> None:
        """The next chunk of `room`: `pages`, written in every owned layer (on a GPU, as
        for `mark_ready`, readable once `written` has completed). `aux`: the request's
        auxiliary bytes (an engine's first output token and the like), with the last chunk;
        decodes get them with the room (`FetchResult.aux`)."""
        chunk = np.array(pages, copy=True)
        self._after_writes(room, pub, lambda: self.rooms.add_chunk(room, chunk, aux, pub), written)

    def _after_writes(
        self, room: int, pub: int | None, publish: Callable[[], None], written: torch.cuda.Event | None
    ) -> None:
        """`publish` now on the host; on a GPU once the writes queued before have landed."""
        if self.pool.device.type != "cuda":
            publish()  # refusals (a bad chunk) reach the caller
            return
        if written is None:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.pool.device))
        self._written.put_nowait((room, pub, written, publish))

    async def _ready_after_writes(self) -> None:
        """Publish GPU layers as their writes complete, in the order they were queued."""
        while True:
            room, pub, written, publish = await self._written.get()
            if not written.query():
                await asyncio.to_thread(written.synchronize)
            try:
                publish()
            except PdkvError as exc:  # refused after the caller returned: its decodes see the room aborted
                logger.error("room %d aborted: readiness after its writes refused: %s", room, exc)
                self.rooms.abort(room, pub, exc)

    def abort_room(self, room: int, pub: int | None = None, reason: PdkvError | None = None) -> bool:
        """Free `room` now (only its publication `pub`, where given); its decodes fail, told
        `reason` where given. False if it was not live."""
        return self.rooms.abort(room, pub, reason)

    async def pin(self, room: int, timeout: float) -> OwnerPin | None:
        """This rank's part of `room`'s ticket, once every owned layer is readable.

        None if the room has no pin slot or died meanwhile: its decode reads by claims.
        """
        got = await self.rooms.pin(room, timeout)
        if got is None:
            return None
        slot, nonce = got
        return OwnerPin(cp_rank=self.cp_rank, incarnation=self.incarnation, slot=slot, nonce=nonce)

    # ---- registry ----------------------------------------------------------------------------
    async def _renew_forever(self) -> None:
        pause = self.timeouts.renew_interval
        while True:
            await asyncio.sleep(pause)
            try:
                assert self.descriptor is not None
                await register_until(
                    self._registry,
                    self.descriptor,
                    time.monotonic() + self.timeouts.renew_interval,
                    self.timeouts.retry_pause,
                )
                pause = self.timeouts.renew_interval
                self._registered = time.monotonic()
            except PdkvError as exc:  # the registry may be restarting: keep trying at register_until's pace
                logger.warning("lease renewal failed: %s", exc)
                pause = 0.0

    async def _progress_forever(self) -> None:
        assert self.transport is not None
        while True:
            try:
                arrived = await self.transport.progress()
                self._ucx_failing = None
            except Exception as exc:  # a target must keep progressing: log and go on, never die silently
                logger.error("UCX progress failed: %s", exc)
                self._ucx_failing, arrived = str(exc) or type(exc).__name__, {}
            for peer, messages in arrived.items():
                for message in messages:
                    self._on_notification(peer, message)
            busy = self.rooms.tickets_out > 0
            await asyncio.sleep(self.timeouts.ticket_progress_interval if busy else self.timeouts.progress_interval)

    def _on_notification(self, peer: str, message: bytes) -> None:
        try:
            kinds = (TicketRelease, ClaimRelease)  # decoded as one of them; mypy infers only their base
            notice = cast("TicketRelease | ClaimRelease", decode_any(message, kinds, self.pool.layout.fingerprint))
        except PdkvError as exc:
            logger.warning("dropping a malformed notification from %s: %s", peer, exc)
            return
        with self._about(notice.room):
            if isinstance(notice, TicketRelease):
                self.rooms.release_ticket(notice.room, notice.slot, notice.nonce)
                return
            try:
                self.rooms.release(notice.room, notice.claim)
            except PdkvError as exc:  # its reader proved its bytes by the pin word: nothing to answer
                # Mostly a copy sent again before the reader saw the first take (`Releases`).
                logger.debug("a claim release that pins nothing: %s", exc)

    def _about(self, room: int) -> contextlib.AbstractContextManager[None]:
        """Log lines inside name this engine, rank and `room`."""
        return request_context(engine=self.engine_id, rank=self.cp_rank, room=room)

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.timeouts.pin / 4))
            with request_context(engine=self.engine_id, rank=self.cp_rank):  # an expiry's line names them
                self.rooms.expire(time.monotonic())

    # ---- control endpoints -------------------------------------------------------------------
    async def _wait(self, request: web.Request) -> web.Response:
        room = path_int(request, "room")
        after = query_int(request, "after", -1, lo=-1, hi=2**31 - 1)
        after_pages = query_int(request, "after_pages", -1, lo=-1, hi=2**31 - 1)
        claim = request.query.get("claim")
        if claim is not None:
            claim = claim_token(claim)
        state = await self.rooms.wait(room, after, self.timeouts.poll, after_pages)
        if claim is not None:
            self.rooms.check_claim(room, claim)
            state = self._with_pin(state)  # a claim holder's, as its pushed states are
        return reply(state, self.pool.layout.fingerprint)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """The consumer's readiness stream: its claimed rooms now, then every move."""
        consumer = consumer_name(request.query.get("consumer", ""))
        fp = self.pool.layout.fingerprint
        sub = self._readiness.subscribe(consumer)
        resp = web.StreamResponse(headers={"Content-Type": STREAM_TYPE})
        try:
            await resp.prepare(request)
            for claimed in map(self._with_pin, self.rooms.claimed_by(consumer)):
                await resp.write(frame(claimed, fp))
            await resp.write(HEARTBEAT)  # the consumer knows the stream is up
            while not sub.closed.is_set():
                state = await sub.next(self.timeouts.heartbeat)
                await resp.write(HEARTBEAT if state is None else frame(state, fp))
        except ConnectionResetError:  # the consumer went away; it reconnects or polls
            logger.debug("readiness stream to %s closed by the peer", consumer)
        finally:
            self._readiness.unsubscribe(consumer, sub)
        return resp

    async def _claim(self, request: web.Request) -> web.Response:
        room = path_int(request, "room")
        ask = await read_body(request, ClaimRequest, self.pool.layout.fingerprint)
        if ask.room != room:
            raise MetadataError(f"claim names room {ask.room}, path names {room}")
        await self.rooms.wait(room, -1, self.timeouts.poll)  # until it is published
        state = self.rooms.claim(room, ask.claim, ask.consumer_id, ask.readers)
        return reply(self._with_pin(state), self.pool.layout.fingerprint)

    def _with_pin(self, state: RoomState) -> RoomState:
        """`state` as a claim holder gets it: with the room's pin, once it is whole, so the
        holder may prove its read by the pin word and release by notification, as a ticket's."""
        pin = self.rooms.pin_of(state.room) if state.status is RoomStatus.READY else None
        if pin is None:
            return state
        owner = OwnerPin(cp_rank=self.cp_rank, incarnation=self.incarnation, slot=pin[0], nonce=pin[1])
        return msgspec.structs.replace(state, pin=owner)

    def _push(self, state: RoomState, consumers: set[str]) -> None:
        self._readiness.publish(self._with_pin(state), consumers)

    async def _release(self, request: web.Request) -> web.Response:
        room = path_int(request, "room")
        notice = await read_body(request, ReleaseNotice, self.pool.layout.fingerprint)
        if notice.room != room:
            raise MetadataError(f"release names room {notice.room}, path names {room}")
        with self._about(room):
            answer = self.rooms.give_up(room, notice.claim) if notice.abort else self.rooms.release(room, notice.claim)
        return reply(answer, self.pool.layout.fingerprint)

    async def _abort(self, request: web.Request) -> web.Response:
        self.abort_room(path_int(request, "room"))
        return web.Response(status=200)

    def room_metrics(self) -> dict[str, int]:
        """What `/metrics` and `/v1/stats` report of the rooms."""
        c = self.rooms.counters
        return {
            "pinned_pages": self.rooms.pinned_pages,
            "live_rooms": self.rooms.live_rooms,
            "tickets_out": self.rooms.tickets_out,
            "published": c.published,
            "released": c.released,
            "aborted": c.aborted,
            "expired": c.expired,
        }

    async def _stats(self, request: web.Request) -> web.Response:
        registered = self.transport.local_regions.total if self.transport else 0
        return web.json_response({**self.room_metrics(), "registered_bytes": registered})
