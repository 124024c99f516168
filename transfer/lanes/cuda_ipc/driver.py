"""CUDA IPC through the driver API: export a slab's handle, map a peer's slab, close it.

The same-host GPU lane reads the owners' VRAM directly: each owner publishes a CUDA IPC
handle of its two owned slabs, and the decode maps them once, under its own GPU's
context, and gathers pages with one kernel (`transfer.lanes.cuda_ipc.gather`).

Why the driver API: it lets the decode open a handle under a context it chooses. torch
opens IPC handles under the exporting device's context; a kernel on the decode's GPU
reading such a mapping faulted and poisoned the whole context. The calls go through
NVIDIA's `cuda-bindings` (`cuda.bindings.driver`, the `gpu` extra), no dearer than
hand-written ctypes (docs/benchmarks.md), and none of these is on a per-fetch path.
Nothing here runs, or is imported by anything that runs, without CUDA; the bindings
are imported when the driver is first needed, never at module import.

An IPC mapping grants read and write to the whole slab, so the lane is only for
processes of one host and one trust boundary.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pdkv.errors import TransferError

logger = logging.getLogger(__name__)

T = TypeVar("T")

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_POINTER_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_MEMORY_DEVICE, _MEMORY_ARRAY, _MEMORY_UNIFIED = 2, 3, 4  # CUmemorytype (host is 1)
GPU_EXTRA = "pip install 'pdkv[cu12]' or 'pdkv[cu13]', for torch.version.cuda's major"


def driver_bindings() -> Any:
    """`cuda.bindings.driver`, or a TransferError naming the extra that installs it."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise TransferError(
            f"the GPU lane needs NVIDIA's cuda-bindings, not importable here ({exc}): {GPU_EXTRA}"
        ) from exc
    return driver


class CudaDriver:
    """The few driver calls the lane needs; each runs under a chosen device's primary context.
    `drv`: the bindings' driver module, for the kernel's calls."""

    _lock = threading.Lock()
    _instance: CudaDriver | None = None

    def __init__(self) -> None:
        self.drv = drv = driver_bindings()
        try:
            rc = drv.cuInit(0)[0]
        except Exception as exc:  # the bindings found no libcuda
            raise TransferError(f"CUDA driver not available: {exc}") from exc
        self.check(rc, "cuInit")

    @classmethod
    def get(cls) -> CudaDriver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def check(self, rc: Any, what: str) -> None:
        """Raise a TransferError for a failed call's `CUresult`."""
        if rc:
            try:
                err, name = self.drv.cuGetErrorName(self.drv.CUresult(rc))
                label = name.decode() if not err and name else "?"
            except ValueError:  # a code these bindings do not know
                label = "?"
            raise TransferError(f"{what} failed: {label} ({int(rc)})")

    def _call(self, device: int, what: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        """Driver call `fn(*args)` with `device`'s primary context current on this thread:
        its outputs after the checked result code."""

        def body() -> tuple[Any, ...]:
            out = fn(*args)
            self.check(out[0], what)
            return tuple(out[1:])

        return self.under(device, body)

    def under(self, device: int, body: Callable[[], T]) -> T:
        """Run `body` (driver calls) with `device`'s primary context current on this thread.

        torch's device guard makes the runtime set that context current, but not on a
        thread torch has not used for that device (it skips setting the device it already
        takes as current): pdkv's own loop thread, under an engine's synchronous face. There
        the primary context is made current by the driver; the check below makes sure.
        """
        import torch

        drv = self.drv
        with torch.cuda.device(device):
            torch.cuda.init()
            rc, ctx = drv.cuCtxGetCurrent()
            self.check(rc, "cuCtxGetCurrent")
            if not int(ctx):
                ctx = self._primary(device)
            current = -1
            if int(ctx):
                rc, dev = drv.cuCtxGetDevice()
                self.check(rc, "cuCtxGetDevice")
                current = int(dev)
            if current != device:
                raise TransferError(f"no CUDA context of device {device} current (got {current})")
            return body()

    def _primary(self, device: int) -> Any:
        """Make `device`'s primary context (the one torch uses) current on this thread."""
        drv = self.drv
        rc, dev = drv.cuDeviceGet(device)
        self.check(rc, "cuDeviceGet")
        rc, ctx = drv.cuDevicePrimaryCtxRetain(dev)
        self.check(rc, "cuDevicePrimaryCtxRetain")
        self.check(drv.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")
        return ctx

    def address_range(self, device: int, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding `ptr`."""
        base, size = self._call(device, "cuMemGetAddressRange", self.drv.cuMemGetAddressRange, ptr)
        return int(base), int(size)

    def export(self, device: int, ptr: int) -> tuple[bytes, int]:
        """An IPC handle of the allocation holding `ptr`, and `ptr`'s offset in it."""
        (handle,) = self._call(device, "cuIpcGetMemHandle", self.drv.cuIpcGetMemHandle, ptr)
        base, _ = self.address_range(device, ptr)
        # The struct's bytes through its address: the field's name and type differ between
        # versions of the bindings, and a field read as a C string would stop at a NUL.
        return ctypes.string_at(handle.getPtr(), HANDLE_BYTES), ptr - base

    def open(self, device: int, handle: bytes) -> tuple[int, int]:
        """Map a peer's allocation into `device`'s context: (address, size)."""
        if len(handle) != HANDLE_BYTES:
            raise TransferError(f"an IPC handle has {HANDLE_BYTES} bytes, not {len(handle)}")
        h = self.drv.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), handle, HANDLE_BYTES)
        (ptr,) = self._call(device, "cuIpcOpenMemHandle", self.drv.cuIpcOpenMemHandle, h, _LAZY_ENABLE_PEER_ACCESS)
        return int(ptr), self.address_range(device, int(ptr))[1]

    def close(self, device: int, ptr: int) -> None:
        self._call(device, "cuIpcCloseMemHandle", self.drv.cuIpcCloseMemHandle, ptr)

    def is_device_memory(self, ptr: int) -> bool:
        """Whether `ptr` is GPU memory (device or managed); plain or pinned host memory is not."""
        drv = self.drv
        rc, kind = drv.cuPointerGetAttribute(drv.CUpointer_attribute(_POINTER_MEMORY_TYPE), ptr)
        return not rc and int(kind) in (_MEMORY_DEVICE, _MEMORY_ARRAY, _MEMORY_UNIFIED)  # unknown to CUDA: host


@dataclass
class IpcMapping:
    """One peer slab mapped on `device`: owner addresses inside it translate to local ones."""

    device: int
    owner_addr: int  # the slab's address in the owner's process
    length: int
    mapped: int  # the allocation's address here
    alloc_offset: int  # the slab's offset inside that allocation
    closed: bool = False

    def holds(self, owner_addr: int, nbytes: int) -> bool:
        return self.owner_addr <= owner_addr and owner_addr + nbytes <= self.owner_addr + self.length

    def translate(self, owner_addr: int, nbytes: int) -> int:
        """The local address of owner bytes [owner_addr, owner_addr + nbytes), checked."""
        if not self.holds(owner_addr, nbytes):
            raise TransferError(f"[{owner_addr:#x}, +{nbytes}) lies outside the mapped slab")
        return self.mapped + self.alloc_offset + (owner_addr - self.owner_addr)

    def close(self, driver: CudaDriver) -> None:
        if not self.closed:
            self.closed = True
            try:
                driver.close(self.device, self.mapped)
            except TransferError as exc:
                logger.warning("closing an IPC mapping: %s", exc)
