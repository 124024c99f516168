"""The one place that talks to UCX, through NIXL's UCX backend.

Registration happens once per buffer. Each engine runs one or more *workers*: a NIXL agent
confined to its own thread. NIXL's UCX backend copies inside the post call on loopback
(cma) and releases the GIL there, so two workers use two cores; confining each agent to
one thread keeps NIXL's thread-unsafe fast path (sync mode NONE) safe. NIXL's own
progress thread stays off: on a 2-core machine it cost half the throughput; progress
is driven here, under a deadline. Notifications (a decode's ticket releases) leave from one
more agent, never from a worker: after one went out on a worker, that worker's next READs from
the peer waited for the peer's progress.

Every address that reaches a READ is checked first against the registered local
regions and the regions the peer exported: raw UCX with a bad address can crash either
side, and a remote key grants access beyond the buffer it was made for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import os
import random
import threading
import time
from typing import TypeVar

import numpy as np
import torch

from pdkv.errors import DeadlineExceeded, PeerLostError, TransferError
from transfer.deadline import Deadline
from transfer.lanes.base import ReadStats
from transfer.lanes.ucx.nixl import load_nixl, quietly, translate
from transfer.lanes.ucx.plan import ReadPlan
from transfer.lanes.ucx.worker import Worker, split
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

T = TypeVar("T")
# After a notification its worker is driven for `Timeouts.notify`, polled at these paces.
_NOTIFY_POLL_S = 0.001  # the first poll after a send; the interval then doubles
_NOTIFY_POLL_MAX_S = 0.02
NOTIFY_FAULTS_ENV = "PDKV_TEST_NOTIFY_FAULTS"  # tests only: see `NotifyFaults`


class NotifyFaults:
    """A fault seam for tests, off unless `PDKV_TEST_NOTIFY_FAULTS` is set: the notifications
    a transport receives are each dropped with chance `drop`, the others held back `hold`
    seconds plus up to `jitter` more (so they may arrive out of order). The spec is
    comma-separated `key=value` pairs of those names and `seed`, e.g. "drop=0.5,jitter=0.05"."""

    def __init__(self, spec: str) -> None:
        fields = {"drop": 0.0, "hold": 0.0, "jitter": 0.0, "seed": 0.0}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key not in fields:
                raise ValueError(f"{NOTIFY_FAULTS_ENV}: unknown key {key!r} (one of {sorted(fields)})")
            fields[key] = float(value)
        if not 0.0 <= fields["drop"] <= 1.0 or fields["hold"] < 0 or fields["jitter"] < 0:
            raise ValueError(f"{NOTIFY_FAULTS_ENV}: drop in [0, 1], hold and jitter >= 0, not {spec!r}")
        self.drop, self.hold, self.jitter = fields["drop"], fields["hold"], fields["jitter"]
        self._rng = random.Random(int(fields["seed"]))
        self._held: list[tuple[float, int, str, bytes]] = []
        self._order = itertools.count()
        self.dropped = self.passed = 0

    @classmethod
    def from_env(cls) -> NotifyFaults | None:
        spec = os.environ.get(NOTIFY_FAULTS_ENV, "")
        return cls(spec) if spec else None

    def filter(self, arrived: dict[str, list[bytes]]) -> dict[str, list[bytes]]:
        """What of `arrived` (and of what was held back before) is delivered now."""
        now = time.monotonic()
        for peer, messages in arrived.items():
            for message in messages:
                if self._rng.random() < self.drop:
                    self.dropped += 1
                    continue
                due = now + self.hold + self._rng.uniform(0.0, self.jitter)
                heapq.heappush(self._held, (due, next(self._order), peer, message))
        out: dict[str, list[bytes]] = {}
        while self._held and self._held[0][0] <= now:
            _, _, peer, message = heapq.heappop(self._held)
            out.setdefault(peer, []).append(message)
            self.passed += 1
        return out


class Regions:
    """Sorted, non-overlapping (addr, length) ranges with a vectorised containment check."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        arr = np.array(sorted(ranges), dtype=np.int64).reshape(-1, 2)
        self.starts, self.ends = arr[:, 0], arr[:, 0] + arr[:, 1]
        if len(arr) > 1 and (self.starts[1:] < self.ends[:-1]).any():
            raise TransferError("registered regions overlap")

    def contains(self, descs: np.ndarray) -> bool:
        """True when every (addr, len, dev) row lies inside one region."""
        if len(descs) == 0:
            return True
        if len(self.starts) == 0:
            return False
        addr, length = descs[:, 0], descs[:, 1]
        idx = np.searchsorted(self.starts, addr, side="right") - 1
        ok = (idx >= 0) & (length > 0)
        safe = np.clip(idx, 0, None)
        return bool((ok & (addr + length <= self.ends[safe])).all())

    @property
    def total(self) -> int:
        return int((self.ends - self.starts).sum())


