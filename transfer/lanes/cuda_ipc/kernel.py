"""The gather kernel: CUDA C compiled once by NVRTC, launched through the driver API.

Why not Triton or torch: on the decode's fetch path the launch itself was the largest host
cost left. Triton's launcher (argument binding, specialisation keys, its stream lookup)
and torch's stream guards and events took as much host time as the kernel's own GPU time
at 8k tokens. Through the driver a launch is a few
calls on arguments prepared once, and the request's page ids ride in the launch's
parameters rather than in a copy queued before it. The driver calls go through NVIDIA's
`cuda-bindings` (`cuda.bindings.driver`, the `gpu` extra), with every handle wrapped once:
no call is dearer through them than through hand-written ctypes
(docs/benchmarks.md#driver-bindings-host-cost-a-call). NVRTC
ships with every CUDA build of torch (`nvidia-cuda-nvrtc`); the kernel is compiled for the
GPU at hand the first time a lane starts in a process (tens of milliseconds).

The kernel copies, for task `t` (a chunk of one buffer's item) of page `i`, words
`[first, first + block)` of the item from its source page to its destination page. Its
table argument (see `transfer.lanes.cuda_ipc.gather._meta`) holds per buffer: source base, destination
base, item words, source page list; per task: its buffer and its first word. The page ids
(each source list, then the destination pages) are int32 parameters, read in place
(`__grid_constant__`, so compute capability 7.0 or newer). Everything in them was checked
on the host: a bad address would fault the decode's whole context.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from pdkv.errors import TransferError
from transfer.lanes.cuda_ipc.driver import CudaDriver

WORDS = (16, 8, 4, 2, 1)  # bytes a load may move; 16: a vector of four 32-bit words
# Page ids a launch can carry in its parameters: six 8-byte scalars and the ids (int32) fill
# the classic 4 KiB of parameters, or 8 or 32 KiB, which CUDA 12.1 drivers allow from Volta
# on. Tiers, since the driver copies every declared byte at each launch (a larger tier costs
# every launch more host time).
IDS = ((4096 - 48) // 4, (8192 - 48) // 4, (32764 - 48) // 4)
_LARGE_PARAMS_CUDA = 12010  # the driver and NVRTC version from which a launch may carry more than 4 KiB

_SOURCE = r"""
// A launch's page ids travel in its parameters (read in place: __grid_constant__), so a
// launch is one driver call with no copy queued before it.
template <int N>
struct PageIds {
  int ids[N];
};

template <typename W, int N>
__device__ __forceinline__ void gather(const long long* __restrict__ meta, long long n_bufs, long long n_tasks,
                                       long long n_pages, long long block, long long lists,
                                       const PageIds<N>& pages) {
  const long long t = blockIdx.x;
  const long long i = blockIdx.y;
  const long long b = meta[4 * n_bufs + t];
  const long long first = meta[4 * n_bufs + n_tasks + t];
  const long long words = meta[2 * n_bufs + b];
  const long long end = first + block < words ? first + block : words;
  const long long src_page = pages.ids[meta[3 * n_bufs + b] * n_pages + i];
  const long long dst_page = pages.ids[lists * n_pages + i];
  const W* src = reinterpret_cast<const W*>(meta[b]) + src_page * words;
  W* dst = reinterpret_cast<W*>(meta[n_bufs + b]) + dst_page * words;
  const long long stride = blockDim.x;
  // Four loads in flight per thread before their stores: a copy is bound by loads in flight.
  for (long long o = first + threadIdx.x; o < end; o += 4 * stride) {
    W v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (o + k * stride < end) v[k] = src[o + k * stride];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (o + k * stride < end) dst[o + k * stride] = v[k];
  }
}

#define GATHER(NAME, W, N)                                                                           \
  extern "C" __global__ void NAME(const long long* meta, long long n_bufs, long long n_tasks,         \
                                  long long n_pages, long long block, long long lists,               \
                                  const __grid_constant__ PageIds<N> pages) {                        \
    gather<W, N>(meta, n_bufs, n_tasks, n_pages, block, lists, pages);                               \
  }

