"""The decode side: fetch a request's full KV from every CP owner into local pages.

    async with DecodeFetcher(pool, registry_url) as fetcher:
        result = await fetcher.fetch(engine_id, room, dst_pages, ticket=ticket)

A fetch looks the engine up (cached) and checks that its owners cover every layer once
and match the local layout. With the room's ticket (a finished room, handed over by its
prefill) it then reads every owner at once and checks each owner's pin word after the
data, asking nobody (`owner_io`). Without one, for all owners concurrently, it claims the
room on each owner, waits for ready layers (pushed on the owner's event stream, or
long-polled while that is down) and reads them with one batched one-sided READ per batch,
so it starts before the prefill has finished; each owner's claim is released as soon as
its layers are read, while other owners may still be read.

The guarantee: a fetch that returns delivered exactly the bytes of its room into
`dst_pages`. A claim pins the room's source pages on its owner; a release succeeds only
while the claim still pins them, so every successful release proves that no page read
under the claim was freed or reused meanwhile. A ticket's pin word is cleared before its
pages are freed, so finding it unchanged after the data proves the same. If any owner refuses the release
(`ClaimLostError`: aborted, expired, forgotten) the fetch raises, whatever it read.
A room published for `consumers` claims grants no more: a duplicate decode or a second
fetch of a single-consumer room is refused with `RoomClaimedError` before anything is read.

To re-read a room (after a check of its own failed, say) a decode holds a lease instead:

    async with await fetcher.claim(engine_id, room) as lease:
        result = await lease.read(dst_pages)    # as often as needed, one claim
    # leaving the block releases: raises ClaimLostError if the pages did not stay pinned
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import numpy as np
import torch

from pdkv.errors import (
    ClaimLostError,
    ClosedError,
    DeadlineExceeded,
    IncompatibleLayoutError,
    PdkvError,
    PeerLostError,
    RoomAbortedError,
    TransferError,
    UnknownRoomError,
)
from pdkv.pages import PageIds, page_ids
from transfer.deadline import Deadline
from transfer.engine_kv import KVBuffers
from transfer.http import ControlClient
from transfer.logctx import request_context
from transfer.metadata import ClaimRelease, EngineDescriptor, OwnerPin, RoomState, RoomStatus, RoomTicket, encode
from transfer.metrics import FETCH_BYTES, FETCH_DESCRIPTORS, FETCH_FAILURES, FETCH_RATE, FETCH_SECONDS, fetching
from transfer.owner_io import Claim, Owner, OwnerIO, lost_peer
from transfer.pin_table import map_pins
from transfer.plan import buffer_pairs, check_owners, mem_type
from transfer.readiness import ReadinessFeed
from transfer.registry import registry_client
from transfer.results import FetchResult, OwnerStats
from transfer.timeouts import Timeouts
from transfer.ucx import UcxTransport, default_lanes

if TYPE_CHECKING:
    from transfer.gpu_lane import GpuLane

PIN_WINDOW = 2048  # words of an owner's pin table READ around a slot (16 KiB)
PIN_WINDOWS = 64  # such READs in flight at once (reused in turn: a clash can only fail a check)

__all__ = ["DecodeFetcher", "FetchResult", "OwnerStats", "RoomLease"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=msgspec.Struct)


class DecodeFetcher(OwnerIO):
    """Fetches KV of prefill rooms into `pool` over UCX. Many fetches may run at once.

    `lanes` is how many threads post READs (None: `default_lanes`, one a core up to 8,
    4 for a GPU pool); an owner's READ is cut into pieces when lanes outnumber owners.
    `path` picks what moves the bytes: "auto" reads owners on this host's GPUs through the
    same-host GPU lane (CUDA IPC and one gather kernel) and the rest over UCX; "ucx" and
    "cuda_ipc" force one (the latter fails the lookup of an engine it cannot reach so).
    `time_kernels`: the lane times each gather kernel on the GPU, in `OwnerStats.read_seconds`
    (else from its launch to the bytes in place); it costs tens of microseconds a fetch.
    """

    PATHS = ("auto", "ucx", "cuda_ipc")

    def __init__(
        self,
        pool: KVBuffers,
        registry_url: str,
        *,
        consumer_id: str | None = None,
        timeouts: Timeouts = Timeouts(),
        secret: str | None = None,
        lanes: int | None = None,
        merge_runs: bool = True,
        path: str = "auto",
        time_kernels: bool = False,
    ) -> None:
        if path not in self.PATHS:
            raise ValueError(f"path must be one of {self.PATHS}, not {path!r}")
        if path == "cuda_ipc" and pool.device.type != "cuda":
            raise ValueError("the cuda_ipc path needs a decode pool on a GPU")
        self.path = path
        self.time_kernels = time_kernels
        self._gpu: GpuLane | None = None
        if len(pool.owned) != pool.layout.layer_num:
            raise IncompatibleLayoutError("a decode pool must hold every layer")
        self.pool = pool
        self._registry = registry_client(registry_url, timeouts, secret)
        self.consumer_id = consumer_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.timeouts = timeouts
        self.merge_runs = merge_runs
        self._lanes = lanes
        self._client = ControlClient(timeouts, secret)
        self._engines: dict[str, dict[int, Owner]] = {}
        self._lookups: dict[str, asyncio.Task[dict[int, Owner]]] = {}
        self.transport: UcxTransport | None = None
        self._closing = False
        self._owner_tasks: set[asyncio.Future[Any]] = set()
        self._feed = ReadinessFeed(self._client, self.consumer_id, pool.layout.fingerprint, timeouts.heartbeat)
        self._active = 0  # fetches and lease calls in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._pin_windows = torch.zeros((PIN_WINDOWS, PIN_WINDOW), dtype=torch.int64)  # owners' pin words land here
        self._next_window = 0

    async def start(self) -> None:
        mem = mem_type(self.pool.device)
        lanes = self._lanes or default_lanes(mem)
        self.transport = UcxTransport(
            f"{self.consumer_id}.{uuid.uuid4().hex[:8]}",
            lanes=lanes,
            mem_type=mem,
            connect_timeout=self.timeouts.connect,
            notifies=True,  # ticket releases
        )
        self.transport.register([*self.pool.registered_buffers(), self._pin_windows])
        if self.pool.device.type == "cuda" and self.path != "ucx":
            from transfer.gpu_lane import GpuLane  # CUDA and Triton: only where a GPU is

            self._gpu = GpuLane(self.pool.device, time_kernels=self.time_kernels)

    async def aclose(self) -> None:
        """Refuse new fetches, end those in flight with `ClosedError` (their claims released),
        then drop connections and registrations."""
        self._closing = True
        for t in [*self._owner_tasks, *self._lookups.values()]:
            t.cancel()
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeouts.request)
        except asyncio.TimeoutError:
            logger.warning("closing with %d fetches still in flight", self._active)
        await self._feed.aclose()
        await self._registry.aclose()
        await self._client.aclose()
        if self._gpu is not None:
            await self._gpu.aclose()
        if self.transport is not None:
            await self.transport.aclose()
            self.transport = None

    def _check_open(self) -> None:
        if self.transport is None or self._closing:
            state = "closed" if self._closing else "not started"
            raise ClosedError(f"DecodeFetcher {self.consumer_id} is {state}: use `async with` or start()")

    def _enter(self) -> None:
        self._check_open()
        self._active += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    async def __aenter__(self) -> DecodeFetcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- engine lookup -------------------------------------------------------------------------
    async def _lookup(self, engine_id: str, deadline: Deadline) -> dict[int, Owner]:
        """The engine's owners, cached; concurrent fetches share one lookup in flight."""
        cached = self._engines.get(engine_id)
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
            if self._closing and task.cancelled():
                raise ClosedError(f"the DecodeFetcher was closed while looking up {engine_id}") from None
            raise

    async def _resolve(self, engine_id: str) -> dict[int, Owner]:
        owners = await self._describe(engine_id)
        await self._connect(owners)
        self._engines[engine_id] = owners
        return owners

    async def _describe(self, engine_id: str, within: Deadline | None = None) -> dict[int, Owner]:
        """Ask the registry for the engine's owners (waiting until all are in) and check them."""
        deadline = Deadline.after(self.timeouts.lookup) if within is None else within.within(self.timeouts.lookup)
        return self._check_engine(await self._registry.lookup(engine_id, deadline))

    def _check_engine(self, desc: EngineDescriptor) -> dict[int, Owner]:
        check_owners(desc, self.pool)
        return {rank.cp_rank: Owner(rank, buffer_pairs(rank, self.pool)) for rank in desc.ranks}

    async def _connect(self, owners: dict[int, Owner]) -> None:
        assert self.transport is not None
        for o in owners.values():
            if o.rank.pins is not None:
                o.pins = map_pins(o.rank.pins)
            if self._open_ipc(o) and o.rank.pins is None:
                continue  # the lane reads it; tickets (pin tables) also need UCX, for releases
            regions = [(b.addr, b.length) for b in o.rank.buffers]
            if o.rank.pins is not None:
                regions.append((o.rank.pins.addr, o.rank.pins.nbytes))
            try:
                await self.transport.add_peer(o.rank.agent_name, o.rank.agent_metadata, regions)
            except PeerLostError as exc:
                raise lost_peer(o.rank, exc) from exc

    def _open_ipc(self, owner: Owner) -> bool:
        """Map `owner` for the same-host GPU lane if the path allows and it is reachable."""
        if self.path == "ucx":
            return False
        from transfer.gpu_lane import ipc_unreachable

        why = ipc_unreachable(owner.rank, self.pool.device) if self._gpu is not None else "no GPU lane here"
        if why is None:
            assert self._gpu is not None
            try:
                owner.ipc = self._gpu.open(owner.rank, owner.pairs)
                return True
            except TransferError as exc:
                why = str(exc)
        r = owner.rank
        if self.path == "cuda_ipc":
            raise TransferError(f"engine {r.engine_id} cp rank {r.cp_rank}: no same-host GPU lane: {why}")
        logger.info("engine %s cp rank %d over UCX: %s", r.engine_id, r.cp_rank, why)
        return False

    async def forget(self, engine_id: str) -> None:
        """Drop a cached engine and its peers' connections and keys."""
        owners = self._engines.pop(engine_id, None)
        for o in (owners or {}).values():
            if o.pins is not None:
                o.pins.close()
            if o.ipc is not None and self._gpu is not None:
                await self._gpu.close(o.ipc)  # a dead owner's memory is freed only then
            if self.transport is not None:
                await self.transport.remove_peer(o.rank.agent_name)

    # ---- the fetch -----------------------------------------------------------------------------
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
    ) -> FetchResult:
        """Read every layer of `room` from `engine_id`'s owners into `dst_pages`.

        `dst_pages`: distinct integer page ids (a list, a numpy array, or a CPU or CUDA
        tensor), one per source page, checked before anything is asked. `deadline` (a
        request's end-to-end budget, passed through unchanged) or `timeout` (seconds from
        now): give at most one; with neither, `Timeouts.fetch` applies. `ticket`: the
        room's ticket from its prefill (through the router): the fetch then asks nobody;
        it reads every owner at once and proves the pin by each owner's pin word. Returns
        only when every byte of the room was read while its source pages stayed pinned
        (proved by a release, or by a pin word READ after the data); otherwise raises a
        `PdkvError` and the destination pages hold no valid KV. `readers`: this fetch is
        one of that many reads of the room by one group (a decode's attention-TP ranks,
        each reading it whole by claims): the room grants at least that many claims.
        """
        started = time.perf_counter()
        if ticket is not None and self._gpu is not None:
            self._gpu.prime()  # a launch follows within a fraction of a millisecond
        dst = page_ids(dst_pages, self.pool.layout.num_pages, "destination pages")
        budget = _budget(self.timeouts.fetch, deadline, timeout)
        if ticket is not None and (ticket.engine_id, ticket.room) != (engine_id, room):
            raise ValueError(f"the ticket is for room {ticket.room} of {ticket.engine_id}, not {room} of {engine_id}")
        self._enter()
        try:
            with request_context(engine=engine_id, room=room, consumer=self.consumer_id), fetching(engine_id):
                result = await self._fetch(engine_id, room, dst, budget, ticket, started, readers)
        except PdkvError as exc:
            FETCH_FAILURES.labels(engine_id, type(exc).__name__).inc()
            logger.info("fetch of room %d from %s failed: %s", room, engine_id, exc)
            raise
        finally:
            self._leave()
        # Recorded once the caller has its result: a fetch of a finished room through the GPU
        # lane takes well under a millisecond, and on a CPU just woken each step costs 10x.
        asyncio.get_running_loop().call_soon(_observe, result)
        return result

    async def _fetch(
        self,
        engine_id: str,
        room: int,
        dst: np.ndarray,
        budget: Deadline,
        ticket: RoomTicket | None,
        started: float,
        readers: int,
    ) -> FetchResult:
        # A cached engine and a ticket of its owners cost no coroutine of their own: on a host
        # just woken each one is microseconds of a lane fetch that takes a fraction of a millisecond.
        owners = self._engines.get(engine_id)
        was_cached = owners is not None
        if owners is None:
            owners = await self._lookup(engine_id, budget)
        if ticket is not None:
            if _ticket_readable(owners, ticket):
                ticket_owners: dict[int, Owner] | None = owners
            else:
                ticket_owners = await self._ticket_owners(engine_id, owners, ticket, budget)
            if ticket_owners is not None:
                try:
                    return await self._fetch_ticket(ticket_owners, engine_id, ticket, dst, budget, started)
                except PeerLostError:
                    await self.forget(engine_id)  # a failed connection serves no later fetch
                    raise
            owners = await self._lookup(engine_id, budget)
        try:
            return await self._fetch_from(owners, engine_id, Claim(room, readers), dst, budget, started)
        except PeerLostError:
            fresh = await self._reregistered(engine_id, owners, was_cached, budget)
            if fresh is None:
                raise
            logger.info("engine %s re-registered since it was cached; retrying room %d", engine_id, room)
            return await self._fetch_from(fresh, engine_id, Claim(room, readers), dst, budget, started)

    async def _ticket_owners(
        self, engine_id: str, owners: dict[int, Owner], ticket: RoomTicket, budget: Deadline
    ) -> dict[int, Owner] | None:
        """The owners `ticket` can be read from, where `owners` are not (`_ticket_readable`);
        None: read by claims instead.

        A ticket naming other incarnations than the cached ones makes one fresh lookup (the
        engine restarted since it was cached, or the cache is older than the ticket).
        """
        if not _pinned(owners):
            return None  # an exporter without a pin table: claims
        await self.forget(engine_id)
        owners = await self._lookup(engine_id, budget)
        if _ticket_readable(owners, ticket):
            return owners
        if not _pinned(owners):
            return None
        raise UnknownRoomError(
            f"room {ticket.room}: its ticket names owners of {engine_id} that no longer run (restarted)"
        )

    def _pin_window(self) -> torch.Tensor:
        self._next_window = (self._next_window + 1) % len(self._pin_windows)
        return self._pin_windows[self._next_window]

    async def _reregistered(
        self, engine_id: str, owners: dict[int, Owner], was_cached: bool, budget: Deadline
    ) -> dict[int, Owner] | None:
        """After a lost peer: the engine's owners anew if it re-registered since it was
        cached (a restart), else None."""
        await self.forget(engine_id)  # drop the dead peers' connections and keys
        if not was_cached:
            return None
        described = await self._describe(engine_id, budget)
        if _incarnations(described) == _incarnations(owners):
            return None
        return await self._lookup(engine_id, budget)

    async def abandon(self, engine_id: str, room: int, *, timeout: float | None = None) -> None:
        """This decode will not read `room` (its request was aborted): every owner gives up
        one of the room's claims, so the room ends aborted there at once (its pages freed,
        its prefill told) instead of staying pinned until its pin expires. A room not yet
        published is refused when it is. Owners that cannot be reached are logged."""
        budget = _budget(self.timeouts.request, None, timeout)
        self._enter()
        try:
            owners = await self._lookup(engine_id, budget)
            with request_context(engine=engine_id, room=room, consumer=self.consumer_id):
                await self._release_all(owners, Claim(room), set(owners))
        finally:
            self._leave()

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
        budget = _budget(self.timeouts.fetch, deadline, timeout)
        self._enter()
        try:
            owners = await self._lookup(engine_id, budget)
            claim = Claim(room, readers)
            try:
                await self._tracked(self._claim_arbiter(owners, claim, budget))
                await self._tracked(
                    asyncio.gather(
                        *(self._claim_owner(o, claim, budget) for r, o in owners.items() if r not in claim.granted)
                    )
                )
            except BaseException:
                await self._release_all(owners, claim)
                raise
            for o in owners.values():  # the room's later states are pushed to this claim holder
                self._feed.want(o.rank.control_url, room)
            return RoomLease(self, engine_id, owners, claim)
        finally:
            self._leave()


