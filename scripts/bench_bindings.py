"""Host cost per call of the hot path's CUDA driver and NCCL calls: pdkv's hand-written
ctypes against NVIDIA's bindings (issue 30 §6), on one GPU.

The question: can `cuda-bindings` (`cuda.bindings.driver`, 13.x) replace the ctypes in the
GPU lane (the gather kernel's launch and events: `GatherKernel`, `DriverEvent`,
`GatherLane.launch`/`prime`) and `nccl4py` the ctypes `ncclBroadcast` of the owner
broadcast (`pdkv/nccl.py`), at an equal or lower host cost a call? Each call is made
exactly as pdkv makes it (the same handles, argument types set once, the return code
checked), then through the bindings with the handles wrapped once (`CUfunction`,
`CUstream`, `CUevent`), as pdkv would keep them. Rounds of each alternate (A, B, A, B...);
a sample is `--batch` calls timed with `time.perf_counter_ns` and divided; median and p90
over all samples, in microseconds a call. The kernel's launch is checked byte-exact both
ways before it is timed; queued launches are drained between samples (untimed) so that
no launch waits for a full queue.

Rows, the lane's per fetch (`GatherLane.prime`, `.launch`, and its waiting thread):
cuCtxGetCurrent (the `enter` check, twice a fetch), cuLaunchKernel of the empty `prime`
kernel, cuLaunchKernel of the gather (7 parameters, 4 KiB of page ids), cuEventRecord,
cuEventSynchronize and cuEventQuery of an event that has passed, cuEventElapsedTime
(`time_kernels`), cuStreamWaitEvent (the broadcast's ordering); "lane fetch, all calls":
enter + prime + enter + launch + record. The broadcast's per layer (`NcclComm.broadcast`):
ncclBroadcast alone (1 rank, a 6 MiB layer, in place), and "broadcast per layer": record
+ wait + ncclBroadcast + record, with pdkv's `NcclComm.broadcast` itself (Python around
the same ctypes calls, its watchdog running) as a third reference. nccl4py's high-level
`nccl.core.Communicator.broadcast` is timed too where `cuda-core` is installed.

    python3 scripts/bench_bindings.py [--calls 20000] [--rounds 3] [--batch 10]

Needs a CUDA GPU; a part whose package is missing prints a line saying so and is skipped.
On the lent machine (no network), from wheels fetched here (see the report of issue 30):

    python3 -m pip install --no-deps .whl3/cuda_pathfinder-*.whl .whl3/cuda_bindings-*.whl .whl3/nccl4py-*.whl
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

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
        self.function = self.k.functions[16, self.capacity]
        self.grid, self.threads = (1, _PAGES), 128
        self.done = kmod.DriverEvent(self.k, timed=False)
        self.t0, self.t1 = kmod.DriverEvent(self.k), kmod.DriverEvent(self.k)
        self.other = torch.cuda.Stream(torch.device("cuda:0")).cuda_stream
        torch.cuda.synchronize()

    def expect(self) -> torch.Tensor:
        want = torch.zeros_like(self.src)
        want[torch.from_numpy(self.dst_pages).cuda()] = self.src[torch.from_numpy(self.src_pages).cuda()]
        return want

    def drain(self) -> None:
        self.stream_obj.synchronize()


def lane_ctypes(lane: _Lane) -> dict[str, Callable[[], None]]:
    """The calls as pdkv makes them (`GatherKernel`, `DriverEvent`, `GatherLane`)."""
    k, api, check = lane.k, lane.k.api, lane.k.check
    stream, args, f = lane.stream, lane.args, lane.function
    (g0, g1), threads = lane.grid, lane.threads
    done, t0, t1, other = lane.done, lane.t0, lane.t1, lane.other
    ms = ctypes.c_float()
    # pdkv/nccl.py's two calls that the lane's module does not declare, typed as it types them
    # (a CDLL of our own: the shared one's function objects stay as pdkv set them).
    cuda = ctypes.CDLL("libcuda.so.1")
    api_query = cuda.cuEventQuery
    api_query.argtypes, api_query.restype = [ctypes.c_void_p], ctypes.c_int
    api_wait = cuda.cuStreamWaitEvent
    api_wait.argtypes, api_wait.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], ctypes.c_int

    def enter() -> None:
        if k.enter():  # cuCtxGetCurrent, and a push where the context was not current
            k.leave()

    def prime() -> None:
        k.prime(stream)

    def launch() -> None:
        check(api.launch(f, g0, g1, 1, threads, 1, 1, 0, stream, args.params, None), "cuLaunchKernel")

    def record() -> None:
        done.record(stream)

    def synchronize() -> None:
        done.synchronize()

    def query() -> None:  # as pdkv/nccl.py's `NcclWork.is_completed`
        rc = api_query(done.handle)
        if rc != 0:
            check(rc, "cuEventQuery")

    def elapsed() -> None:
        check(api.event_elapsed(ctypes.byref(ms), t0.handle, t1.handle), "cuEventElapsedTime")

    def wait_event() -> None:  # as pdkv/nccl.py's `NcclComm.broadcast` and `NcclWork.wait`
        check(api_wait(other, done.handle, 0), "cuStreamWaitEvent")

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


def lane_bindings(lane: _Lane, drv) -> dict[str, Callable[[], None]]:  # type: ignore[no-untyped-def]
    """The same calls through `cuda.bindings.driver`, its handles wrapped once."""
    ok = drv.CUresult.CUDA_SUCCESS

    def check(rc, what: str) -> None:  # type: ignore[no-untyped-def]
        if rc != ok:
            raise RuntimeError(f"{what}: {rc!r}")

    ctx = drv.CUcontext(lane.k.ctx)
    ctx_int = int(ctx)
    f = drv.CUfunction(lane.function)
    prime_f = drv.CUfunction(lane.k._prime)
    stream, other = drv.CUstream(lane.stream), drv.CUstream(lane.other)
    done, t0, t1 = drv.CUevent(lane.done.handle), drv.CUevent(lane.t0.handle), drv.CUevent(lane.t1.handle)
    params = ctypes.addressof(lane.args.params)  # the same parameter array: void** as an int
    (g0, g1), threads = lane.grid, lane.threads
    launch_kernel, get_current = drv.cuLaunchKernel, drv.cuCtxGetCurrent
    push, pop = drv.cuCtxPushCurrent, drv.cuCtxPopCurrent
    record_event, sync_event, query_event = drv.cuEventRecord, drv.cuEventSynchronize, drv.cuEventQuery
    elapsed_time, wait_event_ = drv.cuEventElapsedTime, drv.cuStreamWaitEvent

    def enter() -> None:
        rc, current = get_current()
        check(rc, "cuCtxGetCurrent")
        if int(current) != ctx_int:
            check(push(ctx)[0], "cuCtxPushCurrent")
            check(pop()[0], "cuCtxPopCurrent")

    def prime() -> None:
        check(launch_kernel(prime_f, 1, 1, 1, 32, 1, 1, 0, stream, None, 0)[0], "cuLaunchKernel")

    def launch() -> None:
        check(launch_kernel(f, g0, g1, 1, threads, 1, 1, 0, stream, params, 0)[0], "cuLaunchKernel")

    def record() -> None:
        check(record_event(done, stream)[0], "cuEventRecord")

    def synchronize() -> None:
        check(sync_event(done)[0], "cuEventSynchronize")

    def query() -> None:
        check(query_event(done)[0], "cuEventQuery")

    def elapsed() -> None:
        rc, _ms = elapsed_time(t0, t1)
        check(rc, "cuEventElapsedTime")

    def wait_event() -> None:
        check(wait_event_(other, done, 0)[0], "cuStreamWaitEvent")

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
    lane = _Lane()
    a = lane_ctypes(lane)
    b: dict[str, Callable[[], None]] | None = None
    note = ""
    try:
        from cuda.bindings import driver as drv
    except ImportError as exc:
        print(f"driver: cuda-bindings not installed ({exc}): SKIPPED, the bindings columns are empty")
        note = "(no cuda-bindings)"
    else:
        b = lane_bindings(lane, drv)
    want = lane.expect()
    for side, calls in (("ctypes", a), ("cuda.bindings", b)):
        if calls is None:
            continue
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
    lane.t0.record(lane.stream)
    lane.t1.record(lane.stream)
    lane.done.record(lane.stream)
    lane.drain()
    rows: list[Row] = []

    def row(name: str, key: str, between: Callable[[], None] | None = None) -> None:
        sa, sb = _ab(a[key], b[key] if b else None, args, between)
        rows.append((name, sa, sb, note))

    row("cuCtxGetCurrent (enter)", "enter")
    row("cuLaunchKernel prime (no params)", "prime", lane.drain)
    row(f"cuLaunchKernel gather ({lane.capacity * 4 + 48} B params)", "launch", lane.drain)
    row("cuEventRecord (untimed event)", "record", lane.drain)
    lane.done.record(lane.stream)
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


def bench_nccl(args: argparse.Namespace) -> list[Row]:
    from pdkv import nccl as pn

    api = pn.nccl_library()
    if api is None:
        print("nccl: pdkv.nccl found no loadable libnccl (torch built with NCCL linked in?): skipped")
        return []
    device = torch.device("cuda:0")
    comm = pn.NcclComm(pn.unique_id(), 0, 1, device, timeout=60.0)
    t = torch.zeros(_LAYER_BYTES, dtype=torch.uint8, device=device)
    ptr, n, stream, cc = t.data_ptr(), t.nbytes, comm._stream, comm.comm
    ready, end = comm._event(), comm._event()
    current = pn._current_stream

    def a_broadcast() -> None:
        rc = api.broadcast(ptr, ptr, n, pn._UINT8, 0, cc, stream)
        if rc != 0:
            raise RuntimeError(f"ncclBroadcast: {rc}")

    def a_layer() -> None:
        pn._check_cuda(api.event_record(ready, current(0)), "cuEventRecord")
        pn._check_cuda(api.stream_wait(stream, ready, 0), "cuStreamWaitEvent")
        a_broadcast()
        pn._check_cuda(api.event_record(end, stream), "cuEventRecord")

    def pdkv_layer() -> None:
        comm.broadcast([t], 0, "bench")

    def drain() -> None:
        comm.stream.synchronize()

    rows: list[Row] = []
    b_broadcast = b_layer = None
    nb = note = None
    try:
        import nccl.bindings.nccl as nb  # type: ignore[no-redef]
    except ImportError as exc:
        note = "(no nccl4py)"
        print(f"nccl: nccl4py not installed ({exc}): the bindings columns of the broadcast are empty")
    drv = None
    try:
        from cuda.bindings import driver as drv
    except ImportError:
        pass
    b_comm = None
    if nb is not None:
        torch.cuda.set_device(device)
        b_comm = nb.comm_init_rank(1, nb.get_unique_id(), 0)  # nccl4py's own `Comm`, on the same device
        print(f"nccl: nccl4py {nb.get_version()} (NCCL version code), pdkv's ctypes: the same process")
        u8 = int(nb.DataType.Uint8)
        nb_broadcast = nb.broadcast

        def b_broadcast() -> None:
            nb_broadcast(ptr, ptr, n, u8, 0, b_comm, stream)  # raises on an NCCL error

        if drv is not None:
            ok = drv.CUresult.CUDA_SUCCESS
            d_ready, d_end, d_stream = drv.CUevent(ready), drv.CUevent(end), drv.CUstream(stream)
            record_event, wait_event = drv.cuEventRecord, drv.cuStreamWaitEvent

            def b_layer() -> None:
                if record_event(d_ready, current(0))[0] != ok:
                    raise RuntimeError("cuEventRecord")
                if wait_event(d_stream, d_ready, 0)[0] != ok:
                    raise RuntimeError("cuStreamWaitEvent")
                b_broadcast()
                if record_event(d_end, d_stream)[0] != ok:
                    raise RuntimeError("cuEventRecord")

        print(f"nccl: libnccl mapped in this process: {_nccl_libraries()}")
    mb = f"{_LAYER_BYTES >> 20} MiB"
    sa, sb = _ab(a_broadcast, b_broadcast, args, drain)
    rows.append((f"ncclBroadcast ({mb}, 1 rank)", sa, sb, note or "nccl4py nccl.bindings"))
    sa, sb = _ab(a_layer, b_layer, args, drain)
    layer_note = note or ("cuda.bindings + nccl4py" if b_layer else "(no cuda-bindings)")
    rows.append(("broadcast per layer (4 calls)", sa, sb, layer_note))
    sa, _ = _ab(pdkv_layer, None, args, drain)
    rows.append(("pdkv NcclComm.broadcast (reference)", sa, None, "ctypes + pdkv's Python"))
    rows += _nccl_core(args, t, stream, drain, sa)
    drain()
    comm.close()
    if b_comm is not None:
        nb.comm_destroy(b_comm)
    return rows


def _nccl_core(args: argparse.Namespace, t: torch.Tensor, stream: int, drain, pdkv: list[float]) -> list[Row]:  # type: ignore[no-untyped-def]
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
    return [("nccl.core Communicator.broadcast", pdkv, sb, "vs pdkv NcclComm.broadcast")]


def _versions() -> str:
    out = [f"torch {torch.__version__}"]
    for name in ("cuda-bindings", "cuda-pathfinder", "nccl4py", "cuda-core"):
        try:
            from importlib.metadata import version

            out.append(f"{name} {version(name)}")
        except Exception:
            out.append(f"{name} missing")
    return ", ".join(out)


def _point_nccl4py_at_torch() -> None:
    """nccl4py finds libnccl through cuda-pathfinder: one already loaded (torch loads its own
    at CUDA init), else site-packages' nvidia/nccl/lib, else $NCCL_HOME/lib. Name torch's
    wheel there too, so that it never loads a second copy."""
    site = Path(torch.__file__).resolve().parents[1]
    libs = glob.glob(str(site / "nvidia" / "nccl" / "lib" / "libnccl.so*"))
    if libs and "NCCL_HOME" not in os.environ:
        os.environ["NCCL_HOME"] = str(site / "nvidia" / "nccl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls a round and side")
    ap.add_argument("--rounds", type=int, default=3, help="rounds a side, alternating")
    ap.add_argument("--batch", type=int, default=10, help="calls a timed sample")
    ap.add_argument("--skip-nccl", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_bindings needs a CUDA GPU")
    torch.cuda.init()
    _point_nccl4py_at_torch()
    print(f"{torch.cuda.get_device_name(0)}; {_versions()}")
    rows = bench_lane(args)
    if not args.skip_nccl:
        rows += bench_nccl(args)
    print_table(rows, args)


if __name__ == "__main__":
    main()
