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
from transfer.lanes.cuda_ipc.gather import Gatherer, Launch
from transfer.lanes.cuda_ipc.plan import (
    GatherTable,
    gather_plan,
    gather_table,
    merge_gather_tables,
    route_pages,
)
from transfer.lanes.cuda_ipc.vmm import VmmMapping, import_span
from transfer.lanes.runs import BufferPair
from transfer.metadata import RankDescriptor

logger = logging.getLogger(__name__)

_MERGED_KEPT = 64  # merged tables and batches kept, each
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
    shares_gpu: bool = False  # its memory is on the decode's own GPU: another process's work, as a rule
    closed: bool = False
    tables: dict[tuple[int, int], GatherTable] = field(default_factory=dict)  # by layer range

    def table(self, layers: range) -> GatherTable:
        """The gather table of `layers` (built once: a fetch then only sends its page ids)."""
        key = (layers.start, layers.stop)
        if key not in self.tables:
            self.tables[key] = gather_table([p for layer in layers for p in self.pairs[layer]])
        return self.tables[key]


@dataclass(frozen=True, eq=False)
class GatherBatch:
    """Owners of a room on this host's GPUs, every layer of each read with one launch over
    one source page list: their tables merged once, so a read only checks and sends its pages."""

    peers: tuple[IpcPeer, ...]
    table: GatherTable
    shares: tuple[tuple[IpcPeer, int], ...]  # each owner and its bytes a page, by CP rank
    gather: Gatherer = field(repr=False)

    @property
    def page_bytes(self) -> int:
        return self.table.page_bytes

    # The launch's awaitable is returned rather than wrapped in a coroutine of its own: each
    # layer of coroutines costs a fetch microseconds on a host just woken. Everything is
    # checked before it returns, and the launch goes as the awaitable starts.
    def read(self, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None) -> Awaitable[float]:
        """Gather `src` pages of every layer of the owners into `dst` pages (ids known to lie
        below `dst_below`) with one launch; await it for its seconds (`Gatherer.run`) once
        the bytes are in place. `watch`: as `Gatherer.run`. The ids are checked here,
        vectorised, and go to the kernel as they are: no plan is built."""
        table = self.table
        src, dst = route_pages(table, src, dst, dst_below)
        _check_open(self.peers)
        if src.size == 0 or table.buffers == 0:  # nothing to launch
            return self.gather.run(gather_plan(table, [src], dst), watch)
        return self.gather.run_pages(table, src, dst, watch)

    def start(self, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None) -> Launch | None:
        """`read`, launched now: its ids checked (a bad one raises before any launch), its
        launch queued and an `Ordered` watch told; None where there is nothing to launch.
        Then `landed` (or `settle`) with the same watch: the caller's bookkeeping runs while
        the kernel copies."""
        table = self.table
        src, dst = route_pages(table, src, dst, dst_below)
        _check_open(self.peers)
        if src.size == 0 or table.buffers == 0:
            return None
        return self.gather.start(table, src, dst, watch)

    def landed(self, started: Launch, watch: Watch | None = None) -> Awaitable[float]:
        """The seconds of a read `start`ed, once it has ended (`Gatherer.landed`)."""
        return self.gather.landed(started, watch)

    def settle(self, started: Launch) -> Awaitable[None]:
        """Return once a read `start`ed has ended (`Gatherer.settle`)."""
        return self.gather.settle(started)


def _cached(cache: dict[K, V], key: K, make: Callable[[], V]) -> V:
    """`cache[key]`, made on a miss; a full cache is emptied (owner sets come and go with engines)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= _MERGED_KEPT:
            cache.clear()
        value = cache[key] = make()
    return value


class CudaIpcLane:
    """Maps owners and runs gather plans on one decode GPU (`time_kernels`: see `Gatherer`'s `timed`).

    `primes`: whether a read about to come queues the empty kernel first (`prime`). None, the
    default: where an owner's memory is on the decode's own GPU. Another process's work there
    makes the GPU switch to this one's context before it runs a kernel of it, which the empty
    kernel starts while the host checks the read; on a GPU of the decode's alone (an owner
    on a peer GPU) no switch is owed, and the empty kernel would only cost the host its launch."""

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
        self.primes: bool | None = None
        self._sharing = 0  # open peers whose memory is on this GPU
        # Tables of several owners merged, by their parts: a room's owners go out as one launch.
        self._merged: dict[tuple[tuple[GatherTable, ...], bool], GatherTable] = {}
        self._batches: dict[tuple[IpcPeer, ...], GatherBatch] = {}

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
        layers = range(rank.layer_start, rank.layer_end)
        peer = IpcPeer(
            rank.agent_name, rank.cp_rank, layers, mappings, pairs, _visible_gpu(rank.ipc.gpu_uuid) == self.index
        )
        self._peers.add(peer)
        self._sharing += peer.shares_gpu
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

    def _merged_table(self, tables: list[GatherTable], shared_pages: bool) -> GatherTable:
        return _cached(self._merged, (tuple(tables), shared_pages), lambda: merge_gather_tables(tables, shared_pages))

    def prime(self) -> None:
        """Ready the GPU for a launch that is about to come (`Gatherer.prime`), where it owes
        a switch from another process's work first (`primes`)."""
        if self.primes or (self.primes is None and self._sharing):
            self._gather.prime()

    def batch(self, peers: tuple[IpcPeer, ...]) -> GatherBatch:
        """Every layer of `peers` (a room's owners) read with one launch."""

        def make() -> GatherBatch:
            table = self._merged_table([peer.table(peer.layers) for peer in peers], True)
            shares = tuple((p, p.table(p.layers).page_bytes) for p in sorted(peers, key=lambda p: p.cp_rank))
            return GatherBatch(peers, table, shares, self._gather)

        return _cached(self._batches, peers, make)

    async def read(
        self, peer: IpcPeer, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline | None = None
    ) -> ReadStats:
        """Gather `src` pages of `layers` from `peer` into `dst` pages; returns once in place.
        (A launch cannot be stopped, nor can it hang: its bytes are on this host.) As a
        batch's read: the ids are checked vectorised and go to the kernel as they are, the
        table of `layers` kept on the GPU; no plan is built. The destinations are checked
        against the table's items here (a single owner's read has no pool bound to trust)."""
        table = peer.table(layers)
        src, dst = route_pages(table, src, dst)
        _check_open((peer,))  # checked on the loop's thread, then awaited at once: no race with close()
        if src.size == 0 or table.buffers == 0:
            return ReadStats(0, 0, 0.0)
        return ReadStats(table.page_bytes * dst.size, 0, await self._gather.run_pages(table, src, dst))

    async def close(self, peer: IpcPeer) -> None:
        """Drop `peer`'s mappings once no kernel can still read them (frees a dead owner's memory)."""
        if peer.closed:
            return
        peer.closed = True
        self._peers.discard(peer)
        self._sharing -= peer.shares_gpu
        dropped = set(peer.tables.values())
        self._merged = {k: v for k, v in self._merged.items() if dropped.isdisjoint(k[0])}
        self._batches = {k: v for k, v in self._batches.items() if peer not in k}
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


def _check_open(peers: Sequence[IpcPeer]) -> None:
    for peer in peers:  # checked on the loop's thread, then awaited at once: no race with close()
        if peer.closed:
            raise PeerLostError(f"{peer.agent_name}: its mappings were dropped", peer.agent_name)
