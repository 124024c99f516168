"""An NCCL communicator driven directly, for the owner broadcast's per-layer path.

A prefill reads every non-owned layer through one broadcast, and through torch's
`ProcessGroupNCCL` a broadcast and its wait cost about as much host time (work objects,
stream guards, the watchdog's bookkeeping) as a 6 MiB layer takes on NVLink, so the host,
not the link, set the pace. Here a broadcast is two driver calls that order it after the
compute stream, `ncclBroadcast` on a high-priority stream of its own, and an end event
(docs/benchmarks.md). vLLM drives NCCL the same way (`PyNcclCommunicator`), for the same
reason.

The calls go through NVIDIA's bindings, `nccl4py`'s low-level `nccl.bindings` and
`cuda-bindings`' `cuda.bindings.driver` (the `gpu` extra), cheaper a call than
hand-written ctypes; nccl4py's high-level `nccl.core` costs more than either, so it is not
used (docs/benchmarks.md#driver-bindings-host-cost-a-call). Both are imported on first
use, with CUDA only. The communicator config stays the ctypes struct below (NCCL 2.17's
prefix, passed by address): built once a communicator, it keeps the fields NCCL reads what
they were.

What ProcessGroupNCCL's watchdog did is done here by `_Watchdog`: a broadcast still
running at its deadline (a peer died or hangs: on one host NCCL's kernels wait for it
forever) aborts the communicator, whose kernels then exit, and every later call raises.
Creating the communicator and a call blocked in NCCL (a first broadcast waits for its
peers to connect) are bounded by the same timeout.
"""

from __future__ import annotations

import collections
import ctypes
import glob
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdkv.deadline import Deadline
from pdkv.errors import DeadlineExceeded, PdkvError, PeerLostError

logger = logging.getLogger(__name__)

_SUCCESS = 0
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21700  # NCCL_VERSION(2, 17, 0): the fields below, no later ones
_CUDA_NOT_READY = 600
_EVENT_DISABLE_TIMING = 2
_WATCH_INTERVAL_S = 0.02


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
    """The NCCL and CUDA driver entry points, through the bindings (`nb`: nccl4py's
    `nccl.bindings.nccl`; `drv`: `cuda.bindings.driver`). NCCL calls raise `nb.NCCLError`
    on failure; driver calls return their `CUresult` first."""

    def __init__(self, nb: Any, drv: Any) -> None:
        self.nb, self.drv = nb, drv
        self.error = nb.NCCLError
        self.get_unique_id = nb.get_unique_id
        self.init = nb.comm_init_rank_config
        self.async_error = nb.comm_get_async_error
        self.broadcast = nb.broadcast
        self.group_start = nb.group_start
        self.group_end = nb.group_end
        self.abort = nb.comm_abort
        self.destroy = nb.comm_destroy
        self.uint8 = int(nb.DataType.Uint8)
        self.event_create = drv.cuEventCreate
        self.event_record = drv.cuEventRecord
        self.event_query = drv.cuEventQuery
        self.event_destroy = drv.cuEventDestroy
        self.stream_wait = drv.cuStreamWaitEvent
        self.ctx_get = drv.cuCtxGetCurrent

    def error_string(self, code: int) -> str:
        try:
            return str(self.nb.get_error_string(code))
        except Exception:  # a code this NCCL does not know
            return "?"

    def ctx_set(self, ctx: Any) -> Any:
        return self.drv.cuCtxSetCurrent(ctx)[0]


_api: _Api | None = None
_unavailable = False  # the bindings were found missing: torch's process group serves
GPU_EXTRA = "pip install 'pdkv[cu12]' or 'pdkv[cu13]', for torch.version.cuda's major"


