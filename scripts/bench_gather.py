"""The same-host GPU lane's kernel alone, on local memory: GB/s against a contiguous copy.

DSA layout (61 layers, latent and indexer), fragmented source and destination pages as in
bench_fetch; one gather plan over every layer, timed with CUDA events, for a few block
sizes and warp counts, with the host time of queueing a launch. Needs a GPU.

    python3 scripts/bench_gather.py [--tokens 1024,8192,32768] [--runs 20]
    python3 scripts/bench_gather.py --seen      how soon the host sees a kernel's end, by mechanism
    python3 scripts/bench_gather.py --switch    how soon a kernel runs after another process's work
"""

from __future__ import annotations

import argparse
import ctypes
import queue
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.app.synthetic import fragmented_page_order  # noqa: E402
from transfer.lanes.cuda_ipc.gather import Gatherer  # noqa: E402
from transfer.lanes.cuda_ipc.plan import build_gather_plan
from transfer.lanes.runs import BufferPair  # noqa: E402


def pairs(dst: DSAKVPool, src: DSAKVPool) -> list[BufferPair]:
    out = []
    for layer in range(dst.layout.layer_num):
        for d, s in ((dst.kv_buffer[layer], src.kv_buffer[layer]), (dst.index_buffer[layer], src.index_buffer[layer])):
            item = dst.layout.kv_page_bytes if d is dst.kv_buffer[layer] else dst.layout.index_page_bytes
            out.append(BufferPair(d.data_ptr(), s.data_ptr(), item, d.nbytes // item, s.nbytes // item))
    return out


class _TorchCopy:
    """A contiguous copy queued with torch, timed like a lane's `Launch`."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.a.record()
        dst.copy_(src)
        self.b.record()

    def wait(self) -> None:
        self.b.synchronize()

    def seconds(self) -> float:
        return self.a.elapsed_time(self.b) / 1e3


def timed(fn, runs: int) -> tuple[float, float]:
    """Median seconds on the GPU of what `fn` queues, and median host seconds of queueing it."""
    fn().wait()
    gpu, host = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        launch = fn()
        host.append(time.perf_counter() - t0)
        launch.wait()
        gpu.append(launch.seconds())
    return statistics.median(gpu), statistics.median(host)


# --- How soon the host sees a kernel's end (issue 44, item 2) ---------------------------

_SPIN = r"""
// One thread spins `ns` nanoseconds of the GPU's clock, then writes its end time and,
// last, `seq` into a host-mapped word: the word is the kernel's last write.
extern "C" __global__ void spin_end(unsigned long long ns, unsigned long long* word, unsigned long long seq) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  word[1] = t;
  __threadfence_system();
  *(volatile unsigned long long*)word = seq;
}
"""


def _spin_kernel(kernel):  # type: ignore[no-untyped-def]
    """The spin kernel of `_SPIN`, compiled by NVRTC and loaded in `kernel`'s context."""
    from transfer.lanes.cuda_ipc.kernel import _load_nvrtc

    nvrtc = _load_nvrtc()
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), _SPIN.encode(), b"spin.cu", 0, None, None) == 0
    major, minor = torch.cuda.get_device_capability(kernel.device)
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
    assert nvrtc.nvrtcCompileProgram(prog, 1, (ctypes.c_char_p * 1)(*opts)) == 0
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    drv = kernel.drv
    with kernel.current():
        rc, module = drv.cuModuleLoadData(ctypes.addressof(cubin))
        kernel.check(rc, "cuModuleLoadData")
        rc, fn = drv.cuModuleGetFunction(module, b"spin_end")
        kernel.check(rc, "cuModuleGetFunction")
    return fn, module


