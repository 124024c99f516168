"""The gather kernel: CUDA C compiled once by NVRTC, launched through the driver API.

Why not Triton or torch: on the decode's fetch path the launch itself was the largest host
cost left. Triton's launcher (argument binding, specialisation keys, its stream lookup)
and torch's stream guards and events took 0.2-0.4 ms of host time around a 0.23 ms kernel
at 8k tokens on an H200 host (docs/benchmarks.md). Through the driver a launch is a few
ctypes calls on arguments prepared once. NVRTC ships with every CUDA build of torch
(`nvidia-cuda-nvrtc`), so this adds no dependency; the kernel is compiled for the GPU at
hand the first time a lane starts in a process (tens of milliseconds).

The kernel copies, for task `t` (a chunk of one buffer's item) of page `i`, words
`[first, first + block)` of the item from its source page to its destination page. Its
table argument (see `transfer.gather._meta`) holds per buffer: source base, destination
base, item words, source page list; per task: its buffer and its first word. Everything
in it was checked on the host: a bad address would fault the decode's whole context.
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

from pdkv.errors import TransferError
from transfer.cuda_ipc import CudaDriver

__all__ = ["DriverEvent", "GatherKernel", "LaunchArgs", "WORDS"]

WORDS = (16, 8, 4, 2, 1)  # bytes a load may move; 16: a vector of four 32-bit words

_SOURCE = r"""
template <typename W>
__device__ __forceinline__ void gather(const long long* __restrict__ meta, const long long* __restrict__ pages,
                                       long long n_bufs, long long n_tasks, long long n_pages, long long dst0,
                                       long long page0, long long block) {
  const long long t = blockIdx.x;
  const long long i = page0 + blockIdx.y;
  const long long b = meta[4 * n_bufs + t];
  const long long first = meta[4 * n_bufs + n_tasks + t];
  const long long words = meta[2 * n_bufs + b];
  const long long end = first + block < words ? first + block : words;
  const W* src = reinterpret_cast<const W*>(meta[b]) + pages[meta[3 * n_bufs + b] * n_pages + i] * words;
  W* dst = reinterpret_cast<W*>(meta[n_bufs + b]) + pages[dst0 + i] * words;
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

#define GATHER(NAME, W)                                                                              \
  extern "C" __global__ void NAME(const long long* meta, const long long* pages, long long n_bufs,    \
                                  long long n_tasks, long long n_pages, long long dst0, long long page0, \
                                  long long block) {                                                 \
    gather<W>(meta, pages, n_bufs, n_tasks, n_pages, dst0, page0, block);                             \
  }

GATHER(gather_w16, uint4)
GATHER(gather_w8, unsigned long long)
GATHER(gather_w4, unsigned int)
GATHER(gather_w2, unsigned short)
GATHER(gather_w1, unsigned char)
"""

_EVENT_DISABLE_TIMING = 0x2
_NOT_READY = 600  # CUDA_ERROR_NOT_READY


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


@functools.cache
def _compile(arch: str) -> bytes:
    """The kernels' cubin for `arch` (say "sm_90")."""
    nvrtc = _load_nvrtc()
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise TransferError(f"NVRTC {what}: {nvrtc.nvrtcGetErrorString(rc).decode()}")

    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), _SOURCE.encode(), b"gather.cu", 0, None, None), "create")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
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


