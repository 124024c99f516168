"""An NCCL communicator driven through ctypes, for the owner broadcast's per-layer path.

A prefill reads every non-owned layer through one broadcast, and through torch's
`ProcessGroupNCCL` a broadcast and its wait took 29-41 us of host time (work objects,
stream guards, the watchdog's bookkeeping): about what a 6 MiB layer takes on NVLink, so
the host, not the link, set the pace. Here a broadcast is two driver calls that order it
after the compute stream, `ncclBroadcast` on a high-priority stream of its own, and an
end event: 18-29 us with the wait (H200 host, docs/benchmarks.md). vLLM drives NCCL the
same way (`PyNcclCommunicator`), for the same reason.

What ProcessGroupNCCL's watchdog did is done here by `_Watchdog`: a broadcast still
running at its deadline (a peer died or hangs: on one host NCCL's kernels wait for it
forever) aborts the communicator, whose kernels then exit, and every later call raises.
Creating the communicator and a call blocked in NCCL (a first broadcast waits for its
peers to connect) are bounded by the same timeout.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdkv.errors import DeadlineExceeded, PdkvError, PeerLostError

__all__ = ["NcclComm", "NcclWork", "nccl_library", "unique_id"]

logger = logging.getLogger(__name__)

_SUCCESS = 0
_UINT8 = 1  # ncclUint8
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21700  # NCCL_VERSION(2, 17, 0): the fields below, no later ones
_CUDA_NOT_READY = 600
_EVENT_DISABLE_TIMING = 2
_WATCH_INTERVAL_S = 0.02


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class _Config(ctypes.Structure):
    """The prefix of `ncclConfig_t` that NCCL 2.17 defined; NCCL reads `size` bytes of it
    and gives later fields their defaults for an older `version`."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
    ]


def config(max_ctas: int | None) -> _Config:
    """A blocking communicator's config; `max_ctas` caps the SMs its kernels take."""
    undef = -(2**31)  # NCCL_CONFIG_UNDEF_INT: NCCL's own choice
    return _Config(ctypes.sizeof(_Config), _CONFIG_MAGIC, _CONFIG_VERSION, 1, undef, undef, max_ctas or undef, None)


class _Api:
    """The NCCL and CUDA driver entry points, their argument types set once."""

    def __init__(self, nccl: ctypes.CDLL, cuda: ctypes.CDLL) -> None:
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t

        def fn(lib: ctypes.CDLL, name: str, *argtypes: Any, restype: Any = ctypes.c_int) -> Any:
            f = getattr(lib, name)
            f.argtypes, f.restype = list(argtypes), restype
            return f

        self.get_unique_id = fn(nccl, "ncclGetUniqueId", ctypes.POINTER(_UniqueId))
        self.init = fn(nccl, "ncclCommInitRankConfig", ctypes.POINTER(vp), i, _UniqueId, i, ctypes.POINTER(_Config))
        self.async_error = fn(nccl, "ncclCommGetAsyncError", vp, ctypes.POINTER(i))
        self.broadcast = fn(nccl, "ncclBroadcast", vp, vp, sz, i, i, vp, vp)
        self.group_start = fn(nccl, "ncclGroupStart")
        self.group_end = fn(nccl, "ncclGroupEnd")
        self.abort = fn(nccl, "ncclCommAbort", vp)
        self.destroy = fn(nccl, "ncclCommDestroy", vp)
        self.error_string = fn(nccl, "ncclGetErrorString", i, restype=ctypes.c_char_p)
        self.event_create = fn(cuda, "cuEventCreate", ctypes.POINTER(vp), ctypes.c_uint)
        self.event_record = fn(cuda, "cuEventRecord", vp, vp)
        self.event_query = fn(cuda, "cuEventQuery", vp)
        self.event_destroy = fn(cuda, "cuEventDestroy_v2", vp)
        self.stream_wait = fn(cuda, "cuStreamWaitEvent", vp, vp, ctypes.c_uint)
        self.ctx_get = fn(cuda, "cuCtxGetCurrent", ctypes.POINTER(vp))
        self.ctx_set = fn(cuda, "cuCtxSetCurrent", vp)


_api: _Api | None = None


def nccl_library() -> _Api | None:
    """NCCL as torch loaded it (its pip wheel's libnccl), or None where it is not a shared
    library of its own (a torch built with NCCL linked in): then torch's process group serves."""
    global _api
    if _api is None:
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()  # loads libnccl with torch's CUDA libraries
        try:
            nccl = ctypes.CDLL("libnccl.so.2")
            version = ctypes.c_int()
            if nccl.ncclGetVersion(ctypes.byref(version)) != _SUCCESS or version.value < _CONFIG_VERSION:
                raise OSError(f"NCCL {version.value} predates 2.17's communicator config")
            _api = _Api(nccl, ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError) as exc:
            logger.info("NCCL not loadable on its own (%s): broadcasts go through torch's process group", exc)
            return None
    return _api


