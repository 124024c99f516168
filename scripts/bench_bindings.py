"""Host cost per call of the hot path's CUDA driver and NCCL calls: pdkv's calls through
NVIDIA's bindings against the hand-written ctypes they replaced (issue 30 §6), on one GPU.

pdkv makes these calls through `cuda-bindings` (`cuda.bindings.driver`: the GPU lane's
`GatherKernel`, `DriverEvent`, `Gatherer.launch`/`prime`) and nccl4py's `nccl.bindings`
(the owner broadcast's `pdkv/nccl.py`). The "ctypes" column is the reference they replaced,
kept in this script (`_CtypesDriver`, `_CtypesNccl`: the same entry points, argument types
set once, the return code checked, as pdkv made them up to issue 30 §6) and run on the same
handles; the "bindings" column is pdkv's own code as it is now. Rounds of each alternate
(A, B, A, B...); a sample is `--batch` calls timed with `time.perf_counter_ns` and divided;
median and p90 over all samples, in microseconds a call. The kernel's launch is checked
byte-exact both ways before it is timed; queued launches are drained between samples
(untimed) so that no launch waits for a full queue.

Rows, the lane's per fetch (`Gatherer.prime`, `.launch`, and its waiting thread):
cuCtxGetCurrent (`GatherKernel.enter`, twice a fetch), cuLaunchKernel of the empty `prime`
kernel, cuLaunchKernel of the gather (7 parameters, 4 KiB of page ids), cuEventRecord,
cuEventSynchronize and cuEventQuery of an event that has passed, cuEventElapsedTime
(`seconds_until`), cuStreamWaitEvent (the broadcast's ordering); "lane fetch, all calls":
enter + prime + enter + launch + record. The broadcast's per layer (`NcclComm.broadcast`):
ncclBroadcast alone (1 rank, a 6 MiB layer, in place; the ctypes side on a communicator of
its own), and "broadcast per layer": record + wait + ncclBroadcast + record; then pdkv's
`NcclComm.broadcast` itself (Python around the same calls, its watchdog running; 4.77 us
through ctypes on an H200 host before the change) and nccl4py's high-level
`nccl.core.Communicator.broadcast` where `cuda-core` is installed.

    python3 scripts/bench_bindings.py [--calls 20000] [--rounds 3] [--batch 10]

Needs a CUDA GPU and the `gpu` extra (pdkv's calls need it); a part whose package is missing
prints a line saying so and is skipped. On the lent machine (no network), from wheels
fetched here: `python3 -m pip install --no-deps .whl3/*.whl` (cuda-pathfinder, nccl4py).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

Row = tuple[str, list[float] | None, list[float] | None, str]  # name, ctypes us, bindings us, note

_EVENT_DISABLE_TIMING = 0x2
_PAGES, _ITEM = 64, 4096  # the gather launch's copy: 64 pages of 4 KiB, 16-byte loads
_LAYER_BYTES = 6 << 20  # a DSA layer's broadcast, about


def _kernel_module():  # type: ignore[no-untyped-def]
    """pdkv's gather kernel module."""
    from transfer.lanes.cuda_ipc import kernel

    return kernel