class RoomLease:
    """A claim on one room held on every owner; its source pages stay pinned until
    `release()`. Reads under it may be repeated. Use `async with` or call `release()`."""

    def __init__(self, fetcher: DecodeFetcher, engine_id: str, owners: dict[int, Owner], claim: Claim) -> None:
        self._fetcher, self.engine_id, self._owners, self._claim = fetcher, engine_id, owners, claim
        self._released: bool | None = None

    @property
    def room(self) -> int:
        return self._claim.room

    async def read(
        self, dst_pages: PageIds, *, deadline: Deadline | None = None, timeout: float | None = None
    ) -> FetchResult:
        """Read every layer of the room into `dst_pages` (waiting for layers still written).

        The bytes are the room's only if `release()` then succeeds: until then a reader
        must not hand them on.
        """
        f, (started, dst, budget) = self._fetcher, self._begin(dst_pages, deadline, timeout)
        f._enter()
        try:
            with fetching(self.engine_id):
                return await f._fetch_from(
                    self._owners, self.engine_id, self._claim, dst, budget, started, release=False
                )
        finally:
            f._leave()

    async def release(self) -> bool:
        """Release the claim on every owner; True if that freed the room (it was the last).

        Raises `ClaimLostError` if any owner had freed the pages first (aborted, expired):
        whatever was read under this lease must then be discarded. Idempotent.
        """
        if self._released is not None:
            return self._released
        f, claim = self._fetcher, self._claim
        self._released = False
        self._forget()
        ranks = claim.open_ranks
        outcomes = await asyncio.gather(
            *(f._release(o, claim, f.timeouts.request) for o in self._owners.values() if o.rank.cp_rank in ranks),
            return_exceptions=True,
        )
        failures = [e for e in outcomes if isinstance(e, BaseException)]
        if failures:
            raise failures[0]
        self._released = all(claim.released.get(r, False) for r in self._owners)
        return self._released

    def _as_ticket(self) -> RoomTicket | None:
        """The room as a ticket names it, from the claims' answers; None unless each owner's
        found it whole (same pages everywhere) and named its pin."""
        pins: list[OwnerPin] = []
        pages: list[int] | None = None
        for r, o in self._owners.items():
            s = self._state(r, o)
            if s is None or s.pin is None or s.status is not RoomStatus.READY or pages not in (None, s.src_pages):
                return None
            pins.append(s.pin)
            pages = s.src_pages
        if pages is None or not _pinned(self._owners):
            return None
        return RoomTicket(engine_id=self.engine_id, room=self.room, src_pages=pages, pins=pins)

    def _state(self, rank: int, owner: Owner) -> RoomState | None:
        """The room's newest state on `owner`: as its claim found it, or pushed since."""
        pushed = self._fetcher._feed.latest(owner.rank.control_url, self.room)
        if pushed is not None and pushed.status is not RoomStatus.PENDING:
            return pushed
        return self._claim.states.get(rank)

    def _begin(
        self, dst_pages: PageIds, deadline: Deadline | None, timeout: float | None
    ) -> tuple[float, np.ndarray, Deadline]:
        """A read's start: its clock, its checked destination pages and its budget."""
        if self._released is not None:
            raise ClosedError(f"lease on room {self.room} was already released")
        started, f = time.perf_counter(), self._fetcher
        return (
            started,
            page_ids(dst_pages, f.pool.layout.num_pages, "destination pages"),
            _budget(f.timeouts.fetch, deadline, timeout),
        )

    async def _read_pinned(
        self, ticket: RoomTicket, dst_pages: PageIds, deadline: Deadline | None, timeout: float | None
    ) -> FetchResult:
        f, (started, dst, budget) = self._fetcher, self._begin(dst_pages, deadline, timeout)
        f._enter()
        try:
            with fetching(self.engine_id):
                result = await f._fetch_ticket(self._owners, self.engine_id, ticket, dst, budget, started, self._notify)
        except ClaimLostError as exc:  # a pin word cleared under an open claim: aborted or expired
            await self.give_up()
            if isinstance(exc, RoomAbortedError):
                raise
            raise RoomAbortedError(f"room {self.room} was aborted (or its pin expired) while it was read") from exc
        except BaseException:
            await self.give_up()
            raise
        finally:
            f._leave()
        states = (self._state(r, o) for r, o in sorted(self._owners.items()))
        aux = next((s.aux for s in states if s is not None and s.aux is not None), None)
        if aux is None:
            return result
        owners = (msgspec.structs.replace(result.owners[0], aux=aux), *result.owners[1:])
        return msgspec.structs.replace(result, owners=owners)

    def _notify(self, pinned: list[tuple[Owner, OwnerPin]], room: int) -> None:
        """Release the claim on every owner by a notification (its bytes proved by the pin words)."""
        f, claim = self._fetcher, self._claim
        self._released = False
        for owner, _ in pinned:
            claim.released[owner.rank.cp_rank] = False
        if f.transport is None:  # closed meanwhile: the pins expire
            return
        fp = f.pool.layout.fingerprint
        body = encode(ClaimRelease(room=room, claim=claim.token), fp)
        try:
            f.transport.notify([(o.rank.agent_name, body) for o, _ in pinned])
        except PdkvError as exc:
            logger.info("claim release of room %d: %s (its pins expire instead)", room, exc)

    async def give_up(self) -> None:
        """Give the claim up unread (the read failed or was cancelled): as a failed fetch
        does, so a room that no consumer read ends aborted on its owners. Idempotent."""
        if self._released is not None:
            return
        self._released = False
        self._forget()
        await self._fetcher._release_all(self._owners, self._claim)

    def _forget(self) -> None:
        """Stop keeping the room's pushed states (wanted since the claim)."""
        for o in self._owners.values():
            self._fetcher._feed.forget(o.rank.control_url, self.room)

    async def read_once(
        self, dst_pages: PageIds, *, deadline: Deadline | None = None, timeout: float | None = None
    ) -> FetchResult:
        """`read`, then `release` (which proves the bytes): a fetch whose claim was taken
        ahead. On any failure, cancellation too, the claim is given up.

        Where every owner's claim found the room whole and named its pin, the room is read
        as a ticket's: every owner at once, each pin word proved after the data, the claims
        released by notifications after the return (`freed` is then unknown: False)."""
        ticket = self._as_ticket()
        try:
            if ticket is not None:
                return await self._read_pinned(ticket, dst_pages, deadline, timeout)
            result = await self.read(dst_pages, deadline=deadline, timeout=timeout)
            freed = await self.release()
        except BaseException:
            await self.give_up()
            raise
        finally:
            self._forget()
        freed_on = tuple(sorted(r for r, last in self._claim.released.items() if last))
        return msgspec.structs.replace(result, freed=freed, freed_on=freed_on)

    async def __aenter__(self) -> RoomLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