def unique_id() -> bytes:
    """A new communicator's id, made on one rank and handed to the others."""
    api = _need()
    uid = _UniqueId()
    _check(api, api.get_unique_id(ctypes.byref(uid)), "ncclGetUniqueId")
    return bytes(uid.internal)


def _stream_of_stream_object(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# The current stream's handle on a device: torch's raw getter where it has one (a fraction
# of a microsecond a call), else through the `Stream` object (a few).
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _stream_of_stream_object)


def _need() -> _Api:
    api = nccl_library()
    if api is None:
        raise PdkvError("NCCL is not available in this process")
    return api


def _check(api: _Api, rc: int, what: str) -> None:
    if rc != _SUCCESS:
        raise PeerLostError(f"{what}: NCCL error {rc}: {api.error_string(rc).decode()}")


def _check_cuda(rc: int, what: str) -> None:
    if rc != 0:
        raise PdkvError(f"{what}: CUDA driver error {rc}")


class NcclWork:
    """One broadcast on the communicator's stream: its end event, and its tensors kept
    alive until it has run (the caching allocator would otherwise hand their memory to
    the compute stream while NCCL still reads or writes it). Once the watchdog has seen
    it run, its event goes back to the communicator for a later broadcast."""

    __slots__ = ("_comm", "event", "tensors", "what", "deadline", "ran")

    def __init__(self, comm: NcclComm, event: int, tensors: Sequence[torch.Tensor], what: str, deadline: float) -> None:
        self._comm, self.event, self.tensors, self.what, self.deadline = comm, event, tensors, what, deadline
        self.ran = False

    def is_completed(self) -> bool:
        self._comm.raise_if_failed()
        if self.ran:
            return True
        rc = self._comm.api.event_query(self.event)
        if rc == _CUDA_NOT_READY:
            return False
        _check_cuda(rc, "cuEventQuery")
        return True

    def wait(self) -> None:
        """Order the current stream after the broadcast."""
        self._comm.raise_if_failed()
        if self.ran:  # its event may serve another broadcast by now
            return
        stream = _current_stream(self._comm.index)
        _check_cuda(self._comm.api.stream_wait(stream, self.event, 0), "cuStreamWaitEvent")

    def __del__(self) -> None:
        if _api is not None and self.event and not self.ran:
            _api.event_destroy(self.event)  # the driver defers it past a pending record