class _Spin:
    """The spin kernel on a stream of its own: `launch(ns)` queues one that spins `ns` of the
    GPU's clock and writes its sequence number last into a host-mapped word (`word[0]`)."""

    def __init__(self) -> None:
        from transfer.lanes.cuda_ipc.kernel import GatherKernel

        self.kernel = kernel = GatherKernel.on(0)
        self.fn, self._module = _spin_kernel(kernel)
        self.stream_t = torch.cuda.Stream("cuda:0")
        self.stream = kernel.stream(self.stream_t.cuda_stream)
        self.host = torch.zeros(2, dtype=torch.int64, pin_memory=True)  # cudaHostAlloc'd: mapped under UVA
        self.word = self.host.numpy()
        self.libcuda = ctypes.CDLL("libcuda.so.1")
        dptr = ctypes.c_uint64()
        with kernel.current():
            rc = self.libcuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(self.host.data_ptr()), 0)
        assert rc == 0, f"cuMemHostGetDevicePointer: {rc}"
        self.dptr = dptr.value
        self.vals = (ctypes.c_uint64 * 3)()
        self.params = (ctypes.c_void_p * 3)(*[ctypes.addressof(self.vals) + 8 * i for i in range(3)])
        self.seq = 0

    def launch(self, ns: int) -> int:
        """Queue a spin of `ns` (call with the context current); returns its sequence number."""
        self.seq += 1
        self.vals[0], self.vals[1], self.vals[2] = ns, self.dptr, self.seq
        params = ctypes.addressof(self.params)
        rc = self.kernel.drv.cuLaunchKernel(self.fn, 1, 1, 1, 1, 1, 1, 0, self.stream, params, 0)[0]
        self.kernel.check(rc, "cuLaunchKernel")
        return self.seq