def _samples(fn: Callable[[], None], calls: int, batch: int, between: Callable[[], None] | None) -> list[float]:
    """Microseconds a call of `fn`: `calls // batch` samples of `batch` calls each."""
    out = []
    clock = time.perf_counter_ns
    for i in range(max(1, calls // batch)):
        if between is not None and i % 50 == 0:
            between()  # untimed: drain what the calls queued
        t0 = clock()
        for _ in range(batch):
            fn()
        out.append((clock() - t0) / batch / 1e3)
    return out


def _ab(
    a: Callable[[], None] | None,
    b: Callable[[], None] | None,
    args: argparse.Namespace,
    between: Callable[[], None] | None = None,
) -> tuple[list[float] | None, list[float] | None]:
    """Both sides' samples, their rounds alternating; a side that is None is not run."""
    sa: list[float] | None = [] if a is not None else None
    sb: list[float] | None = [] if b is not None else None
    for fn in (a, b):  # a warm-up of each
        if fn is not None:
            _samples(fn, min(args.calls, 2000), args.batch, between)
    for _ in range(args.rounds):
        if a is not None and sa is not None:
            sa += _samples(a, args.calls, args.batch, between)
        if b is not None and sb is not None:
            sb += _samples(b, args.calls, args.batch, between)
    if between is not None:
        between()
    return sa, sb


def _stat(s: list[float] | None) -> tuple[float, float]:
    if not s:
        return float("nan"), float("nan")
    return statistics.median(s), float(np.percentile(s, 90))


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    print(f"microseconds a call (host), median and p90 of samples of {args.batch} calls, {args.rounds} rounds a side")
    head = ("call", "ctypes p50", "ctypes p90", "bindings p50", "bindings p90", "bind/ctypes")
    widths = (40, 11, 11, 13, 13, 12)
    print(f"{head[0]:<{widths[0]}}" + "".join(f"{h:>{w}}" for h, w in zip(head[1:], widths[1:])) + "  note")
    for name, a, b, note in rows:
        (a50, a90), (b50, b90) = _stat(a), _stat(b)
        ratio = b50 / a50 if a and b else float("nan")
        cells = [f"{name:<{widths[0]}}"] + [f"{v:>{w}.2f}" for v, w in zip((a50, a90, b50, b90, ratio), widths[1:])]
        print("".join(cells) + f"  {note}")


# ---- the ctypes reference: what pdkv called before issue 30 §6 ----------------------------------
class _CtypesDriver:
    """The driver entry points of a fetch and a broadcast, argument types set once (a CDLL of
    its own: function objects typed here change nothing for other users of libcuda)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u, pvp = ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)

        def fn(names: tuple[str, ...], *argtypes: Any) -> Any:
            f = next(getattr(lib, n) for n in names if hasattr(lib, n))
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            return f

        self.launch = fn(("cuLaunchKernel",), vp, u, u, u, u, u, u, u, vp, pvp, pvp)
        self.event_create = fn(("cuEventCreate",), pvp, u)
        self.event_record = fn(("cuEventRecord",), vp, vp)
        self.event_sync = fn(("cuEventSynchronize",), vp)
        self.event_query = fn(("cuEventQuery",), vp)
        self.event_elapsed = fn(("cuEventElapsedTime_v2", "cuEventElapsedTime"), ctypes.POINTER(ctypes.c_float), vp, vp)
        self.stream_wait = fn(("cuStreamWaitEvent",), vp, vp, u)
        self.ctx_get = fn(("cuCtxGetCurrent",), pvp)
        self.ctx_push = fn(("cuCtxPushCurrent_v2", "cuCtxPushCurrent"), vp)
        self.ctx_pop = fn(("cuCtxPopCurrent_v2", "cuCtxPopCurrent"), pvp)

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA driver error {rc}")

    def event(self, timed: bool) -> int:
        h = ctypes.c_void_p()
        self.check(self.event_create(ctypes.byref(h), 0 if timed else _EVENT_DISABLE_TIMING), "cuEventCreate")
        return h.value or 0


# ---- the GPU lane: the driver calls of a fetch ----------------------------------------------------
class _Lane:
    """The gather kernel of pdkv (compiled and loaded by it), a stream, buffers and a
    table for one real launch: one buffer of `_PAGES` items of `_ITEM` bytes."""

    def __init__(self) -> None:
        kmod = _kernel_module()
        self.kmod = kmod
        self.k = kmod.GatherKernel.on(0)
        self.stream_obj = torch.cuda.Stream(torch.device("cuda:0"))
        self.stream = self.stream_obj.cuda_stream
        self.cu_stream = self.k.stream(self.stream)
        gen = torch.Generator().manual_seed(3)
        self.src = torch.randint(0, 256, (_PAGES, _ITEM), dtype=torch.uint8, generator=gen).cuda()
        self.dst = torch.zeros_like(self.src)
        words = _ITEM // 16
        # The kernel's table (see transfer's gather kernel): per buffer source base, destination
        # base, item words, source list; per task its buffer and first word. One task a page.
        self.meta = torch.tensor(
            [self.src.data_ptr(), self.dst.data_ptr(), words, 0, 0, 0], dtype=torch.int64, device="cuda"
        )
        self.capacity = self.k.capacities[0]
        self.args = kmod.LaunchArgs(self.capacity)
        self.args.values[:] = [self.meta.data_ptr(), 1, 1, _PAGES, words, 1]
        rng = np.random.default_rng(5)
        self.src_pages, self.dst_pages = rng.permutation(_PAGES), rng.permutation(_PAGES)
        self.args.ids[: 2 * _PAGES] = np.concatenate((self.src_pages, self.dst_pages))
        self.grid, self.threads = (1, _PAGES), 128
        self.done = kmod.DriverEvent(self.k, timed=False)
        self.t0, self.t1 = kmod.DriverEvent(self.k), kmod.DriverEvent(self.k)
        self.other_obj = torch.cuda.Stream(torch.device("cuda:0"))
        self.other = self.other_obj.cuda_stream
        torch.cuda.synchronize()

    def expect(self) -> torch.Tensor:
        want = torch.zeros_like(self.src)
        want[torch.from_numpy(self.dst_pages).cuda()] = self.src[torch.from_numpy(self.src_pages).cuda()]
        return want

    def drain(self) -> None:
        self.stream_obj.synchronize()


def lane_ctypes(lane: _Lane, api: _CtypesDriver) -> dict[str, Callable[[], None]]:
    """The calls as pdkv made them through ctypes, on the same handles (as ints)."""
    check = api.check
    ctx = int(lane.k.ctx)
    stream, other, params = lane.stream, lane.other, lane.args.params
    f, prime_f = int(lane.k.functions[16, lane.capacity]), int(lane.k._prime)
    (g0, g1), threads = lane.grid, lane.threads
    done, t0, t1 = lane.done.handle, lane.t0.handle, lane.t1.handle
    ms = ctypes.c_float()

    def enter() -> None:  # GatherKernel.enter, then leave where it pushed
        current = ctypes.c_void_p()
        check(api.ctx_get(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != ctx:
            check(api.ctx_push(ctx), "cuCtxPushCurrent")
            popped = ctypes.c_void_p()
            check(api.ctx_pop(ctypes.byref(popped)), "cuCtxPopCurrent")

    def prime() -> None:
        check(api.launch(prime_f, 1, 1, 1, 32, 1, 1, 0, stream, None, None), "cuLaunchKernel")

    def launch() -> None:
        check(api.launch(f, g0, g1, 1, threads, 1, 1, 0, stream, params, None), "cuLaunchKernel")

    def record() -> None:
        check(api.event_record(done, stream), "cuEventRecord")

    def synchronize() -> None:
        check(api.event_sync(done), "cuEventSynchronize")

    def query() -> None:  # as pdkv/nccl.py's `NcclWork.is_completed` made it
        rc = api.event_query(done)
        if rc != 0:
            check(rc, "cuEventQuery")

    def elapsed() -> None:
        check(api.event_elapsed(ctypes.byref(ms), t0, t1), "cuEventElapsedTime")

    def wait_event() -> None:  # as pdkv/nccl.py's `NcclComm.broadcast` and `NcclWork.wait` made it
        check(api.stream_wait(other, done, 0), "cuStreamWaitEvent")

    def fetch() -> None:
        enter()
        prime()
        enter()
        launch()
        record()

    return dict(
        enter=enter,
        prime=prime,
        launch=launch,
        record=record,
        synchronize=synchronize,
        query=query,
        elapsed=elapsed,
        wait_event=wait_event,
        fetch=fetch,
    )


def lane_bindings(lane: _Lane) -> dict[str, Callable[[], None]]:
    """pdkv's own calls (through `cuda.bindings.driver`), on the same handles."""
    k, drv = lane.k, lane.k.drv
    stream, args = lane.cu_stream, lane.args
    (g0, g1), threads = lane.grid, lane.threads
    done, t0, t1 = lane.done, lane.t0, lane.t1
    other = drv.CUstream(lane.other)
    query_event, wait_event_ = drv.cuEventQuery, drv.cuStreamWaitEvent

    def enter() -> None:
        if k.enter():
            k.leave()

    def prime() -> None:
        k.prime(stream)

    def launch() -> None:
        k.launch(16, (g0, g1), threads, stream, args)

    def record() -> None:
        done.record(stream)

    def synchronize() -> None:
        done.synchronize()

    def query() -> None:  # as pdkv/nccl.py's `NcclWork.is_completed`
        rc = query_event(done.event)[0]
        if rc:
            k.check(rc, "cuEventQuery")

    def elapsed() -> None:
        t0.seconds_until(t1)

    def wait_event() -> None:  # as pdkv/nccl.py's `NcclComm.broadcast` and `NcclWork.wait`
        rc = wait_event_(other, done.event, 0)[0]
        if rc:
            k.check(rc, "cuStreamWaitEvent")

    def fetch() -> None:
        enter()
        prime()
        enter()
        launch()
        record()

    return dict(
        enter=enter,
        prime=prime,
        launch=launch,
        record=record,
        synchronize=synchronize,
        query=query,
        elapsed=elapsed,
        wait_event=wait_event,
        fetch=fetch,
    )


def bench_lane(args: argparse.Namespace) -> list[Row]:
    try:
        lane = _Lane()
    except Exception as exc:  # pdkv's lane needs cuda-bindings now: say so, keep the NCCL part
        print(f"driver: pdkv's GPU lane did not start ({type(exc).__name__}: {exc}): SKIPPED")
        return []
    api = _CtypesDriver()
    a, b = lane_ctypes(lane, api), lane_bindings(lane)
    want = lane.expect()
    for side, calls in (("ctypes", a), ("cuda.bindings (pdkv)", b)):
        lane.dst.zero_()
        torch.cuda.synchronize()
        calls["launch"]()
        calls["record"]()
        calls["synchronize"]()
        if not torch.equal(lane.dst, want):
            raise SystemExit(
                f"the gather launch through {side} did not copy the planned pages: its arguments are wrong"
            )
        print(f"driver: the gather launch through {side} copied the planned pages byte-exact")
    # A timed pair of events that has passed, for cuEventElapsedTime.
    lane.t0.record(lane.cu_stream)
    lane.t1.record(lane.cu_stream)
    lane.done.record(lane.cu_stream)
    lane.drain()
    rows: list[Row] = []

    def row(name: str, key: str, between: Callable[[], None] | None = None) -> None:
        sa, sb = _ab(a[key], b[key], args, between)
        rows.append((name, sa, sb, "pdkv's GatherKernel / DriverEvent"))

    row("cuCtxGetCurrent (enter)", "enter")
    row("cuLaunchKernel prime (no params)", "prime", lane.drain)
    row(f"cuLaunchKernel gather ({lane.capacity * 4 + 48} B params)", "launch", lane.drain)
    row("cuEventRecord (untimed event)", "record", lane.drain)
    lane.done.record(lane.cu_stream)
    lane.drain()
    row("cuEventSynchronize (passed)", "synchronize")
    row("cuEventQuery (passed)", "query")
    row("cuEventElapsedTime", "elapsed")
    row("cuStreamWaitEvent", "wait_event", lambda: torch.cuda.synchronize())
    row("lane fetch, all calls", "fetch", lane.drain)
    torch.cuda.synchronize()
    return rows


# ---- the owner broadcast: ncclBroadcast per layer -------------------------------------------------
def _nccl_libraries() -> list[str]:
    """The libnccl files mapped into this process."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "libnccl" in line and "/" in line})


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]  # by value, as NCCL takes it


class _CtypesNccl:
    """A one-rank communicator of the libnccl already loaded, driven through ctypes as
    pdkv/nccl.py did (the same config struct, passed by reference)."""

    def __init__(self, config: Any) -> None:
        lib = ctypes.CDLL("libnccl.so.2")
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self.broadcast = lib.ncclBroadcast
        self.broadcast.argtypes, self.broadcast.restype = [vp, vp, sz, i, i, vp, vp], i
        uid = _UniqueId()
        if lib.ncclGetUniqueId(ctypes.byref(uid)) != 0:
            raise RuntimeError("ncclGetUniqueId")
        init = lib.ncclCommInitRankConfig
        init.argtypes, init.restype = [ctypes.POINTER(vp), i, _UniqueId, i, ctypes.c_void_p], i
        comm = ctypes.c_void_p()
        self.config = config
        if init(ctypes.byref(comm), 1, uid, 0, ctypes.addressof(config)) != 0:
            raise RuntimeError("ncclCommInitRankConfig")
        self.comm = comm.value
        self._lib = lib

    def destroy(self) -> None:
        self._lib.ncclCommDestroy(ctypes.c_void_p(self.comm))


def bench_nccl(args: argparse.Namespace) -> list[Row]:
    from pdkv import nccl as pn

    try:
        api = pn.nccl_library()
    except Exception as exc:  # the gpu extra missing
        print(f"nccl: pdkv.nccl cannot start ({exc}): skipped")
        return []
    if api is None:
        print("nccl: pdkv.nccl found no loadable libnccl (torch built with NCCL linked in?): skipped")
        return []
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    comm = pn.NcclComm(pn.unique_id(), 0, 1, device, timeout=60.0)
    print(f"nccl: NCCL {api.nb.get_version()} (version code); libnccl mapped in this process: {_nccl_libraries()}")
    t = torch.zeros(_LAYER_BYTES, dtype=torch.uint8, device=device)
    ptr, n, stream = t.data_ptr(), t.nbytes, comm._stream
    current = pn._current_stream
    # The ctypes reference: its own communicator and events, the same stream.
    cu = _CtypesDriver()
    ref = _CtypesNccl(pn.config(None))
    c_ready, c_end, c_comm = cu.event(False), cu.event(False), ref.comm
    c_broadcast_fn = ref.broadcast

    def a_broadcast() -> None:
        rc = c_broadcast_fn(ptr, ptr, n, 1, 0, c_comm, stream)  # 1: ncclUint8
        if rc != 0:
            raise RuntimeError(f"ncclBroadcast: {rc}")

    def a_layer() -> None:
        cu.check(cu.event_record(c_ready, current(0)), "cuEventRecord")
        cu.check(cu.stream_wait(stream, c_ready, 0), "cuStreamWaitEvent")
        a_broadcast()
        cu.check(cu.event_record(c_end, stream), "cuEventRecord")

    # pdkv's calls as `NcclComm.broadcast` makes them (through the bindings), without its Python.
    b_ready, b_end, b_comm, b_stream, u8 = comm._event(), comm._event(), comm.comm, comm._cu_stream, api.uint8
    nb_broadcast, record_event, wait_event = api.broadcast, api.event_record, api.stream_wait

    def b_broadcast() -> None:
        nb_broadcast(ptr, ptr, n, u8, 0, b_comm, stream)  # raises on an NCCL error

    def b_layer() -> None:
        if record_event(b_ready, current(0))[0]:
            raise RuntimeError("cuEventRecord")
        if wait_event(b_stream, b_ready, 0)[0]:
            raise RuntimeError("cuStreamWaitEvent")
        b_broadcast()
        if record_event(b_end, b_stream)[0]:
            raise RuntimeError("cuEventRecord")

    def pdkv_layer() -> None:
        comm.broadcast([t], 0, "bench")

    def drain() -> None:
        comm.stream.synchronize()

    rows: list[Row] = []
    mb = f"{_LAYER_BYTES >> 20} MiB"
    sa, sb = _ab(a_broadcast, b_broadcast, args, drain)
    rows.append((f"ncclBroadcast ({mb}, 1 rank)", sa, sb, "nccl4py nccl.bindings"))
    sa, sb = _ab(a_layer, b_layer, args, drain)
    rows.append(("broadcast per layer (4 calls)", sa, sb, "cuda.bindings + nccl4py"))
    _, sp = _ab(None, pdkv_layer, args, drain)
    rows.append(("pdkv NcclComm.broadcast", None, sp, "bindings + pdkv's Python (4.77 us through ctypes before)"))
    rows += _nccl_core(args, t, stream, drain, sp)
    drain()
    comm.close()
    ref.destroy()
    return rows


def _nccl_core(args: argparse.Namespace, t: torch.Tensor, stream: int, drain, pdkv: list[float] | None) -> list[Row]:  # type: ignore[no-untyped-def]
    """nccl4py's high-level communicator, where cuda-core is installed."""
    try:
        import nccl.core as nc
    except ImportError as exc:
        print(f"nccl: nccl.core not importable ({exc}; it needs cuda-core): its row is skipped")
        return []
    try:
        comm = nc.Communicator.init(1, 0, nc.get_unique_id())

        def b() -> None:
            comm.broadcast(t, t, 0, stream=stream)

        _, sb = _ab(None, b, args, drain)
        getattr(comm, "destroy", lambda: None)()
    except Exception as exc:  # the high-level layer is a bonus: say why, keep the other rows
        print(f"nccl: nccl.core's broadcast FAILED ({type(exc).__name__}: {exc}): its row is skipped")
        return []
    return [("nccl.core broadcast (ctypes col: pdkv's)", pdkv, sb, "vs pdkv NcclComm.broadcast, both bindings")]


def _versions() -> str:
    out = [f"torch {torch.__version__}"]
    for name in ("cuda-bindings", "cuda-pathfinder", "nccl4py", "cuda-core"):
        try:
            from importlib.metadata import version

            out.append(f"{name} {version(name)}")
        except Exception:
            out.append(f"{name} missing")
    return ", ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.splitlines()[0]
    )
    ap.add_argument("--calls", type=int, default=20000, help="calls a round and side")
    ap.add_argument("--rounds", type=int, default=3, help="rounds a side, alternating")
    ap.add_argument("--batch", type=int, default=10, help="calls a timed sample")
    ap.add_argument("--skip-nccl", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_bindings needs a CUDA GPU")
    torch.cuda.init()
    print(f"{torch.cuda.get_device_name(0)}; {_versions()}")
    rows = bench_lane(args)
    if not args.skip_nccl:
        rows += bench_nccl(args)
    print_table(rows, args)


if __name__ == "__main__":
    main()
