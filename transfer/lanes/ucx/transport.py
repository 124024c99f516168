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
import ctypes
import functools
import importlib
import itertools
import logging
import os
import platform
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import torch

from pdkv.errors import DeadlineExceeded, PeerLostError, TransferError
from transfer.deadline import Deadline
from transfer.lanes.base import ReadStats
from transfer.lanes.ucx.plan import ReadPlan
from transfer.timeouts import Timeouts

__all__ = [
    "UcxTransport",
    "Regions",
    "configure_ucx_environment",
    "default_workers",
    "load_nixl",
    "protect_owner_heap",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_SLEEP_S = (0.0, 0.0001)
_LATE_GRACE_S = Timeouts.late_read
_STALL_S = Timeouts.read_stall
_NOTIFY_DRIVE_S = 0.1  # how long the worker is driven after a notification, so that it leaves
_NOTIFY_POLL_S = 0.001  # the first poll after a send; the interval then doubles
_NOTIFY_POLL_MAX_S = 0.01


def _quietly(fn: Callable[[], Any]) -> None:
    """Run `fn` on a worker's thread for its side effect; a failure is logged, not raised."""
    try:
        fn()
    except Exception as exc:
        logger.debug("%s: %s", getattr(fn, "__name__", fn), exc)


def configure_ucx_environment() -> None:
    """UCX settings that must be in place before NIXL loads UCX.

    Without InfiniBand devices the bundled libnl crashed every NIXL process at exit
    (seen with nixl-cu12 1.5.1); excluding the ib module avoids that and costs nothing
    where no IB exists. On one GPU without NVLink, UCX disables cuda_ipc zero-copy GET
    and falls back to a slow emulation; turn it on explicitly.

    Between hosts over TCP, a cut link stalls a READ with no error at all (TCP retransmits
    quietly) until the READ's own deadline, a minute later; and a READ abandoned then still
    landed its bytes once the link came back (seen between network namespaces). With TCP
    keepalive probes after 1 s of silence, given up after two unanswered ones, UCX fails the
    endpoint about 3 s after the cut, the READ ends `PeerLostError`, and
    a failed endpoint lands nothing later. The probes are answered by the peer's kernel, so a
    busy owner is not taken for a dead one.
    """
    ib = Path("/sys/class/infiniband")
    if "UCX_MODULES" not in os.environ and not (ib.exists() and any(ib.iterdir())):
        os.environ["UCX_MODULES"] = "^ib"
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    os.environ.setdefault("UCX_TCP_KEEPIDLE", "1s")
    os.environ.setdefault("UCX_TCP_KEEPINTVL", "1s")
    os.environ.setdefault("UCX_TCP_KEEPCNT", "2")


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_OWNER_MMAP_THRESHOLD = 32 << 10


def protect_owner_heap() -> None:
    """In an owner (a process whose memory decodes READ), have glibc serve every allocation
    of 32 KiB or more by a fresh mmap, unless `MALLOC_MMAP_THRESHOLD_` already says otherwise.

    UCX 1.23's TCP transport answers a decode's GET with a request whose datatype field it
    never sets; when the decode dies or its link is cut, purging the queued replies reads
    that field, and heap garbage left in the request pool's chunks (41 KB) segfaulted the
    owner. Chunks that come zeroed from mmap read as a plain buffer with nothing to release.
    Call it before the process's first UCX worker exists."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return
    if ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _OWNER_MMAP_THRESHOLD) != 1:
        logger.warning("mallopt(M_MMAP_THRESHOLD) refused: an owner may crash if a reader dies mid-READ")


def default_workers(mem_type: str = "DRAM") -> int:
    """One worker per core this process may run on, up to 8 for host memory, 4 for GPU memory.

    On the host a worker's thread does the copy (cma), so workers scale with cores; over
    cuda_ipc a worker only posts descriptors for the copy engines, and more than 4 gained
    nothing but a worse p99 (docs/benchmarks.md, "UCX workers: READs on more cores").
    """
    return max(1, min(4 if mem_type == "VRAM" else 8, len(os.sched_getaffinity(0))))


def load_nixl() -> ModuleType:
    """NIXL's Python API (nixl-cu12 or nixl-cu13), with UCX configured first."""
    return _nixl()


@functools.lru_cache(maxsize=1)
def _nixl() -> ModuleType:
    configure_ucx_environment()
    for name in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransferError("NIXL is not installed (pip install nixl-cu12)")


def _translate(exc: BaseException, what: str, peer: str = "") -> TransferError:
    """NIXL's exceptions into the pdkv tree: the one place that sees them."""
    disconnected = getattr(
        importlib.import_module(f"{_nixl().__name__.split('.')[0]}._bindings"), "nixlRemoteDisconnectError", ()
    )
    if isinstance(exc, disconnected):
        return PeerLostError(f"{what}: peer {peer or '?'} disconnected", peer)
    return TransferError(f"{what}: {type(exc).__name__}: {exc}")


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


class _Worker:
    """One NIXL agent and the one thread allowed to call it."""

    def __init__(self, nixl: ModuleType, name: str) -> None:
        self.name = name
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"pdkv-{name}")
        conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent: Any = self.executor.submit(nixl.nixl_agent, name, conf).result()

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def read_blocking(
        self, peer: str, local: np.ndarray, remote: np.ndarray, mem: str, deadline: float, stop: threading.Event
    ) -> float:
        """Run a READ on this worker's thread in parts of at most `_PART_BYTES`, `_PARTS_IN_FLIGHT`
        posted at a time; returns its duration. Once `stop` is set no further part is posted:
        a cancelled fetch ends after the parts in flight, not after the whole room. Whatever
        ends it, it returns or raises only once no part of it is still in flight."""
        t0 = time.perf_counter()
        posted: deque[Any] = deque()
        try:
            for part_local, part_remote in _bounded(local, remote, _PART_BYTES):
                if stop.is_set():
                    raise TransferError(f"READ from {peer} stopped: its fetch was cancelled")
                if len(posted) == _PARTS_IN_FLIGHT:
                    self._finish(peer, posted.popleft(), deadline)
                posted.append(self._post(peer, part_local, part_remote, mem))
            while posted:
                self._finish(peer, posted.popleft(), deadline)
        finally:
            for handle in posted:  # after a failure: waited for (bounded), then released
                self._release(self.agent, handle, peer, "PROC")
        return time.perf_counter() - t0

    def _post(self, peer: str, local: np.ndarray, remote: np.ndarray, mem: str) -> Any:
        """Post one part; its handle (released by `_finish`, or by the caller on a failure)."""
        agent = self.agent
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), peer
        )
        try:
            if agent.transfer(handle) == "ERR":
                raise TransferError(f"READ from {peer} could not be posted")
        except BaseException:
            self._release(agent, handle, peer, "PROC")
            raise
        return handle

    def _finish(self, peer: str, handle: Any, deadline: float) -> None:
        """Wait for a posted part to end (a stall of `_STALL_S` from now counts the peer
        lost), then release it."""
        agent, state = self.agent, "PROC"
        stalled = time.monotonic() + _STALL_S
        try:
            sleep = _POLL_SLEEP_S[0]
            while (state := agent.check_xfer_state(handle)) == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise DeadlineExceeded(f"READ from {peer} still running at its deadline")
                if now > stalled:
                    raise PeerLostError(f"READ from {peer}: a part of it made no end in {_STALL_S:.0f}s", peer)
                time.sleep(sleep)
                sleep = _POLL_SLEEP_S[1]
            if state != "DONE":
                raise TransferError(f"READ from {peer} ended in state {state}")
        finally:
            self._release(agent, handle, peer, state)

    @staticmethod
    def _release(agent: Any, handle: Any, peer: str, state: str) -> None:
        """Release a transfer handle; one still in flight is first waited for (bounded).

        A READ abandoned at its deadline could otherwise land later, in destination pages
        that the failed fetch's caller has handed to another request.
        """
        try:
            handle.release()
            return
        except Exception as exc:  # an in-flight handle may refuse
            logger.warning("transfer to %s still in flight (%s): waiting for it before release", peer, exc)
        end = time.monotonic() + _LATE_GRACE_S
        while state == "PROC" and time.monotonic() < end:
            time.sleep(_POLL_SLEEP_S[1])
            try:
                state = agent.check_xfer_state(handle)
            except Exception:
                break
        try:
            handle.release()
        except Exception as exc:
            logger.error("a READ from %s could not be stopped or released: %s", peer, exc)