def _observe(result: FetchResult) -> None:
    engine = result.engine_id
    FETCH_SECONDS.labels(engine, "claims" if result.control_messages else "ticket").observe(result.seconds)
    FETCH_BYTES.labels(engine).observe(result.nbytes)
    FETCH_DESCRIPTORS.labels(engine).observe(result.descriptors)
    if result.seconds > 0:
        FETCH_RATE.labels(engine).observe(result.nbytes / result.seconds)


def _budget(default: float, deadline: Deadline | None, timeout: float | None) -> Deadline:
    if deadline is not None and timeout is not None:
        raise ValueError("give a deadline or a timeout, not both")
    if deadline is not None:
        return deadline
    return Deadline.after(default if timeout is None else timeout)


def _pinned(owners: dict[int, Owner]) -> bool:
    """Whether every owner publishes a pin table (which a ticket's read is proved by)."""
    return all(o.rank.pins is not None for o in owners.values())


def _ticket_readable(owners: dict[int, Owner], ticket: RoomTicket) -> bool:
    """Whether `ticket` can be read from `owners`: each pinned, and its incarnation the ticket's."""
    pins = {p.cp_rank: p.incarnation for p in ticket.pins}
    return _pinned(owners) and pins == {r: o.rank.incarnation for r, o in owners.items()}


def _incarnations(owners: dict[int, Owner]) -> list[str]:
    return [o.rank.incarnation for _, o in sorted(owners.items())]
