"""Owners of one fetch whose lane reads several as one (`Lane.batch`), read together.

Reading by claims, each owner's task reads its layers as they become ready. Where every
layer of several owners on one such lane is ready at once (a room that was finished when
it was claimed), their reads go out as one: a read of every layer of a room runs near the
copy limit where several smaller ones do not.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from transfer.deadline import Deadline
from transfer.lanes.base import Lane, Peer, ReadStats

_Joined = tuple[Peer, np.ndarray, np.ndarray, Deadline, "asyncio.Future[ReadStats]"]


class ReadBatch:
    """The owners of one fetch on `lane` whose layers were all ready at once, read as ONE.

    Each owner's task either reads through its slot (its whole range was ready when it was
    claimed) or withdraws (it reads batch by batch as layers come). The read goes out once
    every `expected` owner has done one or the other. `dst_below`: the destination page ids
    are known to lie below it (checked against the pool).
    """

    def __init__(self, lane: Lane[Any], expected: int, dst_below: int) -> None:
        self._lane, self._expected, self._dst_below = lane, expected, dst_below
        self._pending: list[_Joined] = []
        self._launches: set[asyncio.Task[None]] = set()

    def slot(self) -> BatchSlot:
        """One owner's place: read through it once, or close it to withdraw."""
        return BatchSlot(self)

    async def _read(self, peer: Peer, src: np.ndarray, dst: np.ndarray, deadline: Deadline) -> ReadStats:
        done: asyncio.Future[ReadStats] = asyncio.get_running_loop().create_future()
        self._pending.append((peer, src, dst, deadline, done))
        self._flush_if_complete()
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:  # the read may be out: wait for it to end
            await asyncio.wait([done])
            raise

    def _withdraw(self) -> None:
        self._expected -= 1
        self._flush_if_complete()

    def _flush_if_complete(self) -> None:
        if self._pending and len(self._pending) >= self._expected:
            joined, self._pending = self._pending, []
            task = asyncio.ensure_future(self._launch(joined))
            self._launches.add(task)
            task.add_done_callback(self._launches.discard)

    async def _launch(self, joined: list[_Joined]) -> None:
        joined.sort(key=lambda j: j[0].cp_rank)
        try:
            stats = await self._read_joined(joined)
        except BaseException as exc:
            for *_, done in joined:
                if not done.done():
                    done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (*_, done), s in zip(joined, stats):
            if not done.done():
                done.set_result(s)

    async def _read_joined(self, joined: list[_Joined]) -> list[ReadStats]:
        """Each joined owner's stats (by CP rank): one read where they share their pages and
        the lane batches them, each owner's share of the time its share of the bytes."""
        _, src, dst, _, _ = joined[0]
        shared = all(np.array_equal(j[1], src) and np.array_equal(j[2], dst) for j in joined[1:])
        batch = self._lane.batch(tuple(j[0] for j in joined)) if shared else None
        if batch is None:  # owners whose pages differ: each its own read, at once
            reads = [self._lane.read(p, p.layers, s, d, dl) for p, s, d, dl, _ in joined]
            stats = await asyncio.gather(*reads, return_exceptions=True)  # every read ended
            for s in stats:
                if isinstance(s, BaseException):
                    raise s
            return [s for s in stats if isinstance(s, ReadStats)]
        seconds = await batch.read(src, dst, self._dst_below)
        per_byte = seconds / max(1, batch.page_bytes)
        share = {id(p): b for p, b in batch.shares}
        return [ReadStats(share[id(j[0])] * src.size, 0, share[id(j[0])] * per_byte) for j in joined]


class BatchSlot:
    """One owner's share of a `ReadBatch`: used once by `read`, or given up by `close`."""

    def __init__(self, batch: ReadBatch) -> None:
        self._batch: ReadBatch | None = batch

    async def read(self, peer: Peer, src: np.ndarray, dst: np.ndarray, deadline: Deadline) -> ReadStats:
        """Every layer of `peer`, read with the other owners of the batch."""
        batch, self._batch = self._batch, None
        if batch is None:
            raise RuntimeError("a batch slot reads once")
        return await batch._read(peer, src, dst, deadline)

    def close(self) -> None:
        """Withdraw from the batch if not read through (idempotent)."""
        batch, self._batch = self._batch, None
        if batch is not None:
            batch._withdraw()