# A READ goes out in parts, two in flight: what a worker has posted and not seen end (64 MiB)
# bounds how far a cancelled fetch runs on, and the second part keeps the link busy while
# the first one's end is noticed (over TCP a part ends only as the owner progresses).
_PART_BYTES = 32 << 20
_PARTS_IN_FLIGHT = 2


def _bounded(local: np.ndarray, remote: np.ndarray, limit: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(local, remote) descriptor rows cut into parts of at most `limit` bytes each.

    Rows longer than `limit / 2` are split first, then the rows are cut after each one that
    takes the running total past a multiple of `limit / 2`: no Python loop over the rows (a
    fetch may carry tens of thousands)."""
    lengths = local[:, 1]
    if int(lengths.sum()) <= limit:
        return [(local, remote)]
    half = max(1, limit // 2)
    if int(lengths.max()) > half:
        local, remote = _split_rows(local, half), _split_rows(remote, half)
        lengths = local[:, 1]
    ends = np.cumsum(lengths)
    cuts = np.searchsorted(ends, np.arange(half, int(ends[-1]), half), side="left") + 1
    cuts = np.unique(cuts[cuts < len(local)])
    return list(zip(np.split(local, cuts), np.split(remote, cuts)))


def _split_rows(rows: np.ndarray, limit: int) -> np.ndarray:
    """Each (addr, length, dev) row as rows of at most `limit` bytes, in order."""
    parts = -(-rows[:, 1] // limit)
    out = np.repeat(rows, parts, axis=0)
    first = np.repeat(np.cumsum(parts) - parts, parts)
    offset = (np.arange(len(out)) - first) * limit
    out[:, 0] += offset
    out[:, 1] = np.minimum(np.repeat(rows[:, 1], parts) - offset, limit)
    return out


# A piece of a READ carries at least this many descriptors or bytes: below that, posting
# it on another worker costs more than it saves.
_MIN_PIECE_DESCS = 256
_MIN_PIECE_BYTES = 4 << 20


def _split(plan: ReadPlan, pieces: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Cut `plan` into at most `pieces` pieces of about equal cost (bytes and descriptors)."""
    n = min(pieces, max(1, plan.descriptors // _MIN_PIECE_DESCS, plan.nbytes // _MIN_PIECE_BYTES), plan.descriptors)
    if n <= 1:
        return [(plan.local, plan.remote)]
    # Cost of a descriptor: its bytes plus a fixed posting cost in byte terms, so a piece
    # of many small runs and one of a few large runs take about as long.
    cost = np.cumsum(plan.local[:, 1] + (_MIN_PIECE_BYTES // _MIN_PIECE_DESCS))
    cuts = np.searchsorted(cost, cost[-1] * np.arange(1, n) / n, side="right")
    cuts = np.unique(np.clip(cuts, 1, plan.descriptors - 1))
    return list(zip(np.split(plan.local, cuts), np.split(plan.remote, cuts)))


class UcxTransport:
    """Registered memory, peers, and batched one-sided READs, driven from asyncio."""

    def __init__(
        self,
        name: str,
        workers: int = 1,
        mem_type: str = "DRAM",
        connect_timeout: float = Timeouts.connect,
        notifies: bool = False,
    ) -> None:
        """`notifies`: this transport sends notifications (`notify`), from an agent of their
        own: a notification sent on a READ worker's connection made that worker's next READs
        from the peer wait for the peer's progress (4-10 ms each on loopback, measured)."""
        self._nixl = _nixl()
        self.name = name
        self.connect_timeout = connect_timeout
        self.mem_type = mem_type
        self._workers = [_Worker(self._nixl, f"{name}.{i}" if workers > 1 else name) for i in range(workers)]
        self._notifier = _Worker(self._nixl, f"{name}.notify") if notifies else None
        self._next_lane = itertools.cycle(range(workers))
        self._local_ranges: list[tuple[int, int]] = []
        self._registrations: list[tuple[_Worker, Any]] = []
        self.local_regions = Regions([])
        self._peers: dict[str, Regions] = {}
        self._closed = False
        self._driving = False  # a timer drives notifications out (`notify`)
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
                descs = worker.executor.submit(worker.agent.register_memory, group).result()
                self._registrations.append((worker, descs))
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
        return worker.executor.submit(worker.agent.get_agent_metadata).result()

    # ---- peers -------------------------------------------------------------------------------
    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    async def add_peer(self, agent_name: str, metadata: bytes, regions: list[tuple[int, int]]) -> None:
        """Load a peer's connection blob on every worker and wire up; remember what it exported.

        All or nothing: a worker that loaded the peer before another failed unloads it.
        """
        if agent_name in self._peers:
            return
        loaded: list[_Worker] = []
        try:
            for worker in self._agents():
                await self._load_peer(worker, agent_name, metadata)
                loaded.append(worker)
                # Wire up now rather than inside the first READ (tens of ms there, measured).
                connect = worker.call(functools.partial(worker.agent.make_connection, agent_name))
                await asyncio.wait_for(connect, self.connect_timeout)
        except Exception as exc:
            for worker in loaded:
                with contextlib.suppress(Exception):
                    await worker.call(functools.partial(worker.agent.remove_remote_agent, agent_name))
            if isinstance(exc, TransferError):
                raise
            if isinstance(exc, asyncio.TimeoutError):
                raise DeadlineExceeded(f"connecting to {agent_name}: no answer in {self.connect_timeout}s") from exc
            raise PeerLostError(f"cannot connect to {agent_name}: {exc}", agent_name) from exc
        self._peers[agent_name] = Regions(regions)

    async def _load_peer(self, worker: _Worker, agent_name: str, metadata: bytes) -> None:
        try:
            loaded = await worker.call(lambda: worker.agent.add_remote_agent(metadata))
        except Exception as exc:
            # NIXL says no more than NIXL_ERR_BACKEND: the peer's worker could not be
            # reached with what it published, which is what a dead peer looks like.
            raise PeerLostError(
                f"cannot load the UCX metadata of {agent_name}: {type(exc).__name__}: {exc}", agent_name
            ) from exc
        if (loaded.decode() if isinstance(loaded, bytes) else loaded) != agent_name:
            await worker.call(lambda: worker.agent.remove_remote_agent(loaded))
            raise TransferError(f"peer metadata names {loaded!r}, expected {agent_name!r}")

    async def remove_peer(self, agent_name: str) -> None:
        """Drop a peer's connection and keys (after it died or re-registered)."""
        if self._peers.pop(agent_name, None) is None:
            return
        for worker in self._agents():
            try:
                await worker.call(functools.partial(worker.agent.remove_remote_agent, agent_name))
            except Exception as exc:
                logger.warning("removing peer %s: %s", agent_name, exc)

    def _agents(self) -> list[_Worker]:
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
        workers at once: posting costs about 8 us a descriptor on the posting thread over
        cuda_ipc (measured on an H200), so one READ is bound by one thread. A caller with
        more workers than concurrent READs asks for pieces; one that already keeps every worker
        busy does not (more, smaller posts then only cost). If the caller is
        cancelled, this still waits for every piece to end (bounded by the same deadline)
        so that no byte lands in pages the caller may hand out again; a piece stops at its
        parts in flight (`_PART_BYTES`), so that wait is short.
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
            loop.run_in_executor(worker.executor, worker.read_blocking, peer, local, remote, kind, deadline.at, stop)
            for worker, (local, remote) in zip(self._pick_workers(), _split(plan, min(pieces, len(self._workers))))
        ]
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
            raise _translate(errors[0], f"READ from {peer}", peer) from errors[0]
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

    def notify(self, messages: list[tuple[str, bytes]]) -> None:
        """Send each (peer, message) as a NIXL notification: no reply, best effort.

        Queued on the notifier's thread (the first worker's, for a transport made without
        one), which sends them and logs what fails; nothing wakes the event loop when they
        are out. They leave only as that agent's worker progresses, so it is driven for a
        short while after (one left behind was seen to be cancelled at close). A peer
        without a connection raises `PeerLostError`; the others are sent.
        """
        worker = self._sender
        missing = [peer for peer, _ in messages if peer not in self._peers]
        sendable = [(peer, message) for peer, message in messages if peer in self._peers]

        def send() -> None:
            for peer, message in sendable:
                try:
                    worker.agent.send_notif(peer, message)
                except Exception as exc:
                    logger.info("notification to %s: %s", peer, exc)

        if sendable:
            worker.executor.submit(send)
            self._drive_notifications()
        if missing:
            raise PeerLostError(f"no connection to {missing[0]}", missing[0])

    def _drive_notifications(self) -> None:
        """Progress the worker for `_NOTIFY_DRIVE_S` from now, 1 ms after the send and then
        at doubling intervals (up to 10 ms): a notification on a connection not yet wired
        up waits for the owner's progress too. One timer serves every sender, and each poll
        is queued on the sender's thread without an await: a wait per poll, and a poller per
        release, made the next fetch wait (measured, back-to-back GPU-lane fetches)."""
        self._drive_until = time.monotonic() + _NOTIFY_DRIVE_S
        self._drive_interval = _NOTIFY_POLL_S
        if not self._driving:
            self._driving = True
            asyncio.get_running_loop().call_later(_NOTIFY_POLL_S, self._poll_notifications)

    def _poll_notifications(self) -> None:
        if self._closed or time.monotonic() >= self._drive_until:
            self._driving = False
            return
        worker = self._sender
        worker.executor.submit(_quietly, worker.agent.get_new_notifs)
        self._drive_interval = min(2 * self._drive_interval, _NOTIFY_POLL_MAX_S)
        asyncio.get_running_loop().call_later(self._drive_interval, self._poll_notifications)

    @property
    def _sender(self) -> _Worker:
        return self._notifier or self._workers[0]

    def _pick_workers(self) -> list[_Worker]:
        """Every worker, starting from the next in turn, so concurrent READs spread out."""
        first = next(self._next_lane)
        return self._workers[first:] + self._workers[:first]

    async def progress(self) -> dict[str, list[bytes]]:
        """Drive the UCX worker once (a target must, for wire-up and emulated GETs); returns
        the notifications that arrived, by sender."""
        worker = self._workers[0]
        return await worker.call(worker.agent.get_new_notifs)

    async def aclose(self) -> None:
        if self._closed:
            return
        if self._driving:  # the last notifications leave before the agents close
            await asyncio.sleep(max(0.0, self._drive_until - time.monotonic()) + _NOTIFY_POLL_S)
        self._closed = True
        for name in list(self._peers):
            await self.remove_peer(name)
        for worker, descs in self._registrations:
            try:
                await worker.call(functools.partial(worker.agent.deregister_memory, descs))
            except Exception as exc:
                logger.warning("deregistering memory: %s", exc)
        for worker in self._agents():
            worker.executor.shutdown(wait=True)
