"""A UCX worker: one NIXL agent, the one thread allowed to call it, and how a READ is cut
into the parts it posts."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
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
    counts a peer lost, its `late_read` bounds the wait for a READ abandoned at its deadline."""

    def __init__(self, nixl: ModuleType, name: str, timeouts: Timeouts) -> None:
        self.name = name
        self.read_stall, self.late_read = timeouts.read_stall, timeouts.late_read
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"pdkv-{name}")
        self.agent: Any = self.executor.submit(_agent, nixl, name).result()

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def read_blocking(
        self, peer: str, local: np.ndarray, remote: np.ndarray, mem: str, deadline: Deadline, stop: threading.Event
    ) -> float:
        """Run a READ on this worker's thread in parts of at most `_PART_BYTES`, `_PARTS_IN_FLIGHT`
        posted at a time; returns its duration. Once `stop` is set no further part is posted:
        a cancelled fetch ends after the parts in flight, not after the whole room. Whatever
        ends it, it returns or raises only once no part of it is still in flight."""
        t0 = time.perf_counter()
        posted: deque[Any] = deque()
        try:
            for part_local, part_remote in bounded(local, remote, _PART_BYTES, _PART_ROWS):
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

    def _finish(self, peer: str, handle: Any, deadline: Deadline) -> None:
        """Wait for a posted part to end (a stall of `read_stall` from now counts the peer
        lost), then release it."""
        agent, state = self.agent, "PROC"
        stalled = Deadline.after(self.read_stall)
        try:
            sleep = _POLL_SLEEP_S[0]
            while (state := agent.check_xfer_state(handle)) == "PROC":
                if deadline.passed:
                    raise DeadlineExceeded(f"READ from {peer} still running at its deadline")
                if stalled.passed:
                    raise PeerLostError(f"READ from {peer}: a part of it made no end in {self.read_stall:g}s", peer)
                time.sleep(sleep)
                sleep = _POLL_SLEEP_S[1]
            if state != "DONE":
                raise TransferError(f"READ from {peer} ended in state {state}")
        finally:
            self._release(agent, handle, peer, state)

    def _release(self, agent: Any, handle: Any, peer: str, state: str) -> None:
        """Release a transfer handle; one still in flight is first waited for (`late_read`).

        A READ abandoned at its deadline could otherwise land later, in destination pages
        that the failed fetch's caller has handed to another request.
        """
        try:
            handle.release()
            return
        except Exception as exc:  # an in-flight handle may refuse
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
