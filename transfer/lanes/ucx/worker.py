"""A UCX worker: one NIXL agent, the one thread allowed to call it, and how a READ is cut
into the parts it posts."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, TypeVar

import numpy as np

from pdkv.errors import DeadlineExceeded, PeerLostError, TransferError
from transfer.deadline import Deadline
from transfer.lanes.ucx.nixl import ucx_backend_params
from transfer.lanes.ucx.plan import ReadPlan
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_SLEEP_S = (0.0, 0.0001)


class Worker:
    """One NIXL agent and the one thread allowed to call it. `timeouts`: its `read_stall`
    counts a peer lost, its `late_read` bounds the wait for a READ abandoned at its deadline.

    A READ part that ends other than DONE may still be live in UCX, whatever NIXL's release
    said: UCX cannot cancel a GET, and over TCP the answer to one sent before a link cut
    arrives once the link is back, to be copied into the part's destination whenever this
    agent's UCX worker is next progressed. So such a READ ends only once its agent has been
    dropped (`_renew`): never called again, and destroyed with its UCX worker, endpoints and
    sockets. A new one is made on the next use, with the memory registered anew (kept here);
    the old one's peers are refused as lost until connected again (`_reload`). Others reach
    the agent only on this thread, through the methods below or `on_thread`, never through a
    reference taken earlier."""

    def __init__(self, nixl: ModuleType, name: str, timeouts: Timeouts) -> None:
        self.name = name
        self.read_stall, self.late_read = timeouts.read_stall, timeouts.late_read
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"pdkv-{name}")
        self._nixl = nixl
        self._groups: list[tuple[list[Any], Any]] = []  # (tensors, NIXL's registration) per register
        self._peers: set[str] = set()  # loaded peers by agent name
        self._unloaded: set[str] = set()  # peers of a dropped agent, not in the new one
        self._tainted = False  # a part of the READ under way ended other than DONE
        self.renewals = 0  # agents replaced after such a READ
        self.agent: Any = self.executor.submit(_agent, nixl, name).result()

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def on_thread(self, method: str, *args: Any, peer: str | None = None) -> Any:
        """The agent's `method`, of the agent current when the call runs on this thread;
        `peer`: the peer it concerns, loaded into a new agent first."""
        agent = self._current()
        if peer is not None:
            self._reload(agent, peer)
        return getattr(agent, method)(*args)

    # ---- what the agent holds, kept for a renewed one (each called on this thread) -----------
    def register(self, tensors: list[Any]) -> None:
        self._groups.append((tensors, self._current().register_memory(tensors)))

    def deregister_all(self) -> None:
        if self.agent is None:  # dropped: its registrations went with it
            self._groups.clear()
        while self._groups:
            _, descs = self._groups.pop()
            try:
                self.agent.deregister_memory(descs)
            except Exception as exc:
                logger.warning("%s: deregistering memory: %s", self.name, exc)

    def load_peer(self, metadata: bytes) -> str:
        """Load a peer's connection blob and keys; the agent name it gives."""
        loaded = self._current().add_remote_agent(metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._peers.add(name)
        self._unloaded.discard(name)
        return name

    def forget_peer(self, name: str) -> None:
        self._peers.discard(name)
        if self.agent is not None and name not in self._unloaded:  # a dropped one took its peers with it
            self.agent.remove_remote_agent(name)
        self._unloaded.discard(name)

    def _reload(self, agent: Any, peer: str) -> None:
        """Refuse a peer that a dropped agent held until the transport connects it again.

        Loading a peer waits for its TCP connect, minutes where its host is cut off, and this
        thread serves every READ of the worker: so the new agent loads none by itself. The
        caller takes the peer as lost, drops its connection and connects it anew (`add_peer`)."""
        if peer in self._unloaded:
            raise PeerLostError(f"{peer}: its connection went with a dropped UCX agent: connect again", peer)

    def read_blocking(
        self, peer: str, local: np.ndarray, remote: np.ndarray, mem: str, deadline: Deadline, stop: threading.Event
    ) -> float:
        """Run a READ on this worker's thread in parts of at most `_PART_BYTES`, `_PARTS_IN_FLIGHT`
        posted at a time; returns its duration. Once `stop` is set no further part is posted,
        and parts still in flight get `_STOP_GRACE_S` to end DONE; one that does not is
        abandoned with the agent (`_renew`), so that a cancelled fetch does not wait for a part
        that a cut link holds (`read_stall`). Whatever ends it, it returns or raises only once
        no part of it can land any more."""
        t0 = time.perf_counter()
        posted: deque[Any] = deque()
        grace = _StopGrace(stop)
        try:
            for part_local, part_remote in bounded(local, remote, _PART_BYTES, _PART_ROWS):
                if stop.is_set():
                    raise TransferError(f"READ from {peer} stopped: its fetch was cancelled")
                if len(posted) == _PARTS_IN_FLIGHT:
                    self._finish(peer, posted.popleft(), deadline, grace)
                posted.append(self._post(peer, part_local, part_remote, mem))
            while posted:
                self._finish(peer, posted.popleft(), deadline, grace)
        except BaseException as exc:
            # The finished frames below hold the agent and handles: cleared, so that `_renew`
            # can destroy it while the error travels on (a receiver may keep it for long).
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            while posted:  # after a failure: waited for (bounded; stopped: the grace), then released
                handle = posted.popleft()
                state = self._settle(handle, grace) if stop.is_set() else "PROC"
                self._tainted |= state != "DONE"
                self._release(self.agent, handle, peer, state, wait=not stop.is_set())
            if self._tainted:
                self._renew(peer)
        return time.perf_counter() - t0

    def _post(self, peer: str, local: np.ndarray, remote: np.ndarray, mem: str) -> Any:
        """Post one part; its handle (released by `_finish`, or by the caller on a failure)."""
        agent = self._current()
        self._reload(agent, peer)
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), peer
        )
        try:
            if agent.transfer(handle) == "ERR":
                raise TransferError(f"READ from {peer} could not be posted")
        except BaseException:
            self._tainted = True  # some of its requests may have gone out
            self._release(agent, handle, peer, "PROC")
            raise
        return handle

    def _finish(self, peer: str, handle: Any, deadline: Deadline, grace: _StopGrace) -> None:
        """Wait for a posted part to end (a stall of `read_stall` from now counts the peer
        lost; a stop ends the wait once its grace has passed), then release it."""
        agent, state = self.agent, "PROC"
        stalled = Deadline.after(self.read_stall)
        try:
            sleep = _POLL_SLEEP_S[0]
            while (state := agent.check_xfer_state(handle)) == "PROC":
                if deadline.passed:
                    raise DeadlineExceeded(f"READ from {peer} still running at its deadline")
                if stalled.passed:
                    raise PeerLostError(f"READ from {peer}: a part of it made no end in {self.read_stall:g}s", peer)
                if grace.passed():
                    raise TransferError(f"READ from {peer} stopped: its fetch was cancelled")
                time.sleep(sleep)
                sleep = _POLL_SLEEP_S[1]
            if state != "DONE":
                raise TransferError(f"READ from {peer} ended in state {state}")
        finally:
            self._tainted |= state != "DONE"
            self._release(agent, handle, peer, state, wait=not grace.stop.is_set())

    def _settle(self, handle: Any, grace: _StopGrace) -> str:
        """A stopped READ's part in flight: its state once it ended or the grace passed."""
        while True:
            try:
                state = str(self.agent.check_xfer_state(handle))
            except Exception:
                return "ERR"
            if state != "PROC" or grace.passed():
                return state
            time.sleep(_POLL_SLEEP_S[1])

    def _release(self, agent: Any, handle: Any, peer: str, state: str, wait: bool = True) -> None:
        """Release a transfer handle; one still in flight that refuses is first waited for
        (`late_read`) unless `wait` is false (a stopped READ: its agent is dropped after)."""
        try:
            handle.release()
            return
        except Exception as exc:  # an in-flight handle may refuse
            if not wait:
                logger.info("transfer from %s still in flight (%s): abandoned with its agent", peer, exc)
                return
            logger.warning("transfer to %s still in flight (%s): waiting for it before release", peer, exc)
        late = Deadline.after(self.late_read)
        while state == "PROC" and not late.passed:
            time.sleep(_POLL_SLEEP_S[1])
            try:
                state = agent.check_xfer_state(handle)
            except Exception:
                break
        try:
            handle.release()
        except Exception as exc:
            logger.error("a READ from %s could not be stopped or released: %s", peer, exc)

    def _renew(self, peer: str) -> None:
        """Drop the agent after a READ part from `peer` ended other than DONE (or before its
        end): destroyed here, unprogressed since; a new one, loaded with what the old one held,
        is made on the agent's next use (`_current`), which is off the failed READ's path."""
        old, self.agent, self._tainted = self.agent, None, False
        if old is None:
            return
        t0 = time.perf_counter()
        core = getattr(old, "agent", None)  # NIXL's own agent under its Python one
        del old
        if core is not None and sys.getrefcount(core) > 2:
            gc.collect()  # a cycle may hold a handle of it, which holds it
        held = sys.getrefcount(core) - 2 if core is not None else 0
        del core  # destroyed here unless held: its UCX worker, endpoints and sockets with it
        self.renewals += 1
        if held > 0:
            logger.warning("%s: the dropped agent is still held (%d): it is never called again", self.name, held)
        logger.info(
            "%s: UCX agent dropped after a READ from %s ended unfinished (%.1f ms)",
            self.name,
            peer,
            (time.perf_counter() - t0) * 1e3,
        )

    def _current(self) -> Any:
        """The agent, made anew where `_renew` dropped it: memory registered, no peer loaded
        (`_reload`)."""
        if self.agent is not None:
            return self.agent
        try:
            agent = _agent(self._nixl, self.name)
            self._groups = [(tensors, agent.register_memory(tensors)) for tensors, _ in self._groups]
        except Exception as exc:
            raise TransferError(f"{self.name}: a new UCX agent could not be made: {exc}") from exc
        self.agent, self._unloaded = agent, set(self._peers)
        return agent


