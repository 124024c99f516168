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
from types import FrameType, ModuleType
from typing import Any, TypeVar

import numpy as np

from pdkv.errors import DeadlineExceeded, PdkvError, PeerLostError, TransferError
from transfer.deadline import Deadline
from transfer.lanes.ucx.nixl import ucx_backend_params
from transfer.lanes.ucx.plan import ReadPlan
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_SLEEP_S = (0.0, 0.0001)


class Worker:
    """One NIXL agent and the one thread allowed to call it (every method below runs there).

    A READ part that ends other than DONE may still be live in UCX, whatever NIXL's release
    says: UCX cannot cancel a GET, and over TCP the answer to one sent before a link cut
    arrives once the link is back, to be copied into the part's destination on this agent's
    next progress (pages its fetch's caller has long handed out again). So such a READ ends
    only once its agent is destroyed (`_drop`), with its UCX worker, endpoints and sockets.
    The next call makes a new agent, registers the same memory and loads each peer again on
    its first use, save the peer of a READ abandoned as lost (`read_stall`): that one is
    refused until the transport connects it anew. `timeouts`: its `read_stall` counts a peer
    lost."""

    def __init__(self, nixl: ModuleType, name: str, timeouts: Timeouts) -> None:
        self.name = name
        self.read_stall = timeouts.read_stall
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"pdkv-{name}")
        self.drops = 0  # agents destroyed under an abandoned READ
        self._nixl = nixl
        self._agent: Any = None
        self._groups: list[list[Any]] = []  # tensors registered, for a new agent
        self._registrations: list[Any] = []  # the current agent's
        self._metadata: dict[str, bytes] = {}  # the peers loaded, for a new agent
        self._loaded: set[str] = set()  # peers the current agent holds
        self._lost: set[str] = set()  # peers of an abandoned READ, until loaded anew
        self.executor.submit(self._current).result()

    async def call(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn)

    # ---- what the agent holds (each on this thread) -------------------------------------------
    def register(self, tensors: list[Any]) -> None:
        self._registrations.append(self._current().register_memory(tensors))
        self._groups.append(tensors)

    def deregister_all(self) -> None:
        for descs in self._registrations if self._agent is not None else []:
            try:
                self._agent.deregister_memory(descs)
            except Exception as exc:
                logger.warning("%s: deregistering memory: %s", self.name, exc)
        self._registrations.clear()
        self._groups.clear()

    def metadata(self) -> bytes:
        return bytes(self._current().get_agent_metadata())

    def load_peer(self, metadata: bytes) -> str:
        """Load a peer's connection blob and keys; the agent name it gives."""
        loaded = self._current().add_remote_agent(metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        self._metadata[name] = metadata
        self._loaded.add(name)
        self._lost.discard(name)
        return name

    def connect(self, peer: str) -> None:
        self._agent_for(peer).make_connection(peer)

    def forget_peer(self, name: str) -> None:
        if name in self._loaded:
            self._loaded.discard(name)
            self._agent.remove_remote_agent(name)
        self._metadata.pop(name, None)
        self._lost.discard(name)

    def send_notif(self, peer: str, message: bytes) -> None:
        self._agent_for(peer).send_notif(peer, message)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self._current().get_new_notifs()
        return notifs

    def drive(self, seconds: float, pause: float) -> dict[str, list[bytes]]:
        """Progress every `pause` for up to `seconds`, until a notification arrives (the
        notifications): the caller's loop wakes once, not once a tick."""
        end = time.monotonic() + seconds
        while True:
            notifs = self.get_new_notifs()
            if notifs or time.monotonic() + pause > end:
                return notifs
            time.sleep(pause)

    def _current(self) -> Any:
        """The agent, made anew (its memory registered again) after `_drop`."""
        if self._agent is None:
            try:
                agent = _agent(self._nixl, self.name)
                self._registrations = [agent.register_memory(group) for group in self._groups]
            except Exception as exc:
                raise TransferError(f"{self.name}: a UCX agent could not be made: {exc}") from exc
            self._agent = agent
        return self._agent

    def _agent_for(self, peer: str) -> Any:
        """The agent, holding `peer`: loaded again into a new agent on its first use."""
        agent = self._current()
        if peer in self._loaded:
            return agent
        if peer in self._lost:
            raise PeerLostError(f"{peer}: a READ from it was abandoned with its UCX agent: connect again", peer)
        metadata = self._metadata.get(peer)
        if metadata is None:
            raise PeerLostError(f"{self.name} holds no connection to {peer}", peer)
        agent.add_remote_agent(metadata)
        agent.make_connection(peer)
        self._loaded.add(peer)
        return agent

    def _drop(self, peer: str, why: BaseException, lost: bool) -> None:
        """Destroy the agent, abandoning what it has in flight: no byte of it lands later.
        `lost`: `peer` made no end or its endpoint failed (a cut link, most likely): refused,
        rather than loaded again for READs that would only stall, until the transport
        connects it anew."""
        agent, self._agent = self._agent, None
        self._registrations, self._loaded = [], set()
        if lost:
            self._lost.add(peer)
        self.drops += 1
        t0 = time.perf_counter()
        core = getattr(agent, "agent", None)  # NIXL's C++ agent, under its Python one
        del agent
        if core is not None and sys.getrefcount(core) > 2:
            gc.collect(1)  # a young cycle may hold a transfer handle, which holds the agent; a full one took 1.4 s
        held = sys.getrefcount(core) - 2 if core is not None else 0
        if held > 0:
            logger.error("%s: an abandoned UCX agent is still held (%d, by %s)", self.name, held, _holders(core))
        del core  # destroyed here unless still held
        took_ms = (time.perf_counter() - t0) * 1e3
        what = repr(why)  # a string: a record kept by a handler must not hold the error and its frames
        logger.warning("%s: UCX agent dropped, a READ from %s unfinished: %s (%.1f ms)", self.name, peer, what, took_ms)

    # ---- READs ---------------------------------------------------------------------------------
    def read_blocking(
        self, peer: str, local: np.ndarray, remote: np.ndarray, mem: str, deadline: Deadline, stop: threading.Event
    ) -> float:
        """Run a READ on this worker's thread in parts of at most `_PART_BYTES`, `_PARTS_IN_FLIGHT`
        posted at a time; returns its duration. Once `stop` is set no further part is posted,
        and the parts in flight get `_STOP_GRACE_S` to end: a cancelled fetch ends after them,
        not after the whole room. Whatever ends it, it returns or raises only once no part of
        it can land any more: a part that did not end DONE is abandoned with the agent."""
        t0 = time.perf_counter()
        try:
            self._read_parts(peer, local, remote, mem, deadline, stop)
        except _Abandoned as abandoned:
            error = abandoned.error
            # Their frames hold the parts' handles, which hold the agent: `_drop` must free it.
            traceback.clear_frames(abandoned.__traceback__)
            traceback.clear_frames(error.__traceback__)
        except BaseException as exc:
            # A READ stopped or failed whole: its error, kept by whoever reports it, must not
            # keep the agent alive through the frames' locals when a later READ drops it.
            traceback.clear_frames(exc.__traceback__)
            raise
        else:
            return time.perf_counter() - t0
        # Out of the except block, whose exception would still hold the agent.
        self._drop(peer, error, lost=isinstance(error, PeerLostError) or not isinstance(error, PdkvError))
        raise error

    def _read_parts(
        self, peer: str, local: np.ndarray, remote: np.ndarray, mem: str, deadline: Deadline, stop: threading.Event
    ) -> None:
        if stop.is_set():  # before the agent: a new one would load `peer` first, for nothing
            raise TransferError(f"READ from {peer} stopped: its fetch was cancelled")
        agent = self._agent_for(peer)
        posted: deque[Any] = deque()
        whole = True  # every part posted: a stop came after the last one, if at all
        try:
            for part_local, part_remote in bounded(local, remote, _PART_BYTES, _PART_ROWS):
                if stop.is_set():
                    whole = False
                    break
                if len(posted) == _PARTS_IN_FLIGHT:
                    _finish(agent, peer, posted.popleft(), deadline, stop, self.read_stall)
                posted.append(_post(agent, peer, part_local, part_remote, mem))
            while posted:  # after a stop, within its grace
                _finish(agent, peer, posted.popleft(), deadline, stop, self.read_stall)
        except _Abandoned:
            _release_all(posted)
            raise
        except BaseException as exc:
            if posted:  # parts still in flight behind a failure: they go with the agent
                _release_all(posted)
                raise _Abandoned(exc) from None
            raise
        if not whole:
            raise TransferError(f"READ from {peer} stopped: its fetch was cancelled")


class _Abandoned(Exception):
    """A READ with a part that did not end DONE: `error` is raised once its agent is dropped."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _holders(core: Any) -> list[str]:
    """What holds NIXL's agent `core`, and what holds each of those (frames by function and
    line), for a log line: the next thing to free where one outlives its drop."""
    caller = sys._getframe(1)  # whose local names it

    def name(ref: Any) -> str:
        return f"frame {ref.f_code.co_name}:{ref.f_lineno}" if isinstance(ref, FrameType) else type(ref).__name__

    found = []
    for ref in gc.get_referrers(core):
        if ref is caller:
            continue
        above = [name(r) for r in gc.get_referrers(ref) if not isinstance(r, list)]  # not get_referrers' own list
        found.append(f"{name(ref)} <- {sorted(above)}")
    return sorted(found)


def _post(agent: Any, peer: str, local: np.ndarray, remote: np.ndarray, mem: str) -> Any:
    """Post one part; its handle, released by `_finish` (or with the others on a failure)."""
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), peer)
    try:
        state = agent.transfer(handle)
    except BaseException as exc:
        _release_all([handle])
        raise _Abandoned(exc) from None  # some of its requests may have gone out
    if state == "ERR":
        _release_all([handle])
        raise _Abandoned(TransferError(f"READ from {peer} could not be posted"))
    return handle


def _finish(agent: Any, peer: str, handle: Any, deadline: Deadline, stop: threading.Event, read_stall: float) -> None:
    """Wait for a posted part to end DONE, then release it. A stall of `read_stall` counts the
    peer lost; the deadline, a stop's grace or any other end abandons it (`_Abandoned`)."""
    stalled, grace = Deadline.after(read_stall), None
    sleep = _POLL_SLEEP_S[0]
    try:
        while (state := agent.check_xfer_state(handle)) == "PROC":
            if deadline.passed:
                raise DeadlineExceeded(f"READ from {peer} still running at its deadline")
            if stalled.passed:
                raise PeerLostError(f"READ from {peer}: a part of it made no end in {read_stall:g}s", peer)
            if stop.is_set():
                grace = grace or Deadline.after(_STOP_GRACE_S)
                if grace.passed:
                    raise TransferError(f"READ from {peer} stopped: its fetch was cancelled")
            time.sleep(sleep)
            sleep = _POLL_SLEEP_S[1]
    except BaseException as exc:
        _release_all([handle])
        raise _Abandoned(exc) from None
    _release_all([handle])
    if state != "DONE":
        raise _Abandoned(TransferError(f"READ from {peer} ended in state {state}"))


def _release_all(handles: Any) -> None:
    """Release transfer handles; one NIXL refuses (in flight) is left to its agent's drop."""
    for handle in handles:
        try:
            handle.release()
        except Exception as exc:
            logger.debug("a READ part still in flight at release (%s): it goes with its agent", exc)
    if isinstance(handles, deque):
        handles.clear()


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
# A stopped READ's parts in flight may end DONE for this long (on a live link, milliseconds);
# then they are abandoned with the agent, which costs only reconnecting its peers on next use.
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
