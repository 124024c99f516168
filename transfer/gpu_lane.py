"""The same-host GPU lane: map each owner's slabs once, gather pages with one kernel.

A decode whose pool is on a GPU reads an owner through this lane when the owner published
CUDA IPC handles (`RankDescriptor.ipc`) from the same host, on a GPU this process can
reach (the same GPU, or a peer over NVLink/PCIe). Everything else about a fetch stays:
claims, readiness polls and releases go over the control plane, which is also the only
way to learn that an owner died: a mapping of a SIGKILLed owner stays readable, so a
fetch's release (refused by a dead owner) is what proves the bytes.

Rules that each cost a crash or a hang when learnt on H200s: handles are opened under the
decode GPU's context; every address and page id is checked on the host before a launch;
handles are opened eagerly, when the engine is looked up (a handle first opened after its
owner died fails); a mapping is closed only once no kernel can still read it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np
import torch

from pdkv.errors import PeerLostError, TransferError
from transfer.cuda_ipc import CudaDriver, IpcMapping, host_id
from transfer.engine import XferStats
from transfer.gather import GatherLane
from transfer.metadata import BufferKind, RankDescriptor
from transfer.plan import BufferPair, build_gather_plan

__all__ = ["GpuLane", "IpcPeer", "ipc_unreachable"]

logger = logging.getLogger(__name__)


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
    mappings: dict[BufferKind, IpcMapping]
    pairs: dict[int, tuple[BufferPair, BufferPair]]
    closed: bool = False


class GpuLane:
    """Maps owners and runs gather plans on one decode GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index or 0
        self._driver = CudaDriver.get()
        self._gather = GatherLane(device)
        self._peers: set[IpcPeer] = set()

    def open(self, rank: RankDescriptor, local: dict[int, tuple[BufferPair, BufferPair]]) -> IpcPeer:
        """Map `rank`'s slabs and translate its UCX buffer pairs into mapped addresses."""
        assert rank.ipc is not None
        mappings: dict[BufferKind, IpcMapping] = {}
        try:
            for slab in rank.ipc.slabs:
                mapped, size = self._driver.open(self.index, slab.handle)
                m = IpcMapping(self.index, slab.addr, slab.length, mapped, slab.alloc_offset)
                mappings[slab.kind] = m
                if slab.alloc_offset + slab.length > size:  # a forged length must not reach a kernel
                    raise TransferError(f"cp rank {rank.cp_rank}: {slab.kind.value} slab of {slab.length} bytes at "
                                        f"offset {slab.alloc_offset} exceeds the {size}-byte allocation it maps")
            pairs = {layer: (self._translate(mappings[BufferKind.LATENT], lat), self._translate(mappings[BufferKind.INDEX], idx))
                     for layer, (lat, idx) in local.items()}
        except BaseException:
            for m in mappings.values():
                m.close(self._driver)
            raise
        peer = IpcPeer(rank.agent_name, mappings, pairs)
        self._peers.add(peer)
        return peer

    @staticmethod
    def _translate(mapping: IpcMapping, pair: BufferPair) -> BufferPair:
        addr = mapping.translate(pair.remote_addr, pair.remote_items * pair.item_len)
        return BufferPair(pair.local_addr, addr, pair.item_len, pair.local_items, pair.remote_items,
                          pair.local_dev, pair.local_dev)

    async def read(self, peer: IpcPeer, layers: range, src: np.ndarray, dst: np.ndarray) -> XferStats:
        """Gather `src` pages of `layers` from `peer` into `dst` pages; returns once in place."""
        plan = build_gather_plan([p for layer in layers for p in peer.pairs[layer]], src, dst)
        if peer.closed:  # checked on the loop's thread right before the launch: no race with close()
            raise PeerLostError(f"{peer.agent_name}: its mappings were dropped", peer.agent_name)
        return XferStats(plan.nbytes, 0, await self._gather.run(plan))  # seconds: the GPU's own time

    async def close(self, peer: IpcPeer) -> None:
        """Drop `peer`'s mappings once no kernel can still read them (frees a dead owner's memory)."""
        if peer.closed:
            return
        peer.closed = True
        self._peers.discard(peer)
        await asyncio.to_thread(self._gather.stream.synchronize)
        for m in peer.mappings.values():
            m.close(self._driver)

    async def aclose(self) -> None:
        for peer in list(self._peers):
            await self.close(peer)
