"""The prefill side: one exporter per CP rank.

It registers only the rank's owned KV buffers (and its pin table) with UCX, publishes a
`RankDescriptor` to the registry and keeps renewing it, keeps each room's source pages
pinned until released, aborted or expired (`transfer.prefill.rooms`), and keeps its UCX
worker progressing (a target is not always passive): ticket releases arrive there, as UCX
notifications. What decodes ask of it (claims, readiness, releases) is its service's
(`transfer.prefill.service`); the model's side (publish, mark ready, chunks, pins) is here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
import numpy as np
import torch

from pdkv.errors import PdkvError
from pdkv.layout import BufferKind
from transfer.addresses import advertised_for
from transfer.control import HttpService, make_app
from transfer.deadline import Deadline, raise_if_cancelled
from transfer.engine_kv import KVBuffers
from transfer.lanes.cuda_ipc.export import IpcExporter
from transfer.lanes.runs import device_id, mem_type
from transfer.lanes.ucx.nixl import heap_guard_reason, protect_owner_heap
from transfer.lanes.ucx.transport import UcxTransport
from transfer.logctx import request_context
from transfer.metadata import (
    HeldClaim,
    LayoutSpec,
    MemoryDescriptor,
    OwnerPin,
    RankDescriptor,
    RoomState,
)
from transfer.metrics import track_exporter, untrack_exporter
from transfer.prefill.held import pages_digest
from transfer.prefill.peers import Peers
from transfer.prefill.pins import PinWords
from transfer.prefill.rooms import OnEnd, RoomTable
from transfer.prefill.service import PrefillService
from transfer.readiness import ReadinessHub
from transfer.registry import register_until, registry_client
from transfer.timeouts import Timeouts

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
        hold_claims: bool = True,
    ) -> None:
        """`host`: where the control endpoint listens (loopback by default; the wildcard for
        every interface); `advertise`: the address it registers for decodes, by default `host`
        (a wildcard bind: the address that routes to the registry). Loopback or the wildcard
        is refused (`AddressError`) unless the registry is on loopback too. `on_free(room,
        pages)`: pages no decode will read any more, each page once: a room's pages as it ends,
        and, where every reader holds its first pages (a decode's prefix), those ahead of its
        end (`RoomTable.read_from`); a room's end is its publication's `on_end`. `hold_claims`:
        a rank above the arbiter holds one claim of each whole room for the arbiter to hand
        out, so that the room's first claimant needs no relay (`transfer.prefill.held`)."""
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
        self.rooms = RoomTable(
            pool.owned,
            pool.layout.num_pages,
            timeouts.pin,
            on_free,
            self._pins.words,
            self._pushed,
            self._ended,
            lambda room, token: self._service.claim_given_up(room, token),
        )
        self._ipc = IpcExporter(secret, timeouts)
        # As its engine's arbiter (the lowest rank) it relays decodes' claims to the other ranks.
        self._peers = Peers(self._registry, engine_id, cp_rank, pool.layout.fingerprint, timeouts, secret)
        self._service = PrefillService(
            self.rooms,
            self._readiness,
            pool.layout.fingerprint,
            timeouts,
            cp_rank=cp_rank,
            incarnation=self.incarnation,
            engine_id=engine_id,
            relay=self._peers.relay,
            give_back=self._give_back,
        )
        app = make_app(secret, engine=engine_id, rank=cp_rank)
        self._service.add_routes(app, self.readiness, self._stats)
        self._bind_host = host
        # A stream's heartbeats unacknowledged for three intervals: its reader is out of reach.
        unacked = 3 * timeouts.heartbeat
        self._http = HttpService(app, host, port, advertise=advertised, unacked_timeout=unacked, timeouts=timeouts)
        self.transport: UcxTransport | None = None
        self.descriptor: RankDescriptor | None = None
        self._registered: float | None = None  # when the registry last took this rank (monotonic)
        self._ucx_failing: str | None = None  # why UCX progress last failed, while it fails
        self._over_tcp = False  # UCX may answer this owner's READs over TCP (set at start)
        self._tasks: list[asyncio.Task[None]] = []
        self._holds = hold_claims and cp_size > 1  # rooms published to hold get no ticket, on every rank
        self._hold_claims = self._holds and cp_rank > 0
        self._holding: set[asyncio.Task[None]] = set()  # held claims on their way to and from the arbiter
        self._closing = False
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
        self._over_tcp = heap_guard_reason(self.pool.device.type, self._bind_host) is not None
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
            self._registry, self.descriptor, Deadline.after(self.timeouts.lookup), self.timeouts.retry_pause
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
        self._closing = True  # no held claim is sent or returned from here
        untrack_exporter(self)
        self._readiness.close()  # event streams end before the HTTP server stops
        await self._service.close()  # and claim channels
        for t in [*self._tasks, *self._holding]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._holding, return_exceptions=True)
        self._tasks = []
        with contextlib.suppress(PdkvError):
            await self._registry.leave(self.engine_id, self.cp_rank)
        await self._registry.aclose()
        await self._http.aclose()
        await self._peers.aclose()
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

    # ---- the model side ----------------------------------------------------------------------
    # A publication id (what publish_* return) names one publication of a room id: calls
    # that pass it act on that publication only, never on another of the same room id.
    def publish_room(
        self, room: int, src_pages: np.ndarray, consumers: int = 1, on_end: OnEnd | None = None, hold: bool = True
    ) -> int:
        """`room`'s KV will be in `src_pages`; pin them until released or expired. Returns
        the publication's id; `on_end(status, reason)` runs (on this loop) as it ends.
        `hold`: the engine's ranks hold a claim of it for the arbiter (`transfer.prefill.held`,
        where the exporter holds claims); False for a room whose ticket will be issued (`pin`
        gives none for a room published to hold, on every rank alike)."""
        return self.rooms.publish(room, src_pages, consumers, on_end, hold and self._holds)

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
            self._hold(room)
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
            else:
                self._hold(room)

    def _hold(self, room: int) -> None:
        """Where `room` is now whole here and has a claim free, hold one for the arbiter to
        hand out (`transfer.prefill.held`)."""
        if not self._hold_claims or (token := self.rooms.hold(room)) is None:
            return
        state = self._service.with_pin(self.rooms.state(room))
        state = msgspec.structs.replace(state, src_pages=[])  # named by their digest
        pages = pages_digest(self.rooms.pages_of(room))
        held = HeldClaim(cp_rank=self.cp_rank, incarnation=self.incarnation, claim=token, state=state, pages=pages)
        self._background(self._tell_arbiter(held))

    async def _tell_arbiter(self, held: HeldClaim) -> None:
        reply = await self._peers.hold(held, Deadline.after(self.timeouts.request))
        if reply is not None and not reply.kept:  # the arbiter will not hand it out
            self.rooms.drop_held(held.state.room, held.claim, reply.ended)

    def _ended(self, room: int) -> None:
        self._service.room_ended(room)

    def _give_back(self, room: int, held: list[HeldClaim]) -> None:
        self._background(self._peers.return_held(room, held, Deadline.after(self.timeouts.request)))

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        if self._closing:
            work.close()
            return
        task = asyncio.create_task(work)
        self._holding.add(task)
        task.add_done_callback(self._holding.discard)

    def abort_room(self, room: int, pub: int | None = None, reason: PdkvError | None = None) -> bool:
        """Free `room` now (only its publication `pub`, where given); its decodes fail, told
        `reason` where given. False if it was not live."""
        return self.rooms.abort(room, pub, reason)

    async def pin(self, room: int, timeout: float) -> OwnerPin | None:
        """This rank's part of `room`'s ticket, once every owned layer is readable.

        None if the room has no pin slot, died meanwhile, or was published to hold claims
        (`publish_room(..., hold=False)` for a room to read by ticket): its decode reads by
        claims.
        """
        got = await self.rooms.pin(room, timeout)
        if got is None:
            return None
        slot, nonce = got
        return self._service.owner_pin(slot, nonce)

    def _pushed(self, state: RoomState, consumers: set[str]) -> None:
        """A room moved (the rooms' callback): its readiness streams hear it."""
        self._service.push(state, consumers)

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
                    Deadline.after(self.timeouts.renew_interval),
                    self.timeouts.retry_pause,
                )
                pause = self.timeouts.renew_interval
                self._registered = time.monotonic()
            except PdkvError as exc:  # the registry may be restarting: keep trying at register_until's pace
                raise_if_cancelled()
                logger.warning("lease renewal failed: %s", exc)
                pause = 0.0

    async def _progress_forever(self) -> None:
        assert self.transport is not None
        idle = self.timeouts.progress_interval
        reading = self.timeouts.reading_progress_interval(self._over_tcp)
        while True:
            every = reading if self.rooms.being_read else idle
            try:
                if every < idle:  # driven on UCX's thread for an idle interval: no loop wake a tick
                    arrived = await self.transport.progress(idle, every)
                else:
                    arrived = await self.transport.progress()
                self._ucx_failing = None
            except Exception as exc:  # a target must keep progressing: log and go on, never die silently
                logger.error("UCX progress failed: %s", exc)
                self._ucx_failing, arrived = str(exc) or type(exc).__name__, {}
            for peer, messages in arrived.items():
                for message in messages:
                    self._service.on_notification(peer, message)
            if every >= idle or self._ucx_failing is not None:
                await asyncio.sleep(max(every, idle))

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.timeouts.pin / 4))
            with request_context(engine=self.engine_id, rank=self.cp_rank):  # an expiry's line names them
                self.rooms.expire(time.monotonic())

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

    def _stats(self) -> dict[str, int]:
        """What `/v1/stats` reports: the rooms' counters, the bytes registered with UCX and,
        as the arbiter, the claimants it answered from claims the other ranks held for it."""
        registered = self.transport.local_regions.total if self.transport else 0
        held = self._service.held
        return {
            **self.room_metrics(),
            "registered_bytes": registered,
            "claims_held": held.kept,
            "claims_handed_out": held.handed_out,
        }
