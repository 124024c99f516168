"""The UCX lane: one-sided READs through NIXL from an owner anywhere on the network.

Its transport also carries the decode's signals (`transfer.lanes.ucx.signals`), whatever
lane moves an owner's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from transfer.deadline import Deadline
from transfer.lanes.base import Pairs, ReadStats
from transfer.lanes.ucx.plan import ReadTable, read_plan, read_table
from transfer.lanes.ucx.transport import UcxTransport
from transfer.metadata import RankDescriptor


@dataclass(eq=False)
class UcxPeer:
    """One owner connected: its agent, its layers' buffer pairs, and READ tables built once."""

    agent_name: str
    cp_rank: int
    layers: range  # the layers it owns
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

    def __init__(self, transport: UcxTransport, *, merge_runs: bool = True) -> None:
        self.transport = transport
        self.merge_runs = merge_runs
        self._transfer_timeout = transport.timeouts.transfer

    def reach(self, rank: RankDescriptor) -> str | None:
        return None  # UCX reaches every owner that published an agent

    async def open(self, rank: RankDescriptor, pairs: Pairs) -> UcxPeer:
        await self.transport.add_peer(rank.agent_name, rank.agent_metadata, exported_regions(rank))
        layers = range(rank.layer_start, rank.layer_end)
        return UcxPeer(rank.agent_name, rank.cp_rank, layers, max(1, self.transport.workers // rank.cp_size), pairs)

    async def close(self, peer: UcxPeer) -> None:
        peer.closed = True
        await self.transport.remove_peer(peer.agent_name)

    async def read(
        self, peer: UcxPeer, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline
    ) -> ReadStats:
        plan = read_plan(peer.table(layers), src, dst, merge=self.merge_runs)
        return await self.transport.read(peer.agent_name, plan, deadline.within(self._transfer_timeout), peer.pieces)

    def batch(self, peers: tuple[UcxPeer, ...]) -> None:
        return None  # owners' READs already run at once, each on its workers

    def prime(self) -> None:
        pass

    async def aclose(self) -> None:
        await self.transport.aclose()


def exported_regions(rank: RankDescriptor) -> list[tuple[int, int]]:
    """What `rank` exported to READs: its buffers, and its pin table where it publishes one."""
    regions = [(b.addr, b.length) for b in rank.buffers]
    if rank.pins is not None:
        regions.append((rank.pins.addr, rank.pins.nbytes))
    return regions
