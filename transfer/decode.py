"""The decode side: fetch a request's full KV from every CP owner into local pages.

    async with DecodeFetcher(pool, registry_url) as fetcher:
        result = await fetcher.fetch(engine_id, room, dst_pages)

A fetch looks the engine up (cached), checks that its owners cover every layer once and
match the local layout, then, for all owners concurrently, long-polls each owner for
the room's ready layers and reads them with one batched one-sided READ per batch of
ready layers, so it starts before the prefill has finished. Each owner is released as
soon as its layers are read, while other owners may still be read; a release refused
(room aborted or expired) fails the fetch, because the source pages may have been
reused while being read.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np

from pdkv.errors import (
    DeadlineExceeded,
    IncompatibleLayoutError,
    MetadataError,
    NotReadyError,
    PeerLostError,
    UnknownEngineError,
    UnknownRoomError,
)
from pdkv.pool import DSAKVPool
from transfer.engine import UcxEngine, default_lanes, device_id, mem_type
from transfer.http import ControlClient
from transfer.metadata import BufferKind, EngineDescriptor, RankDescriptor, ReleaseNotice, RoomState, RoomStatus
from transfer.plan import BufferPair, build_read_plan
from transfer.timeouts import Timeouts

__all__ = ["DecodeFetcher", "FetchResult", "OwnerStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnerStats:
    cp_rank: int
    layers: tuple[int, int]
    nbytes: int
    descriptors: int
    reads: int
    seconds: float  # from the first poll to the last byte from this owner
    read_seconds: float  # inside READs only (the rest is waiting for prefill)


@dataclass(frozen=True)
class FetchResult:
    engine_id: str
    room: int
    nbytes: int
    seconds: float
    owners: tuple[OwnerStats, ...]

    @property
    def descriptors(self) -> int:
        return sum(o.descriptors for o in self.owners)

    @property
    def read_seconds(self) -> float:
        return sum(o.read_seconds for o in self.owners)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _Owner:
    rank: RankDescriptor
    pairs: dict[int, tuple[BufferPair, BufferPair]]  # layer -> (latent, index)


class _Deadline:
    def __init__(self, seconds: float, at: float | None = None) -> None:
        self.at = time.monotonic() + seconds if at is None else at

    def left(self, cap: float) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("fetch deadline passed")
        return min(left, cap)


class DecodeFetcher:
    """Fetches KV of prefill rooms into `pool` over UCX. Many fetches may run at once.

    `lanes` is how many threads post READs (None: `default_lanes`, one a core up to 8,
    4 for a GPU pool); an owner's READ is cut into pieces when lanes outnumber owners.
    """

    def __init__(
        self,
        pool: DSAKVPool,
        registry_url: str,
        *,
        consumer_id: str | None = None,
        timeouts: Timeouts = Timeouts(),
        secret: str | None = None,
        lanes: int | None = None,
        merge_runs: bool = True,
    ) -> None:
        if len(pool.owned) != pool.layout.layer_num:
            raise IncompatibleLayoutError("a decode pool must hold every layer")
        self.pool = pool
        self.registry_url = registry_url.rstrip("/")
        self.consumer_id = consumer_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.timeouts = timeouts
        self.merge_runs = merge_runs
        self._lanes = lanes
        self._client = ControlClient(timeouts, secret)
        self._engines: dict[str, dict[int, _Owner]] = {}
        self._lookups: dict[str, asyncio.Task[dict[int, _Owner]]] = {}
        self.engine: UcxEngine | None = None

    async def start(self) -> None:
        mem = mem_type(self.pool.device)
        lanes = self._lanes or default_lanes(mem)
        self.engine = UcxEngine(f"{self.consumer_id}.{uuid.uuid4().hex[:8]}", lanes=lanes, mem_type=mem,
                                 connect_timeout=self.timeouts.connect)
        self.engine.register([self.pool.kv_slab, self.pool.index_slab])

    async def aclose(self) -> None:
        await self._client.aclose()
        if self.engine is not None:
            await self.engine.aclose()
            self.engine = None

    async def __aenter__(self) -> DecodeFetcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- engine lookup -------------------------------------------------------------------------
    async def _lookup(self, engine_id: str, deadline: _Deadline) -> dict[int, _Owner]:
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

    async def _resolve(self, engine_id: str) -> dict[int, _Owner]:
        owners = await self._describe(engine_id)
        await self._connect(owners)
        self._engines[engine_id] = owners
        return owners

    async def _describe(self, engine_id: str) -> dict[int, _Owner]:
        """Ask the registry for the engine's owners (waiting until all are in) and check them."""
        deadline = _Deadline(self.timeouts.lookup)
        url = f"{self.registry_url}/v1/engines/{engine_id}"
        delay = 0.05
        while True:
            try:
                desc = await self._client.request("GET", url, EngineDescriptor, timeout=deadline.left(self.timeouts.request))
                break
            except (NotReadyError, UnknownEngineError) as exc:
                if time.monotonic() + delay > deadline.at:
                    raise
                logger.debug("engine %s not ready: %s", engine_id, exc)
                await asyncio.sleep(deadline.left(delay))
                delay = min(delay * 2, 0.5)
        assert desc is not None
        return self._check_engine(desc)

    def _check_engine(self, desc: EngineDescriptor) -> dict[int, _Owner]:
        layout = self.pool.layout
        covered: list[int] = []
        owners = {}
        for rank in desc.ranks:
            rank.layout.check_against(layout)
            if rank.fingerprint != layout.fingerprint:
                raise IncompatibleLayoutError(f"rank {rank.cp_rank} fingerprint differs", ("fingerprint",))
            covered += range(rank.layer_start, rank.layer_end)
            owners[rank.cp_rank] = _Owner(rank, self._pairs(rank))
        if sorted(covered) != list(range(layout.start_layer, layout.end_layer)):
            raise MetadataError(f"engine {desc.engine_id}: owners do not cover every layer exactly once")
        return owners

    def _pairs(self, rank: RankDescriptor) -> dict[int, tuple[BufferPair, BufferPair]]:
        layout, pool = self.pool.layout, self.pool
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
                both.append(BufferPair(tensor.data_ptr(), remote.addr, item, tensor.nbytes // item, remote.num_items,
                                       device_id(tensor.device), remote.device_id))
            pairs[layer] = (both[0], both[1])
        return pairs

    async def _connect(self, owners: dict[int, _Owner]) -> None:
        assert self.engine is not None
        for o in owners.values():
            regions = [(b.addr, b.length) for b in o.rank.buffers]
            await self.engine.add_peer(o.rank.agent_name, o.rank.agent_metadata, regions)

    async def forget(self, engine_id: str) -> None:
        """Drop a cached engine and its peers' connections and keys."""
        owners = self._engines.pop(engine_id, None)
        if owners and self.engine is not None:
            for o in owners.values():
                await self.engine.remove_peer(o.rank.agent_name)

    # ---- the fetch -----------------------------------------------------------------------------
    async def fetch(
        self,
        engine_id: str,
        room: int,
        dst_pages: np.ndarray | list[int],
        *,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> FetchResult:
        """Read every layer of `room` from `engine_id`'s owners into `dst_pages`.

        `deadline` is an instant on the `time.monotonic()` clock (a request's end-to-end
        budget passes through unchanged); `timeout` is seconds from now. Give at most one;
        with neither, `Timeouts.fetch` applies. Raises a `PdkvError`, `DeadlineExceeded`
        when the deadline passes; on any error the destination pages hold no valid KV.
        """
        if deadline is not None and timeout is not None:
            raise ValueError("give a deadline or a timeout, not both")
        dst = np.asarray(dst_pages, dtype=np.int64)
        if dst.size and (dst.min() < 0 or dst.max() >= self.pool.layout.num_pages):
            raise MetadataError(f"destination pages outside [0, {self.pool.layout.num_pages})")
        budget = _Deadline(self.timeouts.fetch if timeout is None else timeout, at=deadline)
        was_cached = engine_id in self._engines
        owners = await self._lookup(engine_id, budget)
        try:
            return await self._fetch_from(owners, engine_id, room, dst, budget)
        except PeerLostError:
            await self.forget(engine_id)  # drop the dead peers' connections and keys
            if not was_cached:
                raise
            # A cached view may predate a restart: retry once if the engine re-registered.
            described = await asyncio.wait_for(self._describe(engine_id), budget.left(self.timeouts.lookup))
            if _incarnations(described) == _incarnations(owners):
                raise
            logger.info("engine %s re-registered since it was cached; retrying room %d", engine_id, room)
            fresh = await self._lookup(engine_id, budget)
            return await self._fetch_from(fresh, engine_id, room, dst, budget)

    async def _fetch_from(
        self, owners: dict[int, _Owner], engine_id: str, room: int, dst: np.ndarray, deadline: _Deadline
    ) -> FetchResult:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(self._fetch_owner(o, room, dst, deadline)) for o in owners.values()]
        try:
            stats = await _all_or_cancel(tasks)
        except BaseException:  # cancellation too: never leave the room pinned
            await self._release_all(owners, room)
            raise
        nbytes = sum(s.nbytes for s in stats)
        return FetchResult(engine_id, room, nbytes, time.perf_counter() - t0, tuple(stats))

    async def _poll(self, owner: _Owner, room: int, after: int, deadline: _Deadline) -> RoomState:
        url = f"{owner.rank.control_url}/v1/rooms/{room}?after={after}"
        limit = deadline.left(self.timeouts.poll + self.timeouts.request)
        state = await self._client.request(
            "GET", url, RoomState, expect_fingerprint=self.pool.layout.fingerprint, timeout=limit
        )
        assert state is not None
        if state.status in (RoomStatus.RELEASED, RoomStatus.ABORTED):
            raise UnknownRoomError(f"room {room} is {state.status.value} on cp rank {owner.rank.cp_rank}")
        return state

    async def _fetch_owner(self, owner: _Owner, room: int, dst: np.ndarray, deadline: _Deadline) -> OwnerStats:
        """Read one owner's layers, then release them there (while other owners still read)."""
        try:
            stats = await self._read_owner(owner, room, dst, deadline)
            await self._release(owner, room, deadline.left(self.timeouts.request))
            return stats
        except PeerLostError as exc:
            r = owner.rank
            raise PeerLostError(f"engine {r.engine_id} cp rank {r.cp_rank} ({r.control_url}) lost: {exc}", r.agent_name) from exc

    async def _read_owner(self, owner: _Owner, room: int, dst: np.ndarray, deadline: _Deadline) -> OwnerStats:
        assert self.engine is not None
        r = owner.rank
        t0 = time.perf_counter()
        cursor, nbytes, descs, reads, busy = r.layer_start, 0, 0, 0, 0.0
        src: np.ndarray | None = None
        pieces = max(1, self.engine.lanes // r.cp_size)  # owners read at once: fill the lanes, no more
        unknown_until = time.monotonic() + self.timeouts.ready
        while cursor < r.layer_end:
            state = await self._poll(owner, room, cursor, deadline)
            if state.status is RoomStatus.UNKNOWN:
                if time.monotonic() > unknown_until:
                    raise UnknownRoomError(f"room {room} never appeared on cp rank {r.cp_rank}")
                continue
            if src is None:
                src = np.asarray(state.src_pages, dtype=np.int64)
                if src.size != dst.size:
                    raise MetadataError(f"room {room}: {src.size} source pages, {dst.size} destination pages")
            if state.ready_upto <= cursor:
                continue
            pairs = [p for layer in range(cursor, state.ready_upto) for p in owner.pairs[layer]]
            plan = build_read_plan(pairs, src, dst, merge=self.merge_runs)
            xfer = await self.engine.read(r.agent_name, plan, deadline.left(self.timeouts.transfer), pieces)
            nbytes, descs, reads = nbytes + xfer.nbytes, descs + xfer.descriptors, reads + 1
            busy += xfer.seconds
            cursor = state.ready_upto
        return OwnerStats(r.cp_rank, (r.layer_start, r.layer_end), nbytes, descs, reads, time.perf_counter() - t0, busy)

    async def _release(self, owner: _Owner, room: int, timeout: float) -> None:
        """Release `room` on one owner. A refusal raises: those pages may have been reused mid-read."""
        notice = ReleaseNotice(room=room, consumer_id=self.consumer_id)
        url = f"{owner.rank.control_url}/v1/rooms/{room}/release"
        await self._client.request("POST", url, body=notice, fingerprint=self.pool.layout.fingerprint, timeout=timeout)

    async def _release_all(self, owners: dict[int, _Owner], room: int) -> None:
        """Release on every owner after a failed fetch (owners released already say so again).

        Each gets a full request timeout, not what is left of the fetch's deadline: the
        fetch may have failed on that deadline, and the pins must not be left behind.
        """
        limit = self.timeouts.request
        results = await asyncio.gather(*(self._release(o, room, limit) for o in owners.values()), return_exceptions=True)
        for e in results:
            if isinstance(e, BaseException):
                logger.debug("release of room %d after a failed fetch: %s", room, e)


def _incarnations(owners: dict[int, _Owner]) -> list[str]:
    return [o.rank.incarnation for _, o in sorted(owners.items())]


async def _all_or_cancel(tasks: list[asyncio.Task[OwnerStats]]) -> list[OwnerStats]:
    """Await every task; on the first failure (or cancellation) cancel the rest and wait."""
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        # Collects every outcome; a cancel of our own arriving meanwhile propagates.
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]