class _Api:
    """The driver entry points of a launch, argument types set once: ctypes then converts
    without guessing, and a call costs about a microsecond."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, u, st, pvp = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)

        def fn(names: tuple[str, ...], *argtypes: Any) -> Any:
            f = next(getattr(lib, n) for n in names if hasattr(lib, n))
            f.argtypes, f.restype = list(argtypes), ctypes.c_int
            return f

        self.launch = fn(("cuLaunchKernel",), vp, u, u, u, u, u, u, u, vp, pvp, pvp)
        self.memcpy_htod = fn(("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"), ctypes.c_uint64, vp, st, vp)
        self.event_create = fn(("cuEventCreate",), pvp, u)
        self.event_record = fn(("cuEventRecord",), vp, vp)
        self.event_query = fn(("cuEventQuery",), vp)
        self.event_sync = fn(("cuEventSynchronize",), vp)
        self.event_elapsed = fn(("cuEventElapsedTime_v2", "cuEventElapsedTime"), ctypes.POINTER(ctypes.c_float), vp, vp)
        self.ctx_get = fn(("cuCtxGetCurrent",), pvp)
        self.ctx_push = fn(("cuCtxPushCurrent_v2", "cuCtxPushCurrent"), vp)
        self.ctx_pop = fn(("cuCtxPopCurrent_v2", "cuCtxPopCurrent"), pvp)
        self.ctx_set = fn(("cuCtxSetCurrent",), vp)
        self.module_load = fn(("cuModuleLoadData",), pvp, vp)
        self.module_function = fn(("cuModuleGetFunction",), pvp, vp, ctypes.c_char_p)
        self.device_get = fn(("cuDeviceGet",), ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        self.primary_ctx = fn(("cuDevicePrimaryCtxRetain",), pvp, ctypes.c_int)


class DriverEvent:
    """A CUDA event of the kernel's context: recorded on a stream, waited on from any thread."""

    def __init__(self, kernel: GatherKernel, timing: bool = True) -> None:
        self._k = kernel
        handle = ctypes.c_void_p()
        with kernel.current():
            kernel.check(kernel.api.event_create(ctypes.byref(handle), 0 if timing else _EVENT_DISABLE_TIMING), "event")
        self.handle = handle.value

    def record(self, stream: int) -> None:
        self._k.check(self._k.api.event_record(self.handle, stream), "cuEventRecord")

    def query(self) -> bool:
        rc = self._k.api.event_query(self.handle)
        if rc == _NOT_READY:
            return False
        self._k.check(rc, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        """Block this thread until the event has passed (releases the GIL meanwhile)."""
        self._k.check(self._k.api.event_sync(self.handle), "cuEventSynchronize")

    def seconds_until(self, end: DriverEvent) -> float:
        ms = ctypes.c_float()
        self._k.check(self._k.api.event_elapsed(ctypes.byref(ms), self.handle, end.handle), "cuEventElapsedTime")
        return ms.value / 1e3


class GatherKernel:
    """The gather kernel loaded in one GPU's primary context (the one torch uses)."""

    _lock = threading.Lock()
    _loaded: dict[int, GatherKernel] = {}

    def __init__(self, device: int) -> None:
        import torch

        self.device = device
        self.driver = CudaDriver.get()
        self.api = _Api(self.driver.lib)
        self.check = self.driver.check
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.api.device_get(ctypes.byref(dev), device), "cuDeviceGet")
        self.check(self.api.primary_ctx(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
        self.ctx = ctx.value
        major, minor = torch.cuda.get_device_capability(device)
        cubin = _compile(f"sm_{major}{minor}")
        module = ctypes.c_void_p()
        with self.current():
            self.check(self.api.module_load(ctypes.byref(module), cubin), "cuModuleLoadData")
            self.functions: dict[int, int] = {}
            for word in WORDS:
                f = ctypes.c_void_p()
                self.check(self.api.module_function(ctypes.byref(f), module, f"gather_w{word}".encode()), "function")
                self.functions[word] = f.value  # type: ignore[assignment]
        self._module = module

    @classmethod
    def on(cls, device: int) -> GatherKernel:
        with cls._lock:
            if device not in cls._loaded:
                cls._loaded[device] = cls(device)
            return cls._loaded[device]

    @contextmanager
    def current(self) -> Iterator[None]:
        """This GPU's primary context current on the calling thread for the block."""
        pushed = self.enter()
        try:
            yield
        finally:
            if pushed:
                self.leave()

    def enter(self) -> bool:
        """Make this GPU's context current unless it is (the usual case on a thread that
        torch set up for this GPU); True if it was pushed, and `leave` must pop it."""
        current = ctypes.c_void_p()
        self.check(self.api.ctx_get(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value == self.ctx:
            return False
        self.check(self.api.ctx_push(self.ctx), "cuCtxPushCurrent")
        return True

    def leave(self) -> None:
        popped = ctypes.c_void_p()
        self.check(self.api.ctx_pop(ctypes.byref(popped)), "cuCtxPopCurrent")

    def make_current(self) -> None:
        """Make this GPU's primary context current on the calling thread for good (a
        thread of the lane's own, which waits on its events)."""
        self.check(self.api.ctx_set(self.ctx), "cuCtxSetCurrent")

    def upload(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of `nbytes` from pinned host memory to the GPU on `stream`."""
        self.check(self.api.memcpy_htod(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def launch(self, word: int, grid: tuple[int, int], threads: int, stream: int, args: LaunchArgs) -> None:
        """Queue the kernel for `word`-byte loads (call with the context current)."""
        rc = self.api.launch(self.functions[word], grid[0], grid[1], 1, threads, 1, 1, 0, stream, args.params, None)
        self.check(rc, "cuLaunchKernel")


class LaunchArgs:
    """The kernel's eight arguments, set in place: one block per caller thread, since the
    driver copies the values at the launch."""

    def __init__(self) -> None:
        self.values = (ctypes.c_int64 * 8)()
        base = ctypes.addressof(self.values)
        self.params = (ctypes.c_void_p * 8)(*range(base, base + 64, 8))