class NcclComm:
    """One rank of a communicator on `device`, its stream and its watchdog."""

    def __init__(
        self, uid: bytes, rank: int, size: int, device: torch.device, timeout: float, max_ctas: int | None = None
    ) -> None:
        self.api = _need()
        self.device, self.index, self.timeout = device, device.index or 0, timeout
        self.stream = torch.cuda.Stream(device, priority=-1)  # ahead of queued compute for SMs
        self._stream = self.stream.cuda_stream
        self._failed: PdkvError | None = None
        self._lock = threading.Lock()  # the failure and the abort: the caller's and the watchdog's
        self.calling_since = 0.0  # when the NCCL call in progress began; 0: none
        self._events: list[int] = []  # end events of broadcasts that have run, to record again
        with torch.cuda.device(device):
            ctx = ctypes.c_void_p()
            _check_cuda(self.api.ctx_get(ctypes.byref(ctx)), "cuCtxGetCurrent")
            self._ctx = ctx.value
            self.comm = self._join(uid, rank, size, config(max_ctas))
            self._ready = self._event()
        self._watchdog = _Watchdog(self)

    def _join(self, uid: bytes, rank: int, size: int, cfg: _Config) -> ctypes.c_void_p:
        """Create the communicator, waiting for every rank at most `timeout`.

        The communicator is blocking: a non-blocking one returned `ncclInProgress` from
        every broadcast and finished it on a thread of its own, 0.1 ms a call (measured,
        H200 host). So the init runs on a thread this one waits for; if a rank never comes,
        that thread stays in NCCL until the process ends, and this raises.
        """
        comm, ident, outcome = ctypes.c_void_p(), _UniqueId(), []
        ctypes.memmove(ident.internal, uid, 128)

        def init() -> None:
            self.api.ctx_set(self._ctx)
            outcome.append(self.api.init(ctypes.byref(comm), size, ident, rank, ctypes.byref(cfg)))

        joining = threading.Thread(target=init, name="pdkv-nccl-init", daemon=True)
        joining.start()
        joining.join(self.timeout)
        if not outcome:
            raise DeadlineExceeded(f"NCCL communicator of {size} ranks: not every rank joined in {self.timeout:.0f}s")
        _check(self.api, outcome[0], "ncclCommInitRankConfig")
        return comm

    def _event(self) -> int:
        if self._events:
            return self._events.pop()
        event = ctypes.c_void_p()
        _check_cuda(self.api.event_create(ctypes.byref(event), _EVENT_DISABLE_TIMING), "cuEventCreate")
        return event.value or 0

    def raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def broadcast(self, tensors: Sequence[torch.Tensor], root: int, what: str) -> NcclWork:
        """Broadcast `tensors` (as one group) from `root`, after the work queued on the
        current stream; return at once."""
        self.raise_if_failed()
        api, stream = self.api, self._stream
        current = _current_stream(self.index)
        _check_cuda(api.event_record(self._ready, current), "cuEventRecord")
        _check_cuda(api.stream_wait(stream, self._ready, 0), "cuStreamWaitEvent")
        # Watched while in NCCL: a first call connects to the peers and blocks until they come.
        self.calling_since = start = time.monotonic()
        try:
            if len(tensors) == 1:
                t = tensors[0]
                rc = api.broadcast(t.data_ptr(), t.data_ptr(), t.nbytes, _UINT8, root, self.comm, stream)
            else:
                api.group_start()
                for t in tensors:
                    api.broadcast(t.data_ptr(), t.data_ptr(), t.nbytes, _UINT8, root, self.comm, stream)
                rc = api.group_end()  # a call in a group only queues: errors surface here
        finally:
            self.calling_since = 0.0
        if rc != _SUCCESS:  # a no-op abort if the watchdog aborted it meanwhile: its reason is raised
            self.abort(PeerLostError(f"{what}: NCCL error {rc}: {api.error_string(rc).decode()}"))
            self.raise_if_failed()
        end = self._event()
        _check_cuda(api.event_record(end, stream), "cuEventRecord")
        work = NcclWork(self, end, tensors, what, start + self.timeout)
        self._watchdog.track(work)
        return work

    def check_async(self) -> None:
        """Fail the communicator if NCCL reported an error of its own (a network peer lost)."""
        state = ctypes.c_int()
        if self._failed is not None or self.api.async_error(self.comm, ctypes.byref(state)) != _SUCCESS:
            return
        if state.value != _SUCCESS:
            self.abort(PeerLostError(f"NCCL: {self.api.error_string(state.value).decode()}"))

    def abort(self, why: PdkvError) -> None:
        """Abort the communicator (its kernels exit, a call blocked in it returns); every
        later call raises `why`."""
        with self._lock:
            if self._failed is not None:
                return
            self._failed = why
        logger.error("owner broadcast communicator aborted: %s", why)
        self.api.abort(self.comm)

    def close(self) -> None:
        """Free the communicator once what is queued on it has run (abort it if that
        takes longer than the timeout, or it failed)."""
        self._watchdog.stop()
        if self._failed is not None:
            return
        deadline = time.monotonic() + self.timeout
        while not self._watchdog.idle() and time.monotonic() < deadline:
            time.sleep(0.001)
        if not self._watchdog.idle():
            self.abort(DeadlineExceeded("closing: a broadcast still running after the timeout"))
            return
        with self._lock:
            self._failed = PdkvError("the owner broadcast communicator is closed")
        self.api.destroy(self.comm)


class _Watchdog:
    """A thread that aborts the communicator when a broadcast outlives its deadline, and
    lets each broadcast's tensors go once it has run."""

    def __init__(self, comm: NcclComm) -> None:
        self._comm = comm
        self._flights: collections.deque[NcclWork] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdkv-nccl-watchdog", daemon=True)
        self._thread.start()

    def track(self, work: NcclWork) -> None:
        self._flights.append(work)  # deque appends and pops are atomic: no lock on the hot path

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def idle(self) -> bool:
        """Whether every tracked broadcast has run (sweeping them here)."""
        try:
            self._sweep(self._comm)
        except PdkvError:
            return True  # failed: nothing more will run
        return not self._flights

    def _run(self) -> None:
        comm = self._comm
        comm.api.ctx_set(comm._ctx)
        while not self._stop.wait(_WATCH_INTERVAL_S):
            try:
                self._sweep(comm)
            except PdkvError:  # failed: later calls raise it; nothing left to watch
                self._flights.clear()
            except Exception:
                logger.exception("owner broadcast watchdog")

    def _sweep(self, comm: NcclComm) -> None:
        comm.check_async()
        calling = comm.calling_since
        if calling and time.monotonic() > calling + comm.timeout:
            comm.abort(DeadlineExceeded(f"an NCCL call still blocked after {comm.timeout:.0f}s (a peer missing?)"))
        while self._flights:
            work = self._flights[0]
            if not work.is_completed():
                if time.monotonic() > work.deadline:
                    comm.abort(DeadlineExceeded(f"{work.what}: still running after {comm.timeout:.0f}s"))
                return
            self._flights.popleft()
            work.tensors = ()
            work.ran = True  # set before its event is handed out again: `wait` then skips it
            comm._events.append(work.event)