class UcxTransport:
    """Registered memory, peers, and batched one-sided READs, driven from asyncio."""

    def __init__(
        self,
        name: str,
        workers: int = 1,
        mem_type: str = "DRAM",
        timeouts: Timeouts = Timeouts(),
        notifies: bool = False,
    ) -> None:
        """`notifies`: this transport sends notifications (`notify`), from an agent of their
        own: a notification sent on a READ worker's connection made that worker's next READs
        from the peer wait for the peer's progress.
        `timeouts`: its `connect`, `notify` and `drain`, and its workers' `read_stall`."""
        self._nixl = load_nixl()
        self.name = name
        self.timeouts = timeouts
        self.mem_type = mem_type
        self._workers = [Worker(self._nixl, f"{name}.{i}" if workers > 1 else name, timeouts) for i in range(workers)]
        self._notifier = Worker(self._nixl, f"{name}.notify", timeouts) if notifies else None
        self._next_lane = itertools.cycle(range(workers))
        self._local_ranges: list[tuple[int, int]] = []
        self.local_regions = Regions([])
        self._peers: dict[str, Regions] = {}
        self._closed = False
        self._driving = False  # a timer drives notifications out (`notify`)
        self.notify_faults = NotifyFaults.from_env()  # tests only; None unless set
        self._drive_until = 0.0
        self._drive_interval = _NOTIFY_POLL_S

    # ---- local memory ------------------------------------------------------------------------
    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register `tensors` with UCX on every worker, once, at start-up."""
        tensors = [t for t in tensors if t.numel() > 0]  # 0-row placeholders are skipped
        # NIXL takes one memory kind a call: a GPU pool's slabs and a host pin table go apart.
        kinds = {t.device: [u for u in tensors if u.device == t.device] for t in tensors}
        for worker in self._workers:
            for group in kinds.values():
                worker.executor.submit(worker.register, group).result()
        self._local_ranges += [(t.data_ptr(), t.nbytes) for t in tensors]
        self.local_regions = Regions(self._local_ranges)
        logger.info("%s registered %d buffers, %.1f MiB", self.name, len(tensors), self.local_regions.total / 2**20)

    @property
    def agent_name(self) -> str:
        return self._workers[0].name

    def agent_metadata(self) -> bytes:
        if len(self._workers) != 1:
            raise TransferError("only a single-worker engine exports its metadata")
        worker = self._workers[0]
        return worker.executor.submit(worker.metadata).result()

    # ---- peers -------------------------------------------------------------------------------
    async def add_peer(self, agent_name: str, metadata: bytes, regions: list[tuple[int, int]]) -> None:
        """Load a peer's connection blob on every worker and wire up; remember what it exported.

        All or nothing: a worker that loaded the peer before another failed unloads it.
        """
        if agent_name in self._peers:
            return
        loaded: list[Worker] = []
        try:
            for worker in self._agents():
                await self._load_peer(worker, agent_name, metadata)
                loaded.append(worker)
                # Wire up now rather than inside the first READ, which would wait for it.
                connect = worker.call(functools.partial(worker.connect, agent_name))
                await asyncio.wait_for(connect, self.timeouts.connect)
        except Exception as exc:
            for worker in loaded:
                with contextlib.suppress(Exception):
                    await worker.call(functools.partial(worker.forget_peer, agent_name))
            if isinstance(exc, TransferError):
                raise
            if isinstance(exc, asyncio.TimeoutError):
                raise DeadlineExceeded(f"connecting to {agent_name}: no answer in {self.timeouts.connect:g}s") from exc
            raise PeerLostError(f"cannot connect to {agent_name}: {exc}", agent_name) from exc
        self._peers[agent_name] = Regions(regions)

    async def _load_peer(self, worker: Worker, agent_name: str, metadata: bytes) -> None:
        try:
            loaded = await worker.call(functools.partial(worker.load_peer, metadata))
        except Exception as exc:
            # NIXL says no more than NIXL_ERR_BACKEND: the peer's worker could not be
            # reached with what it published, which is what a dead peer looks like.
            raise PeerLostError(
                f"cannot load the UCX metadata of {agent_name}: {type(exc).__name__}: {exc}", agent_name
            ) from exc
        if loaded != agent_name:
            await worker.call(functools.partial(worker.forget_peer, loaded))
            raise TransferError(f"peer metadata names {loaded!r}, expected {agent_name!r}")

    async def remove_peer(self, agent_name: str) -> None:
        """Drop a peer's connection and keys (after it died or re-registered)."""
        if self._peers.pop(agent_name, None) is None:
            return
        for worker in self._agents():
            try:
                await worker.call(functools.partial(worker.forget_peer, agent_name))
            except Exception as exc:
                logger.warning("removing peer %s: %s", agent_name, exc)

    def _agents(self) -> list[Worker]:
        """Every agent that holds peers: the READ workers and the notifier."""
        return self._workers + ([self._notifier] if self._notifier is not None else [])

    @property
    def workers(self) -> int:
        return len(self._workers)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peer_count(self) -> int:
        return len(self._peers)

    # ---- transfers ---------------------------------------------------------------------------
    async def read(
        self, peer: str, plan: ReadPlan, deadline: Deadline, pieces: int = 1, mem: str | None = None
    ) -> ReadStats:
        """Execute `plan` as batched READs from `peer`, bounded by `deadline`; `mem`: the
        memory kind of its descriptors, by default the transport's.

        With `pieces` > 1 a large plan is cut into up to that many READs posted on as many
        workers at once: each descriptor costs the posting thread microseconds (over cuda_ipc
        most), so one READ is bound by one thread. A caller with
        more workers than concurrent READs asks for pieces; one that already keeps every worker
        busy does not (more, smaller posts then only cost). If the caller is
        cancelled, this still waits for every piece to end (bounded by the same deadline)
        so that no byte lands in pages the caller may hand out again; a piece stops at its
        parts in flight (`_PART_BYTES`), so that wait is short, and one that does not end
        is abandoned with its worker's agent (`Worker`). A piece that fails stops the others.
        """
        regions = self._peers.get(peer)
        if regions is None:
            raise PeerLostError(f"no connection to {peer}", peer)
        if not self.local_regions.contains(plan.local):
            raise TransferError("a local descriptor falls outside the registered buffers")
        if not regions.contains(plan.remote):
            raise TransferError(f"a remote descriptor falls outside what {peer} exported")
        if plan.descriptors == 0:
            return ReadStats(0, 0, 0.0)
        deadline.left(what=f"READ from {peer}: deadline passed before it was posted")
        loop, kind, stop = asyncio.get_running_loop(), mem or self.mem_type, threading.Event()
        futs = [
            loop.run_in_executor(worker.executor, worker.read_blocking, peer, local, remote, kind, deadline, stop)
            for worker, (local, remote) in zip(self._pick_workers(), split(plan, min(pieces, len(self._workers))))
        ]

        def stop_on_failure(piece: asyncio.Future[float]) -> None:  # the READ has failed: the others stop
            if not piece.cancelled() and piece.exception() is not None:
                stop.set()

        for fut in futs:
            fut.add_done_callback(stop_on_failure)
        try:
            results = await asyncio.shield(asyncio.gather(*futs, return_exceptions=True))
        except asyncio.CancelledError:
            stop.set()  # the parts in flight end; nothing more is posted
            await asyncio.wait(futs)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if isinstance(errors[0], (DeadlineExceeded, TransferError)):
                raise errors[0]
            raise translate(errors[0], f"READ from {peer}", peer) from errors[0]
        seconds = max(r for r in results if not isinstance(r, BaseException))
        logger.debug(
            "READ from %s: %d descriptors in %d pieces, %d bytes, %.2f ms on the workers",
            peer,
            plan.descriptors,
            len(futs),
            plan.nbytes,
            seconds * 1e3,
        )
        return ReadStats(plan.nbytes, plan.descriptors, seconds, len(futs))

    async def read_host(self, peer: str, remote_addr: int, local: torch.Tensor, deadline: Deadline) -> None:
        """READ `local.nbytes` of `peer`'s host memory at `remote_addr` into `local` (a
        registered, contiguous host tensor), whatever memory the transport's pool is in."""
        if local.is_cuda or not local.is_contiguous():
            raise TransferError("a host READ needs a registered, contiguous host tensor")
        here = np.array([[local.data_ptr(), local.nbytes, 0]], dtype=np.int64)
        remote = np.array([[remote_addr, local.nbytes, 0]], dtype=np.int64)
        await self.read(peer, ReadPlan(here, remote, local.nbytes), deadline, mem="DRAM")

    def notify(self, messages: list[tuple[str, bytes]]) -> list[str]:
        """Send each (peer, message) as a NIXL notification: no reply, best effort; returns
        the peers without a connection, whose messages are dropped (the others are sent).

        Queued on the notifier's thread (the first worker's, for a transport made without
        one), which sends them and logs what fails; nothing wakes the event loop when they
        are out. They leave only as that agent's worker progresses, so it is driven for a
        short while after (one left behind was seen to be cancelled at close).
        """
        worker = self._sender
        missing = [peer for peer, _ in messages if peer not in self._peers]
        sendable = [(peer, message) for peer, message in messages if peer in self._peers]

        def send() -> None:
            for peer, message in sendable:
                try:
                    worker.send_notif(peer, message)
                except Exception as exc:
                    logger.info("notification to %s: %s", peer, exc)

        if sendable:
            worker.executor.submit(send)
            self._drive_notifications()
        return missing

    def _drive_notifications(self) -> None:
        """Progress the worker for `Timeouts.notify` from now, 1 ms after the send and then
        at doubling intervals (up to 10 ms): a notification on a connection not yet wired
        up waits for the owner's progress too. One timer serves every sender, and each poll
        is queued on the sender's thread without an await: a wait per poll, and a poller per
        release, made the next of back-to-back fetches wait."""
        self._drive_until = time.monotonic() + self.timeouts.notify
        self._drive_interval = _NOTIFY_POLL_S
        if not self._driving:
            self._driving = True
            asyncio.get_running_loop().call_later(_NOTIFY_POLL_S, self._poll_notifications)

    def _poll_notifications(self) -> None:
        if self._closed or time.monotonic() >= self._drive_until:
            self._driving = False
            return
        worker = self._sender
        try:
            worker.executor.submit(quietly, worker.get_new_notifs)
        except RuntimeError:  # its thread was shut down (the interpreter is exiting): nothing to drive
            self._driving = False
            return
        self._drive_interval = min(2 * self._drive_interval, _NOTIFY_POLL_MAX_S)
        asyncio.get_running_loop().call_later(self._drive_interval, self._poll_notifications)

    @property
    def _sender(self) -> Worker:
        return self._notifier or self._workers[0]

    def _pick_workers(self) -> list[Worker]:
        """Every worker, starting from the next in turn, so concurrent READs spread out."""
        first = next(self._next_lane)
        return self._workers[first:] + self._workers[:first]

    async def progress(self, seconds: float = 0.0, pause: float = 0.0) -> dict[str, list[bytes]]:
        """Drive the UCX worker (a target must, for wire-up and emulated GETs): once, or every
        `pause` on its thread for up to `seconds`, until a notification arrives; returns the
        notifications that arrived, by sender."""
        worker = self._workers[0]
        if seconds > 0:
            arrived = await worker.call(functools.partial(worker.drive, seconds, pause))
        else:
            arrived = await worker.call(worker.get_new_notifs)
        return arrived if self.notify_faults is None else self.notify_faults.filter(arrived)

    async def drain_notifications(self) -> None:
        """Let notifications just sent leave (driven for at most `Timeouts.drain`): before
        their peers' connections are dropped, or the agents closed."""
        if self._driving and not self._closed:
            left = min(self.timeouts.drain, self._drive_until - time.monotonic())
            await asyncio.sleep(max(0.0, left) + _NOTIFY_POLL_S)
            self._drive_until = min(self._drive_until, time.monotonic())  # driven: a second drain waits no more

    async def aclose(self) -> None:
        if self._closed:
            return
        await self.drain_notifications()  # the last notifications leave before the agents close
        self._closed = True
        for name in list(self._peers):
            await self.remove_peer(name)
        for worker in self._workers:
            await worker.call(worker.deregister_all)
        for worker in self._agents():
            worker.executor.shutdown(wait=True)