def seen(args: argparse.Namespace) -> None:
    """Microseconds from a kernel's end to the host seeing it, by mechanism: on the thread
    that notices, and on an asyncio loop woken from there (the decode's case), each after an
    idle spell (`--idle-ms`, a fetch after its prefill) and back to back."""
    import asyncio
    import threading

    from transfer.lanes.cuda_ipc.kernel import DriverEvent

    spin = _Spin()
    kernel, stream, word = spin.kernel, spin.stream, spin.word
    drv, stream_t, libcuda = kernel.drv, spin.stream_t, spin.libcuda
    ns = int(args.spin_us * 1000)

    def launch() -> int:
        with kernel.current():
            return spin.launch(ns)

    spin_ev = DriverEvent(kernel, timed=False)
    block_ev_h = None
    with kernel.current():
        rc, block_ev_h = drv.cuEventCreate(0x1 | 0x2)  # CU_EVENT_BLOCKING_SYNC | DISABLE_TIMING
        kernel.check(rc, "cuEventCreate")

    # Each mechanism: start(loop, seq, fut, stamp) arranges for `stamp[0]` (the thread that
    # noticed) to be set and `fut` resolved on `loop` once the kernel of `seq` ended.
    jobs: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]

    def worker() -> None:
        kernel.make_current()
        while (item := jobs.get()) is not None:
            item()

    threading.Thread(target=worker, daemon=True).start()

    def via_thread(wait):  # type: ignore[no-untyped-def]
        def start(loop, s, fut, stamp):  # type: ignore[no-untyped-def]
            def body() -> None:
                wait(s)
                stamp[0] = time.perf_counter()
                loop.call_soon_threadsafe(fut.set_result, None)

            jobs.put(body)

        return start

    def event_spin(s: int) -> None:
        spin_ev.synchronize()

    def event_block(s: int) -> None:
        rc = drv.cuEventSynchronize(block_ev_h)[0]
        kernel.check(rc, "cuEventSynchronize")

    def event_query(s: int) -> None:
        q = drv.cuEventQuery
        while q(spin_ev.event)[0]:
            pass

    def word_sleep0(s: int) -> None:
        while word[0] != s:
            time.sleep(0)

    def word_spin(s: int) -> None:
        while word[0] != s:
            pass

    callbacks = []

    def host_func(loop, s, fut, stamp):  # type: ignore[no-untyped-def]
        def cb(_user):  # type: ignore[no-untyped-def]
            stamp[0] = time.perf_counter()
            loop.call_soon_threadsafe(fut.set_result, None)

        c = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(cb)
        callbacks.append(c)  # kept alive until it ran
        del callbacks[:-4]
        with kernel.current():  # through libcuda itself: the bindings' host-function wrapper is version-bound
            rc = libcuda.cuLaunchHostFunc(ctypes.c_void_p(stream_t.cuda_stream), c, None)
        assert rc == 0, f"cuLaunchHostFunc: {rc}"

    async def loop_word(s: int, stamp) -> None:  # type: ignore[no-untyped-def]
        while word[0] != s:
            await asyncio.sleep(0)
        stamp[0] = time.perf_counter()

    async def loop_event(s: int, stamp) -> None:  # type: ignore[no-untyped-def]
        while not spin_ev.query():  # the lane's choice (`gather._polled`)
            await asyncio.sleep(0)
        stamp[0] = time.perf_counter()

    mechanisms = {
        "event, spin sync (lane, parked loop)": via_thread(event_spin),
        "event, blocking sync": via_thread(event_block),
        "event, query loop": via_thread(event_query),
        "mapped word, thread spin": via_thread(word_spin),
        "mapped word, thread sleep(0)": via_thread(word_sleep0),
        "stream callback (cuLaunchHostFunc)": host_func,
        "mapped word, loop polls": loop_word,
        "event, loop queries (lane now)": loop_event,
    }

    async def trial(name: str, start) -> tuple[float, float, float]:  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        stamp = [0.0]
        t0 = time.perf_counter()
        s = launch()
        with kernel.current():
            spin_ev.record(stream)
            kernel.check(drv.cuEventRecord(block_ev_h, stream)[0], "cuEventRecord")
        if start in (loop_word, loop_event):
            await start(s, stamp)
        else:
            fut = loop.create_future()
            start(loop, s, fut, stamp)
            await fut
        t_loop = time.perf_counter()
        gpu_end = int(word[1])
        return stamp[0] - t0, t_loop - t0, gpu_end

    async def run_all() -> None:
        spin = args.spin_us
        print(f"\nkernel end seen by the host: a {spin:.0f} us spin kernel; us past its spin, p50 / p90")
        print(f"{'mechanism':<38}{'mode':<10}{'thread sees':>18}{'loop resumes':>18}")
        for idle in (args.idle_ms, 0.0):
            for name, start in mechanisms.items():
                rows = []
                for i in range(args.seen_runs + 3):
                    if idle:
                        await asyncio.sleep(idle / 1e3)
                    try:
                        r = await asyncio.wait_for(trial(name, start), 5)
                    except Exception as exc:
                        print(f"{name:<38} failed: {exc!r}")
                        break
                    if i >= 3:
                        rows.append(r)
                if not rows:
                    continue
                th = sorted(1e6 * r[0] - spin for r in rows)
                lo = sorted(1e6 * r[1] - spin for r in rows)
                q = lambda xs, f: xs[int(f * (len(xs) - 1))]  # noqa: E731
                mode = f"idle {idle:g}ms" if idle else "b2b"
                cells = f"{q(th, 0.5):>9.1f} / {q(th, 0.9):>6.1f}{q(lo, 0.5):>9.1f} / {q(lo, 0.9):>6.1f}"
                print(f"{name:<38}{mode:<10}{cells}")

    asyncio.run(run_all())
    jobs.put(None)


def _busy(conn) -> None:  # type: ignore[no-untyped-def]
    """Another process's GPU work, 3 ms of matrix products each time it is asked."""
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    while conn.recv():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.003:
            a @ a
        torch.cuda.synchronize()
        conn.send(1)


