"""A lane over numpy memory (`transfer.lanes.base.Lane`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.fakes.memory import PAGE, SOURCE
from tests.fakes.timeline import Awaits, Timeline
from transfer.deadline import Deadline
from transfer.lanes.base import ReadStats, Watch
from transfer.metadata import RankDescriptor


@dataclass
class FakePeer:
    cp_rank: int
    layers: range
    closed: bool = False


@dataclass
class FakeBatch:
    """A `Batch`: its peers' every layer read by one `FakeLane` read."""

    lane: FakeLane
    peers: tuple[FakePeer, ...]

    @property
    def shares(self) -> tuple[tuple[FakePeer, int], ...]:
        return tuple((p, PAGE * len(p.layers)) for p in self.peers)

    @property
    def page_bytes(self) -> int:
        return sum(b for _, b in self.shares)

    def read(self, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None) -> Awaitable[float]:
        return self.lane.read_batch(self, src, dst, dst_below, watch)


class FakeLane:
    """A lane over numpy memory. A read of cp rank r waits on `gates[r]` (if any), then
    fails with `errors[r]` (if any) or copies. Cancelled, it finishes its in-flight copy
    before raising, which takes `cancel_turns` turns of the loop (`drain`: it first waits
    for its gate, as a real READ runs to its end). No byte lands once a read has ended."""

    def __init__(self, timeline: Timeline, mem: np.ndarray, *, batches: bool = False, name: str = "fake") -> None:
        self.name, self.batches = name, batches
        self.timeline, self.mem = timeline, mem
        self.gates: dict[int, asyncio.Event] = {}
        self.errors: dict[int, BaseException] = {}
        self.drain = False
        self.cancel_turns = 20  # loop turns a cancelled read's in-flight copy takes to end
        self.points: Awaits | None = None
        self.in_flight = 0
        self.reads: list[tuple[int, range]] = []  # (cp rank, layers) of each plain read
        self.batch_calls: list[tuple[int, ...]] = []  # cp ranks of each batch read
        self.heard: asyncio.Event | None = None  # set: a read's end reaches its task only then

    def reach(self, rank: RankDescriptor) -> str | None:
        return None

    async def open(self, rank: RankDescriptor, pairs: Any) -> FakePeer:
        return FakePeer(rank.cp_rank, range(rank.layer_start, rank.layer_end))

    async def close(self, peer: FakePeer) -> None:
        peer.closed = True

    def batch(self, peers: tuple[FakePeer, ...]) -> FakeBatch | None:
        return FakeBatch(self, peers) if self.batches else None

    def prime(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def read(
        self, peer: FakePeer, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline
    ) -> ReadStats:
        assert not peer.closed
        assert peer.layers.start <= layers.start < layers.stop <= peer.layers.stop, (peer, layers)
        self.reads.append((peer.cp_rank, layers))
        return await self._move([(peer.cp_rank, layers)], src, dst)

    async def read_batch(
        self, batch: FakeBatch, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None
    ) -> float:
        assert int(dst.max()) < dst_below
        assert not any(p.closed for p in batch.peers)
        self.batch_calls.append(tuple(p.cp_rank for p in batch.peers))
        return (await self._move([(p.cp_rank, p.layers) for p in batch.peers], src, dst, watch)).seconds

    async def _move(
        self, parts: list[tuple[int, range]], src: np.ndarray, dst: np.ndarray, watch: Watch | None = None
    ) -> ReadStats:
        assert src.shape == dst.shape and src.dtype == dst.dtype == np.int64
        cps = tuple(cp for cp, _ in parts)
        gates = [self.gates[cp] for cp in cps if cp in self.gates]
        if self.points is not None and (point := self.points.reach("read", *cps)) is not None:
            gates.append(point)
        self.timeline.add("read", cps, tuple((cp, layers.start, layers.stop) for cp, layers in parts))
        self.in_flight += 1
        try:
            try:
                for gate in gates:
                    await gate.wait()
                if not gates:
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                if self.drain:
                    await _uncancellable(gates)
                for _ in range(self.cancel_turns):  # the in-flight copy takes a while to end
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(0)
                self._land(parts, src, dst)  # the in-flight copy ends before the read does
                self.timeline.add("read_cancelled", cps)
                raise
            error = next((self.errors[cp] for cp in cps if cp in self.errors), None)
            if error is not None:
                self.timeline.add("read_failed", cps)
                raise error
            self._land(parts, src, dst)
            if watch is not None:  # as the GPU lane's waiting thread does, before its loop hears
                self.timeline.add("told", watch.landed())
            if self.heard is not None:  # the loop hears of the landing only once it is set
                await _uncancellable([self.heard])
        finally:
            self.in_flight -= 1
            self.timeline.add("read_end", cps)
        nbytes = sum(len(layers) for _, layers in parts) * src.size * PAGE
        return ReadStats(nbytes, 0, 1e-6)

    def _land(self, parts: list[tuple[int, range]], src: np.ndarray, dst: np.ndarray) -> None:
        for cp, layers in parts:
            for layer in layers:
                self.mem[layer, dst] = SOURCE[cp][layer, src]
            self.timeline.add("landed", cp, layers.start, layers.stop)


async def _uncancellable(gates: list[asyncio.Event]) -> None:
    """Wait for every gate, whatever cancels us meanwhile."""
    for gate in gates:
        while not gate.is_set():
            try:
                await gate.wait()
            except asyncio.CancelledError:
                continue