#define GATHER_WORDS_(N)                             \
  GATHER(gather_w16_p##N, uint4, N)                  \
  GATHER(gather_w8_p##N, unsigned long long, N)      \
  GATHER(gather_w4_p##N, unsigned int, N)            \
  GATHER(gather_w2_p##N, unsigned short, N)          \
  GATHER(gather_w1_p##N, unsigned char, N)
#define GATHER_WORDS(N) GATHER_WORDS_(N)  // N expanded before it is pasted into the names

// Launched at a fetch's start, ahead of the gather: wakes the GPU's compute engine while the
// host still checks the fetch's pages.
extern "C" __global__ void prime() {}

GATHER_WORDS(IDS_4K)
#ifdef IDS_8K
GATHER_WORDS(IDS_8K)
GATHER_WORDS(IDS_32K)
#endif
"""


# NVRTC stays on ctypes: it runs once a process, where a compile's tens of milliseconds dwarf
# any call's cost, and ctypes loads the very libnvrtc of torch's CUDA wheels (found below),
# where `cuda.bindings.nvrtc` would look for one through cuda-pathfinder.
def _load_nvrtc() -> ctypes.CDLL:
    import torch

    major = (torch.version.cuda or "").split(".")[0]
    site = os.path.dirname(os.path.dirname(torch.__file__))  # the CUDA wheels torch came with
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    names += sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", f"libnvrtc.so.{major}*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise TransferError(f"NVRTC (libnvrtc.so.{major}) not found: the GPU lane cannot compile its kernel")


def _nvrtc_version(nvrtc: ctypes.CDLL) -> int:
    major, minor = ctypes.c_int(), ctypes.c_int()
    if nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return 0
    return 1000 * major.value + 10 * minor.value


@functools.cache
def _compile(arch: str, large_ids: bool) -> bytes:
    """The kernels' cubin for `arch` (say "sm_90"); with `large_ids`, also the variants whose
    launches carry 8 and 32 KiB of parameters."""
    nvrtc = _load_nvrtc()
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise TransferError(f"NVRTC {what}: {nvrtc.nvrtcGetErrorString(rc).decode()}")

    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), _SOURCE.encode(), b"gather.cu", 0, None, None), "create")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", f"-DIDS_4K={IDS[0]}".encode()]
        if large_ids:
            opts += [f"-DIDS_8K={IDS[1]}".encode(), f"-DIDS_32K={IDS[2]}".encode()]
        if nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise TransferError(f"NVRTC could not compile the gather kernel for {arch}:\n{log.value.decode()}")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


_EVENT_DISABLE_TIMING = 0x2  # CU_EVENT_DISABLE_TIMING


class DriverEvent:
    """A CUDA event of the kernel's context: recorded on a stream, waited on from any thread.
    `timed`: it takes a timestamp (for `seconds_until`); an untimed one is cheaper to record.
    `event`: the bindings' `CUevent`; `handle`: its address."""

    __slots__ = ("_k", "event", "handle", "_record", "_sync", "_query", "_not_ready")

    def __init__(self, kernel: GatherKernel, timed: bool = True) -> None:
        self._k = kernel
        drv = kernel.drv
        with kernel.current():
            rc, event = drv.cuEventCreate(0 if timed else _EVENT_DISABLE_TIMING)
            kernel.check(rc, "cuEventCreate")
        self.event = event
        self.handle = int(event)
        self._record, self._sync, self._query = drv.cuEventRecord, drv.cuEventSynchronize, drv.cuEventQuery
        self._not_ready = drv.CUresult.CUDA_ERROR_NOT_READY  # the bindings' own value: compared as returned

    def record(self, stream: Any) -> None:
        """Record on `stream` (a `CUstream` from `GatherKernel.stream`)."""
        rc = self._record(self.event, stream)[0]
        if rc:
            self._k.check(rc, "cuEventRecord")

    def synchronize(self) -> None:
        """Block this thread until the event has passed (the bindings release the GIL meanwhile)."""
        rc = self._sync(self.event)[0]
        if rc:
            self._k.check(rc, "cuEventSynchronize")

    def query(self) -> bool:
        """Whether the event has passed, without blocking (the bindings release the GIL for
        the call); a sticky CUDA error raises."""
        rc = self._query(self.event)[0]
        if rc == self._not_ready:
            return False
        if rc:
            self._k.check(rc, "cuEventQuery")
        return True

    def seconds_until(self, end: DriverEvent) -> float:
        rc, ms = self._k.drv.cuEventElapsedTime(self.event, end.event)
        self._k.check(rc, "cuEventElapsedTime")
        return float(ms) / 1e3


class GatherKernel:
    """The gather kernel loaded in one GPU's primary context (the one torch uses).

    Handles (context, functions, streams) are the bindings' objects, made once: a call given
    a plain int would wrap it again each time."""

    _lock = threading.Lock()
    _loaded: dict[int, GatherKernel] = {}

    def __init__(self, device: int) -> None:
        import torch

        self.device = device
        self.driver = CudaDriver.get()
        self.drv = drv = self.driver.drv
        self.check = self.driver.check
        rc, dev = drv.cuDeviceGet(device)
        self.check(rc, "cuDeviceGet")
        rc, ctx = drv.cuDevicePrimaryCtxRetain(dev)
        self.check(rc, "cuDevicePrimaryCtxRetain")
        self.ctx = ctx
        self._ctx_id = int(ctx)
        self._ctx_get, self._ctx_push, self._ctx_pop = drv.cuCtxGetCurrent, drv.cuCtxPushCurrent, drv.cuCtxPopCurrent
        self._launch = self.cu_launch = drv.cuLaunchKernel  # `cu_launch`: for a caller holding its function
        major, minor = torch.cuda.get_device_capability(device)
        rc, version = drv.cuDriverGetVersion()
        self.check(rc, "cuDriverGetVersion")
        large = major >= 7 and min(int(version), _nvrtc_version(_load_nvrtc())) >= _LARGE_PARAMS_CUDA
        cubin = _compile(f"sm_{major}{minor}", large)
        # Page ids one launch can carry, fewest first: a launch takes the smallest that holds its
        # ids (the driver copies every parameter byte at a launch), a plan beyond it several.
        self.capacities = IDS if large else IDS[:1]
        image = ctypes.create_string_buffer(cubin, len(cubin))  # passed by address: every bindings version takes that
        with self.current():
            rc, module = drv.cuModuleLoadData(ctypes.addressof(image))
            self.check(rc, "cuModuleLoadData")
            self.functions: dict[tuple[int, int], Any] = {}
            for ids in self.capacities:
                for word in WORDS:
                    rc, f = drv.cuModuleGetFunction(module, f"gather_w{word}_p{ids}".encode())
                    self.check(rc, "cuModuleGetFunction")
                    self.functions[word, ids] = f
            rc, f = drv.cuModuleGetFunction(module, b"prime")
            self.check(rc, "cuModuleGetFunction")
            self._prime = f
        self._module = module

    @classmethod
    def on(cls, device: int) -> GatherKernel:
        with cls._lock:
            if device not in cls._loaded:
                cls._loaded[device] = cls(device)
            return cls._loaded[device]

    def stream(self, handle: int) -> Any:
        """The bindings' `CUstream` for a stream's handle (torch's `cuda_stream`), made once
        per stream and passed to `prime`, `launch` and `DriverEvent.record`."""
        return self.drv.CUstream(handle)

    @contextmanager
    def current(self) -> Iterator[None]:
        """This GPU's primary context current on the calling thread for the block."""
        pushed = self.enter()
        try:
            yield
        finally:
            if pushed:
                self.leave()

    def current_context(self) -> int | None:
        """The address of the context current on the calling thread; None if there is none."""
        rc, current = self._ctx_get()
        self.check(rc, "cuCtxGetCurrent")
        return int(current) or None

    def enter(self) -> bool:
        """Make this GPU's context current unless it is (the usual case on a thread that
        torch set up for this GPU); True if it was pushed, and `leave` must pop it."""
        rc, current = self._ctx_get()
        if rc:
            self.check(rc, "cuCtxGetCurrent")
        if int(current) == self._ctx_id:
            return False
        self.check(self._ctx_push(self.ctx)[0], "cuCtxPushCurrent")
        return True

    def leave(self) -> None:
        self.check(self._ctx_pop()[0], "cuCtxPopCurrent")

    def make_current(self) -> None:
        """Make this GPU's primary context current on the calling thread for good (a
        thread of the lane's own, which waits on its events)."""
        self.check(self.drv.cuCtxSetCurrent(self.ctx)[0], "cuCtxSetCurrent")

    def prime(self, stream: Any) -> None:
        """Queue the empty kernel on `stream` (a `CUstream`; call with the context current)."""
        rc = self._launch(self._prime, 1, 1, 1, 32, 1, 1, 0, stream, None, 0)[0]
        if rc:
            self.check(rc, "cuLaunchKernel")

    def launch(self, word: int, grid: tuple[int, int], threads: int, stream: Any, args: LaunchArgs) -> None:
        """Queue the kernel for `word`-byte loads with `args` on `stream` (a `CUstream`; call
        with the context current)."""
        f = self.functions[word, args.capacity]
        rc = self._launch(f, grid[0], grid[1], 1, threads, 1, 1, 0, stream, args.address, 0)[0]
        if rc:
            self.check(rc, "cuLaunchKernel")


class LaunchArgs:
    """The kernel's parameters, set in place: five scalars, the lists' count and up to
    `capacity` page ids. The driver copies them at the launch, so one set serves every
    launch from one thread."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.values = (ctypes.c_int64 * 6)()
        self._ids = (ctypes.c_int32 * capacity)()
        self.ids = np.frombuffer(memoryview(self._ids), np.int32)  # written through numpy: one copy, cast included
        base = ctypes.addressof(self.values)
        self.params = (ctypes.c_void_p * 7)(*range(base, base + 48, 8), ctypes.addressof(self._ids))
        self.address = ctypes.addressof(self.params)  # the launch's `void**`, as the bindings take it