def switch(args: argparse.Namespace) -> None:
    """How soon the GPU runs a kernel of this process after another process's work on it (a
    fetch right after its owners' prefill, all on one GPU), against after an idle spell: us
    from the first launch call to the host seeing a 100 us spin end, less 100; the spin
    launched at once, or D us after an empty kernel (the lane's prime)."""
    import multiprocessing as mp

    spin = _Spin()
    kernel = spin.kernel
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    other = ctx.Process(target=_busy, args=(child,), daemon=True)
    other.start()

    def trial(delay_us: float | None) -> tuple[float, float]:
        t0 = time.perf_counter()
        with kernel.current():
            if delay_us is not None:
                kernel.prime(spin.stream)
                while (time.perf_counter() - t0) * 1e6 < delay_us:
                    pass
            t1 = time.perf_counter()
            seq = spin.launch(100_000)
        while spin.word[0] != seq:
            pass
        t2 = time.perf_counter()
        return (t2 - t0) * 1e6 - 100, (t2 - t1) * 1e6 - 100

    print("\na 100 us spin kernel's end seen by the host, us less 100, p50 / p90; D: launched D us after the prime")
    print(f"{'before it':<34}{'launch':<12}{'from the first call':>22}{'from its launch':>20}")
    for before in ("idle 20 ms", "another process's 3 ms of work"):
        for delay in (None, 0, 100, 150, 200, 300):
            rows = []
            for i in range(args.seen_runs + 3):
                if before.startswith("idle"):
                    time.sleep(0.02)
                else:
                    parent.send(1)
                    parent.recv()
                if i >= 3:
                    rows.append(trial(delay))
                else:
                    trial(delay)
            cells = ""
            for k in (0, 1):
                xs = sorted(r[k] for r in rows)
                cells += f"{xs[len(xs) // 2]:>12.1f} / {xs[int(0.9 * (len(xs) - 1))]:>6.1f}"
            how = "at once" if delay is None else f"D={delay:g}"
            print(f"{before:<34}{how:<12}{cells}")
    parent.send(0)
    other.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--seen", action="store_true", help="only time how soon the host sees a kernel end, by mechanism")
    ap.add_argument("--spin-us", type=float, default=200.0, help="--seen: the kernel's length")
    ap.add_argument("--idle-ms", type=float, default=20.0, help="--seen: the idle spell before each kernel")
    ap.add_argument("--seen-runs", type=int, default=30)
    ap.add_argument(
        "--switch", action="store_true", help="only time how soon a kernel runs after another process's GPU work"
    )
    args = ap.parse_args()
    if args.seen:
        seen(args)
        return
    if args.switch:
        switch(args)
        return
    layout = dsa_v32(size=max(args.tokens) * 2 + 4096, device="cuda")
    dst, src = DSAKVPool(layout), DSAKVPool(layout)
    rng = np.random.default_rng(7)
    bufs = pairs(dst, src)
    head = ("tokens", "MB", "block", "warps", "kernel GB/s", "contig GB/s", "ratio", "launch us")
    print("".join(f"{h:>12}" for h in head))
    for n in args.tokens:
        k = n // layout.page_size
        s_pages = fragmented_page_order(np.arange(1, layout.num_pages), rng)[:k]
        d_pages = fragmented_page_order(np.arange(1, layout.num_pages), rng)[:k]
        plan = build_gather_plan(bufs, s_pages, d_pages)
        flat_d, flat_s = dst.slab.view(-1), src.slab.view(-1)
        n_bytes = plan.nbytes
        contig = n_bytes / timed(lambda d=flat_d[:n_bytes], s=flat_s[:n_bytes]: _TorchCopy(d, s), args.runs)[0] / 1e9
        for block in (2048, 4096, 8192):  # the lane picks 4096 x 4 warps, or 8192 x 8 from 1 GiB
            for warps in (4, 8):
                lane = Gatherer(torch.device("cuda:0"), (block, warps), timed=True)
                t, host = timed(lambda lane=lane, plan=plan: lane.launch(plan), args.runs)
                gbps = plan.nbytes / t / 1e9
                cells = (n, plan.nbytes / 1e6, block, warps, gbps, contig)
                print("".join(f"{c:>12.0f}" for c in cells) + f"{gbps / contig:>12.2f}{host * 1e6:>12.1f}")


if __name__ == "__main__":
    main()