class _StopGrace:
    """How long a stopped READ's parts in flight may still end DONE: on a live link they end
    in milliseconds, and a part that ends DONE costs no agent (a new one drops every peer the
    worker had loaded, so their next READ fails once). Counted from when the stop is seen."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self._by: Deadline | None = None

    def passed(self) -> bool:
        if not self.stop.is_set():
            return False
        if self._by is None:
            self._by = Deadline.after(_STOP_GRACE_S)
        return self._by.passed


def _agent(nixl: ModuleType, name: str) -> Any:
    """A NIXL agent with the UCX backend, on the NICs this process was given (`use_ucx_devices`)."""
    agent = nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=[]))
    params = ucx_backend_params()
    try:
        agent.create_backend("UCX", params)
    except Exception as exc:  # an unknown device, most often
        raise TransferError(f"NIXL's UCX backend refused {params or 'its defaults'}: {exc}") from exc
    return agent


# A READ goes out in parts, two in flight: what a worker has posted and not seen end (64 MiB)
# bounds how far a cancelled fetch runs on, and the second part keeps the link busy while
# the first one's end is noticed (over TCP a part ends only as the owner progresses).
_PART_BYTES = 32 << 20
# A descriptor costs microseconds to post whatever its size: parts are bounded by their count
# too, so that a cancelled fetch of tiny (one-token) pages stops as soon as one of large pages.
_PART_ROWS = 4096
_PARTS_IN_FLIGHT = 2
# Within a link cut's bound (docs/between-hosts.md: the decode's Failed ~3 s after the cut, asserted 4.5 s).
_STOP_GRACE_S = 0.5


def bounded(
    local: np.ndarray, remote: np.ndarray, limit: int, max_rows: int | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(local, remote) descriptor rows cut into parts of at most `limit` bytes (and
    `max_rows` rows) each.

    Rows longer than `limit / 2` are split first, then the rows are cut after each one that
    takes the running total past a multiple of `limit / 2`, and every `max_rows` rows: no
    Python loop over the rows (a fetch may carry tens of thousands)."""
    lengths = local[:, 1]
    if int(lengths.sum()) <= limit and (max_rows is None or len(local) <= max_rows):
        return [(local, remote)]
    half = max(1, limit // 2)
    if int(lengths.max()) > half:
        local, remote = _split_rows(local, half), _split_rows(remote, half)
        lengths = local[:, 1]
    ends = np.cumsum(lengths)
    cuts = np.searchsorted(ends, np.arange(half, int(ends[-1]), half), side="left") + 1
    if max_rows is not None:
        cuts = np.concatenate([cuts, np.arange(max_rows, len(local), max_rows)])
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


def split(plan: ReadPlan, pieces: int) -> list[tuple[np.ndarray, np.ndarray]]:
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
