"""The UCX lane: one-sided READs through NIXL from an owner anywhere on the network.

It also carries what the decode's protocol needs from UCX whatever lane moves an owner's
bytes: its pin words (a READ, for an owner on another host) and release notifications.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field

import numpy as np
import torch

from pdkv.errors import TransferError
from transfer.deadline import Deadline
from transfer.lanes.base import Pairs, ReadStats, Watch
from transfer.lanes.ucx.plan import ReadTable, read_plan, read_table
from transfer.lanes.ucx.transport import UcxTransport
from transfer.metadata import RankDescriptor

__all__ = ["UcxLane", "UcxPeer"]


@dataclass(eq=False)
class UcxPeer:
    """One owner connected: its agent, its layers' buffer pairs, and READ tables built once."""

    agent_name: str
    cp_rank: int
    pieces: int  # READs one read is cut into: owners are read at once, so fill the workers, no more
    pairs: Pairs
    tables: dict[tuple[int, int], ReadTable] = field(default_factory=dict)  # by layer range
    closed: bool = False

    def table(self, layers: range) -> ReadTable:
        """The READ table of `layers` (built once: a fetch then only lays its pages over it)."""
        key = (layers.start, layers.stop)
        if key not in self.tables:
            self.tables[key] = read_table([p for layer in layers for p in self.pairs[layer]])
        return self.tables[key]


class UcxLane:
    """Reads owners over `transport` (its buffers registered by the caller), each READ bounded
    by the transport's `Timeouts.transfer`. `merge_runs`: runs of pages consecutive on both
    sides become one descriptor."""

    name = "ucx"
    merges = False

    def __init__(self, transport: UcxTransport, *, merge_runs: bool = True) -> None:
        self.transport = transport
        self.merge_runs = merge_runs
        self._transfer_timeout = transport.timeouts.transfer

    @property
    def closed(self) -> bool:
        return self.transport.closed

    def reach(self, rank: RankDescriptor) -> str | None:
        return None  # UCX reaches every owner that published an agent

    async def open(self, rank: RankDescriptor, pairs: Pairs) -> UcxPeer:
        regions = [(b.addr, b.length) for b in rank.buffers]
        if rank.pins is not None:
            regions.append((rank.pins.addr, rank.pins.nbytes))
        await self.transport.add_peer(rank.agent_name, rank.agent_metadata, regions)
        return UcxPeer(rank.agent_name, rank.cp_rank, max(1, self.transport.workers // rank.cp_size), pairs)

    async def close(self, peer: UcxPeer) -> None:
        peer.closed = True
        await self.transport.remove_peer(peer.agent_name)

    async def read(
        self, peer: UcxPeer, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline
    ) -> ReadStats:
        plan = read_plan(peer.table(layers), src, dst, merge=self.merge_runs)
        return await self.transport.read(peer.agent_name, plan, deadline.within(self._transfer_timeout), peer.pieces)

    def group(self, expected: int) -> None:
        return None  # owners' READs already run at once, each on its workers

    def merged(self, peers: tuple[UcxPeer, ...]) -> None:
        return None

    def read_merged(
        self, merged: object, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None
    ) -> Awaitable[float]:
        raise TransferError("the UCX lane reads one owner at a time")

    def prime(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.transport.aclose()

    # ---- what the protocol needs from UCX, whatever lane moves the bytes ----------------------
    async def read_word(self, agent_name: str, addr: int, window: torch.Tensor, deadline: Deadline) -> None:
        """READ `window.nbytes` of `agent_name`'s host memory at `addr` (a pin table's words)."""
        await self.transport.read_host(agent_name, addr, window, deadline)

    def notify(self, messages: list[tuple[str, bytes]]) -> None:
        """Send each (agent, message) as a notification, no reply (`UcxTransport.notify`)."""
        self.transport.notify(messages)

    def connected(self, agent_name: str) -> bool:
        """Whether notifications (and pin word READs) can reach `agent_name` (a connection is held)."""
        return self.transport.has_peer(agent_name)
