"""The same-host GPU lane: map each owner's slabs once, gather pages with one kernel.

A decode whose pool is on a GPU reads an owner through this lane when the owner published
CUDA IPC handles (`RankDescriptor.ipc`) from the same host, on a GPU this process can
reach (the same GPU, or a peer over NVLink/PCIe). Everything else about a fetch stays:
claims, readiness polls and releases go over the control plane, which is also the only
way to learn that an owner died: a mapping of a SIGKILLed owner stays readable, so a
fetch's release (refused by a dead owner) is what proves the bytes.

Rules, each learnt from a crash or a hang: handles are opened under the
decode GPU's context; every address and page id is checked on the host before a launch;
handles are opened eagerly, when the engine is looked up (a handle first opened after its
owner died fails); a mapping is closed only once no kernel can still read it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from pdkv.errors import PdkvError, PeerLostError, TransferError
from transfer.deadline import Deadline
from transfer.lanes.base import Pairs, ReadStats, Watch, host_id
from transfer.lanes.cuda_ipc.driver import CudaDriver, IpcMapping
from transfer.lanes.cuda_ipc.export import NO_SECRET
from transfer.lanes.cuda_ipc.fd_pass import close_fds, fetch_fds
from transfer.lanes.cuda_ipc.gather import Gatherer
from transfer.lanes.cuda_ipc.plan import (
    GatherPlan,
    GatherTable,
    gather_plan,
    gather_table,
    merge_gather_plans,
    merge_gather_tables,
    route_pages,
    shares_source_pages,
)
from transfer.lanes.cuda_ipc.vmm import VmmMapping, import_span
from transfer.lanes.runs import BufferPair
from transfer.metadata import RankDescriptor

__all__ = ["CudaIpcLane", "IpcPeer", "LaneRoute", "LaunchGroup", "LaunchSlot", "ipc_unreachable"]

logger = logging.getLogger(__name__)

_MERGED_KEPT = 64  # merged tables and routes kept, each
K = TypeVar("K")
V = TypeVar("V")


def _visible_gpu(uuid: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


def ipc_unreachable(rank: RankDescriptor, device: torch.device) -> str | None:
    """Why the lane cannot read `rank` from `device`, or None if it can."""
    if device.type != "cuda":
        return "the decode pool is not on a GPU"
    if rank.ipc is None:
        return "the owner published no IPC handles"
    if rank.ipc.host_id != host_id():
        return "the owner is on another host"
    gpu = _visible_gpu(rank.ipc.gpu_uuid)
    if gpu is None:
        return f"the owner's GPU {rank.ipc.gpu_uuid} is not visible here"
    here = device.index or 0
    if gpu != here and not torch.cuda.can_device_access_peer(here, gpu):
        return f"GPU {here} cannot reach GPU {gpu}"
    return None


@dataclass(eq=False)  # identity: kept in a set until closed
class IpcPeer:
    """One owner's slabs mapped here, and its layers' buffer pairs in local addresses."""

    agent_name: str
    cp_rank: int
    layers: range  # the layers it owns
    mappings: list[IpcMapping | VmmMapping]
    pairs: dict[int, tuple[BufferPair, BufferPair]]
    closed: bool = False
    tables: dict[tuple[int, int], GatherTable] = field(default_factory=dict)  # by layer range

    def table(self, layers: range) -> GatherTable:
        """The gather table of `layers` (built once: a fetch then only sends its page ids)."""
        key = (layers.start, layers.stop)
        if key not in self.tables:
            self.tables[key] = gather_table([p for layer in layers for p in self.pairs[layer]])
        return self.tables[key]


@dataclass(frozen=True, eq=False)
class LaneRoute:
    """Owners of a room on this host's GPUs, read with one launch over one source page list
    (a ticket's room): their tables merged once, so a fetch only checks and sends its pages."""

    peers: tuple[IpcPeer, ...]
    table: GatherTable
    shares: tuple[tuple[IpcPeer, int], ...]  # each owner and its bytes a page, by CP rank

    @property
    def page_bytes(self) -> int:
        return self.table.page_bytes


def _cached(cache: dict[K, V], key: K, make: Callable[[], V]) -> V:
    """`cache[key]`, made on a miss; a full cache is emptied (owner sets come and go with engines)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= _MERGED_KEPT:
            cache.clear()
        value = cache[key] = make()
    return value


class CudaIpcLane:
    """Maps owners and runs gather plans on one decode GPU (`time_kernels`: see `Gatherer`'s `timed`)."""

    name = "cuda_ipc"
    merges = True

    def __init__(
        self,
        device: torch.device,
        *,
        time_kernels: bool = False,
        secret: str | None = None,
        fd_timeout: float,
    ) -> None:
        """`secret`: the owners' (their VMM descriptors are handed out under it);
        `fd_timeout`: the bound on fetching an owner's descriptors (the fetcher's `Timeouts.connect`)."""
        self.device = device
        self._secret, self._fd_timeout = secret or NO_SECRET, fd_timeout
        self.index = device.index or 0
        self._driver = CudaDriver.get()
        self._gather = Gatherer(device, timed=time_kernels)
        self._peers: set[IpcPeer] = set()
        # Tables of several owners merged, by their parts: a room's owners go out as one launch.
        self._merged: dict[tuple[tuple[GatherTable, ...], bool], GatherTable] = {}
        self._routes: dict[tuple[IpcPeer, ...], LaneRoute] = {}

    def reach(self, rank: RankDescriptor) -> str | None:
        return ipc_unreachable(rank, self.device)

    async def open(self, rank: RankDescriptor, pairs: Pairs) -> IpcPeer:
        spans = await self._import_spans(rank)
        return self.map(rank, pairs, spans)

    async def _import_spans(self, rank: RankDescriptor) -> list[VmmMapping]:
        """Map `rank`'s VMM spans, their descriptors fetched from its socket. Any failure is a
        `TransferError` (not a lost peer): the owner is then read over another lane."""
        assert rank.ipc is not None
        mapped: list[VmmMapping] = []
        try:
            for span in rank.ipc.vmm:
                assert rank.ipc.fd_socket is not None
                fds = await fetch_fds(rank.ipc.fd_socket, span.key, self._secret, self._fd_timeout)
                try:
                    mapped.append(import_span(self.index, span.chunks, fds, owner_base=span.addr))
                finally:
                    close_fds(fds)  # the imported handles hold the memory now
        except BaseException as exc:
            self._unmap(mapped)
            if isinstance(exc, PdkvError):
                raise TransferError(f"cp rank {rank.cp_rank}: its VMM memory cannot be mapped: {exc}") from exc
            raise
        return mapped

    def map(self, rank: RankDescriptor, local: Pairs, spans: Sequence[VmmMapping] = ()) -> IpcPeer:
        """Map `rank`'s slabs (each allocation once, eagerly) and translate its UCX buffer
        pairs into mapped addresses: a pool's two slabs, an engine's allocations, or (with
        `spans`, mapped already) its VMM memory."""
        assert rank.ipc is not None
        mappings: list[IpcMapping | VmmMapping] = list(spans)
        opened: dict[bytes, tuple[int, int]] = {}  # one allocation may hold several slabs: map it once
        try:
            for slab in sorted(rank.ipc.slabs, key=lambda s: s.addr):
                if slab.handle not in opened:
                    opened[slab.handle] = self._driver.open(self.index, slab.handle)
                mapped, size = opened[slab.handle]
                mappings.append(IpcMapping(self.index, slab.addr, slab.length, mapped, slab.alloc_offset))
                if slab.alloc_offset + slab.length > size:  # a forged length must not reach a kernel
                    raise TransferError(
                        f"cp rank {rank.cp_rank}: a slab of {slab.length} bytes at offset "
                        f"{slab.alloc_offset} exceeds the {size}-byte allocation it maps"
                    )
            pairs = {
                layer: (self._translate(mappings, lat), self._translate(mappings, idx))
                for layer, (lat, idx) in local.items()
            }
        except BaseException:
            self._unmap(mappings)
            raise
        peer = IpcPeer(rank.agent_name, rank.cp_rank, range(rank.layer_start, rank.layer_end), mappings, pairs)
        self._peers.add(peer)
        return peer

    @staticmethod
    def _translate(mappings: list[IpcMapping | VmmMapping], pair: BufferPair) -> BufferPair:
        """`pair` with its remote address in a mapping that holds it (checked there)."""
        nbytes = pair.remote_items * pair.item_len
        mapping = next((m for m in mappings if m.holds(pair.remote_addr, nbytes)), mappings[0])
        addr = mapping.translate(pair.remote_addr, nbytes)
        return BufferPair(
            pair.local_addr, addr, pair.item_len, pair.local_items, pair.remote_items, pair.local_dev, pair.local_dev
        )

    @staticmethod
    def plan(peer: IpcPeer, layers: range, src: np.ndarray, dst: np.ndarray) -> GatherPlan:
        return gather_plan(peer.table(layers), [src], dst)

    def merge(self, plans: list[GatherPlan]) -> GatherPlan:
        """One launch for `plans` into the same destination pages, its table merged once."""
        plans = [p for p in plans if p.buffers]
        return merge_gather_plans(plans, self._merged_table([p.table for p in plans], shares_source_pages(plans)))

    def _merged_table(self, tables: list[GatherTable], shared_pages: bool) -> GatherTable:
        return _cached(self._merged, (tuple(tables), shared_pages), lambda: merge_gather_tables(tables, shared_pages))

    def prime(self) -> None:
        """Ready the GPU for a launch that is about to come (see `Gatherer.prime`)."""
        self._gather.prime()

    def route(self, peers: tuple[IpcPeer, ...]) -> LaneRoute:
        """The route that reads every layer of `peers` (one room's owners) in one launch."""

        def make() -> LaneRoute:
            table = self._merged_table([peer.table(peer.layers) for peer in peers], True)
            shares = tuple((p, p.table(p.layers).page_bytes) for p in sorted(peers, key=lambda p: p.cp_rank))
            return LaneRoute(peers, table, shares)

        return _cached(self._routes, peers, make)

    # `read_route` and `run` return the launch's awaitable rather than wrapping it in a
    # coroutine of their own: each layer of coroutines costs a fetch microseconds on a host
    # just woken. Both check everything before they return, and launch as the awaitable starts.

    def read_route(
        self, route: LaneRoute, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None
    ) -> Awaitable[float]:
        """Gather `src` pages of every layer of `route`'s owners into `dst` pages (ids known
        to lie below `dst_below`) with one launch; await it for its seconds
        (`Gatherer.run`) once the bytes are in place. `watch`: as `Gatherer.run`. The ids
        are checked here, vectorised, and go to the kernel as they are: no plan is built."""
        table = route.table
        src, dst = route_pages(table, src, dst, dst_below)
        if src.size == 0 or table.buffers == 0:
            return self.run(gather_plan(table, [src], dst), route.peers, watch)  # nothing to launch
        self._check_open(route.peers)
        return self._gather.run_pages(table, src, dst, watch)

    def run(self, plan: GatherPlan, peers: Sequence[IpcPeer], watch: Watch | None = None) -> Awaitable[float]:
        """Launch `plan`, which reads `peers`; await it for its seconds once the bytes are in place."""
        self._check_open(peers)
        return self._gather.run(plan, watch)

    @staticmethod
    def _check_open(peers: Sequence[IpcPeer]) -> None:
        for peer in peers:  # checked on the loop's thread, then awaited at once: no race with close()
            if peer.closed:
                raise PeerLostError(f"{peer.agent_name}: its mappings were dropped", peer.agent_name)

    async def read(
        self, peer: IpcPeer, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline | None = None
    ) -> ReadStats:
        """Gather `src` pages of `layers` from `peer` into `dst` pages; returns once in place.
        (A launch cannot be stopped, nor can it hang: its bytes are on this host.)"""
        plan = self.plan(peer, layers, src, dst)
        return ReadStats(plan.nbytes, 0, await self.run(plan, [peer]))

    def group(self, expected: int) -> LaunchGroup | None:
        """Owners of one fetch whose layers were all ready at once go out as one launch."""
        return LaunchGroup(self, expected) if expected >= 2 else None

    def merged(self, peers: tuple[IpcPeer, ...]) -> LaneRoute:
        return self.route(peers)

    def read_merged(
        self, merged: LaneRoute, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None
    ) -> Awaitable[float]:
        return self.read_route(merged, src, dst, dst_below, watch)

    async def close(self, peer: IpcPeer) -> None:
        """Drop `peer`'s mappings once no kernel can still read them (frees a dead owner's memory)."""
        if peer.closed:
            return
        peer.closed = True
        self._peers.discard(peer)
        dropped = set(peer.tables.values())
        self._merged = {k: v for k, v in self._merged.items() if dropped.isdisjoint(k[0])}
        self._routes = {k: v for k, v in self._routes.items() if peer not in k}
        await asyncio.to_thread(self._gather.stream.synchronize)
        self._unmap(peer.mappings)

    def _unmap(self, mappings: Iterable[IpcMapping | VmmMapping]) -> None:
        """Close each mapped allocation once, however many slabs lie in it."""
        closed: set[int] = set()
        for m in mappings:
            if isinstance(m, VmmMapping):
                m.close()
            elif m.mapped not in closed:
                closed.add(m.mapped)
                m.close(self._driver)

    async def aclose(self) -> None:
        for peer in list(self._peers):
            await self.close(peer)
        self._gather.close()


class LaunchGroup:
    """The owners of one fetch whose layers were all ready at once go out as ONE launch.

    Each owner task either reads through the group (its whole range was ready when it was
    claimed) or withdraws (it reads batch by batch as layers come). The launch goes out
    once every expected owner has done one or the other: a kernel over every layer of a
    room runs near the copy limit where four smaller ones did not.
    """

    def __init__(self, lane: CudaIpcLane, expected: int) -> None:
        self._lane, self._expected = lane, expected
        self._pending: list[tuple[GatherPlan, IpcPeer, asyncio.Future[float]]] = []
        self._launches: set[asyncio.Task[None]] = set()

    async def read(self, peer: IpcPeer, layers: range, src: np.ndarray, dst: np.ndarray) -> ReadStats:
        plan = self._lane.plan(peer, layers, src, dst)  # validated here, before joining
        done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pending.append((plan, peer, done))
        self._flush_if_complete()
        try:
            seconds = await asyncio.shield(done)
        except asyncio.CancelledError:  # the launch may be out: wait for it to end
            await asyncio.wait([done])
            raise
        return ReadStats(plan.nbytes, 0, seconds)

    def slot(self) -> LaunchSlot:
        """One owner's place in the group: read through it once, or close it to withdraw."""
        return LaunchSlot(self)

    def _withdraw(self) -> None:
        self._expected -= 1
        self._flush_if_complete()

    def _flush_if_complete(self) -> None:
        if self._pending and len(self._pending) >= self._expected:
            batch, self._pending = self._pending, []
            task = asyncio.ensure_future(self._launch(batch))
            self._launches.add(task)
            task.add_done_callback(self._launches.discard)

    async def _launch(self, batch: list[tuple[GatherPlan, IpcPeer, asyncio.Future[float]]]) -> None:
        try:
            merged = self._lane.merge([plan for plan, _, _ in batch])
            seconds = await self._lane.run(merged, [peer for _, peer, _ in batch])
        except BaseException as exc:
            for _, _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for plan, _, done in batch:  # each owner's share, so that the shares add up
            if not done.done():
                done.set_result(seconds * plan.nbytes / max(1, merged.nbytes))


class LaunchSlot:
    """One owner's share of a `LaunchGroup`: used once by `read`, or given up by `close`."""

    def __init__(self, group: LaunchGroup) -> None:
        self._group: LaunchGroup | None = group

    async def read(self, peer: IpcPeer, layers: range, src: np.ndarray, dst: np.ndarray) -> ReadStats:
        group, self._group = self._group, None
        if group is None:
            raise RuntimeError("a launch slot reads once")
        return await group.read(peer, layers, src, dst)

    def close(self) -> None:
        """Withdraw from the group if not read through (idempotent)."""
        group, self._group = self._group, None
        if group is not None:
            group._withdraw()