def _point_nccl4py_at_torch() -> None:
    """nccl4py finds libnccl through cuda-pathfinder: one already loaded (torch's, loaded with
    its CUDA libraries), else site-packages' `nvidia/nccl/lib`, else `$NCCL_HOME/lib`. Name
    torch's wheel there too (unless set), so that no second copy is ever loaded."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    home = os.path.join(site, "nvidia", "nccl")
    if "NCCL_HOME" not in os.environ and glob.glob(os.path.join(home, "lib", "libnccl.so*")):
        os.environ["NCCL_HOME"] = home


def nccl_library() -> _Api | None:
    """NCCL as torch loaded it (its pip wheel's libnccl), or None where it is not a shared
    library of its own (a torch built with NCCL linked in) or its bindings (the `gpu` extra)
    are not installed: then torch's process group serves, slower, and a warning says why."""
    global _api, _unavailable
    if _api is None and not _unavailable:
        if not torch.cuda.is_available():
            return None
        torch.cuda.init()  # loads libnccl with torch's CUDA libraries
        try:
            import nccl.bindings.nccl as nb
            from cuda.bindings import driver as drv
        except ImportError as exc:
            _unavailable = True
            logger.warning(
                "owner broadcasts go through torch's process group: no NCCL bindings (%s): %s", exc, GPU_EXTRA
            )
            return None
        _point_nccl4py_at_torch()
        try:
            version = int(nb.get_version())  # loads libnccl
            if version < _CONFIG_VERSION:
                raise OSError(f"NCCL {version} predates 2.17's communicator config")
            _api = _Api(nb, drv)
        except Exception as exc:  # no libnccl of its own: cuda-pathfinder's not-found, an old one
            logger.info("NCCL not loadable on its own (%s): broadcasts go through torch's process group", exc)
            return None
    return _api


def unique_id() -> bytes:
    """A new communicator's id, made on one rank and handed to the others."""
    api = _need()
    try:
        return bytes(api.get_unique_id())
    except api.error as exc:
        raise PeerLostError(f"ncclGetUniqueId: {exc}") from exc


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


def _nccl_failure(what: str, exc: Exception) -> PeerLostError:
    """A PeerLostError for an `NCCLError` of nccl4py (its `status` and message)."""
    return PeerLostError(f"{what}: NCCL error {getattr(exc, 'status', '?')}: {exc}")


def _check_cuda(rc: Any, what: str) -> None:
    """Raise for a failed driver call's `CUresult` (an int)."""
    if rc:
        raise PdkvError(f"{what}: CUDA driver error {int(rc)}")


class NcclWork:
    """One broadcast on the communicator's stream: its end event, and its tensors kept
    alive until it has run (the caching allocator would otherwise hand their memory to
    the compute stream while NCCL still reads or writes it). Once the watchdog has seen
    it run, its event goes back to the communicator for a later broadcast."""

    __slots__ = ("_comm", "event", "tensors", "what", "deadline", "ran")

    def __init__(
        self, comm: NcclComm, event: Any, tensors: Sequence[torch.Tensor], what: str, deadline: Deadline
    ) -> None:
        self._comm, self.event, self.tensors, self.what, self.deadline = comm, event, tensors, what, deadline
        self.ran = False

    def is_completed(self) -> bool:
        self._comm.raise_if_failed()
        if self.ran:
            return True
        rc = self._comm.api.event_query(self.event)[0]
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
        _check_cuda(self._comm.api.stream_wait(stream, self.event, 0)[0], "cuStreamWaitEvent")

    def __del__(self) -> None:
        if _api is not None and self.event is not None and not self.ran:
            _api.event_destroy(self.event)  # the driver defers it past a pending record


class NcclComm:
    """One rank of a communicator on `device`, its stream and its watchdog."""

    def __init__(
        self, uid: bytes, rank: int, size: int, device: torch.device, timeout: float, max_ctas: int | None = None
    ) -> None:
        self.api = _need()
        self.device, self.index, self.timeout = device, device.index or 0, timeout
        self.stream = torch.cuda.Stream(device, priority=-1)  # ahead of queued compute for SMs
        self._stream = self.stream.cuda_stream  # NCCL's argument: an int
        self._cu_stream = self.api.drv.CUstream(self._stream)  # the driver calls': wrapped once
        self._failed: PdkvError | None = None
        self._lock = threading.Lock()  # the failure and the abort: the caller's and the watchdog's
        self.calling_until: Deadline | None = None  # the deadline of the NCCL call in progress, if any
        self._events: list[Any] = []  # end events (`CUevent`) of broadcasts that have run, to record again
        with torch.cuda.device(device):
            rc, self._ctx = self.api.ctx_get()
            _check_cuda(rc, "cuCtxGetCurrent")
            self.comm = self._join(uid, rank, size, config(max_ctas))
            self._ready = self._event()
        self._watchdog = _Watchdog(self)

    def _join(self, uid: bytes, rank: int, size: int, cfg: _Config) -> Any:
        """Create the communicator (nccl4py's `Comm`), waiting for every rank at most `timeout`.

        The communicator is blocking: a non-blocking one returned `ncclInProgress` from
        every broadcast and finished it on a thread of its own, a cost on every call. So the
        init runs on a thread this one waits for (nccl4py releases the
        GIL in it); if a rank never comes, that thread stays in NCCL until the process
        ends, and this raises.
        """
        ident = self.api.nb.UniqueId.from_buffer(bytearray(uid))  # a writable copy: the bindings view it
        outcome: list[Any] = []

        def init() -> None:
            self.api.ctx_set(self._ctx)
            try:
                outcome.append(self.api.init(size, ident, rank, ctypes.addressof(cfg)))
            except self.api.error as exc:
                outcome.append(exc)

        joining = threading.Thread(target=init, name="pdkv-nccl-init", daemon=True)
        joining.start()
        joining.join(self.timeout)
        if not outcome:
            raise DeadlineExceeded(f"NCCL communicator of {size} ranks: not every rank joined in {self.timeout:.0f}s")
        if isinstance(outcome[0], Exception):
            raise _nccl_failure("ncclCommInitRankConfig", outcome[0]) from outcome[0]
        return outcome[0]

    def _event(self) -> Any:
        if self._events:
            return self._events.pop()
        rc, event = self.api.event_create(_EVENT_DISABLE_TIMING)
        _check_cuda(rc, "cuEventCreate")
        return event

    def raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def broadcast(self, tensors: Sequence[torch.Tensor], root: int, what: str) -> NcclWork:
        """Broadcast `tensors` (as one group) from `root`, after the work queued on the
        current stream; return at once."""
        self.raise_if_failed()
        api, stream, comm, u8 = self.api, self._stream, self.comm, self.api.uint8
        current = _current_stream(self.index)
        _check_cuda(api.event_record(self._ready, current)[0], "cuEventRecord")
        _check_cuda(api.stream_wait(self._cu_stream, self._ready, 0)[0], "cuStreamWaitEvent")
        # Watched while in NCCL: a first call connects to the peers and blocks until they come.
        self.calling_until = deadline = Deadline.after(self.timeout)
        failure: Exception | None = None
        try:
            if len(tensors) == 1:
                t = tensors[0]
                api.broadcast(t.data_ptr(), t.data_ptr(), t.nbytes, u8, root, comm, stream)
            else:
                api.group_start()
                try:
                    for t in tensors:
                        api.broadcast(t.data_ptr(), t.data_ptr(), t.nbytes, u8, root, comm, stream)
                finally:
                    api.group_end()  # a call in a group only queues: errors surface here
        except api.error as exc:
            failure = exc
        finally:
            self.calling_until = None
        if failure is not None:  # a no-op abort if the watchdog aborted it meanwhile: its reason is raised
            self.abort(_nccl_failure(what, failure))
            self.raise_if_failed()
        end = self._event()
        _check_cuda(api.event_record(end, self._cu_stream)[0], "cuEventRecord")
        work = NcclWork(self, end, tensors, what, deadline)
        self._watchdog.track(work)
        return work

    def check_async(self) -> None:
        """Fail the communicator if NCCL reported an error of its own (a network peer lost)."""
        if self._failed is not None:
            return
        try:
            state = int(self.api.async_error(self.comm))
        except self.api.error:  # the query itself failed: as before, nothing is concluded
            return
        if state != _SUCCESS:
            self.abort(PeerLostError(f"NCCL: {self.api.error_string(state)}"))

    def abort(self, why: PdkvError) -> None:
        """Abort the communicator (its kernels exit, a call blocked in it returns); every
        later call raises `why`."""
        with self._lock:
            if self._failed is not None:
                return
            self._failed = why
        logger.error("owner broadcast communicator aborted: %s", why)
        try:
            self.api.abort(self.comm)
        except self.api.error as exc:
            logger.warning("ncclCommAbort: %s", exc)

    def close(self) -> None:
        """Free the communicator once what is queued on it has run (abort it if that
        takes longer than the timeout, or it failed)."""
        self._watchdog.stop()
        if self._failed is not None:
            return
        deadline = Deadline.after(self.timeout)
        while not self._watchdog.idle() and not deadline.passed:
            time.sleep(0.001)
        if not self._watchdog.idle():
            self.abort(DeadlineExceeded("closing: a broadcast still running after the timeout"))
            return
        with self._lock:
            self._failed = PdkvError("the owner broadcast communicator is closed")
        try:
            self.api.destroy(self.comm)
        except self.api.error as exc:
            logger.warning("ncclCommDestroy: %s", exc)


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
        calling = comm.calling_until
        if calling is not None and calling.passed:
            comm.abort(DeadlineExceeded(f"an NCCL call still blocked after {comm.timeout:.0f}s (a peer missing?)"))
        while self._flights:
            work = self._flights[0]
            if not work.is_completed():
                if work.deadline.passed:
                    comm.abort(DeadlineExceeded(f"{work.what}: still running after {comm.timeout:.0f}s"))
                return
            self._flights.popleft()
            work.tensors = ()
            work.ran = True  # set before its event is handed out again: `wait` then skips it
            comm._events.append(work.event)
