"""CUDA IPC through the driver API: export a slab's handle, map a peer's slab, close it.

The same-host GPU lane reads the owners' VRAM directly: each owner publishes a CUDA IPC
handle of its two owned slabs, and the decode maps them once, under its own GPU's
context, and gathers pages with one kernel (`transfer.lanes.cuda_ipc.gather`).

Why the driver API through ctypes: `libcuda.so.1` is present wherever a GPU is, it needs
no package beyond the driver, and it lets the decode open a handle under a context it
chooses. torch opens IPC handles under the exporting device's context; a kernel on the
decode's GPU reading such a mapping faulted and poisoned the whole context (seen on
H200s). Nothing here runs, or is imported by anything that runs, without CUDA.

An IPC mapping grants read and write to the whole slab, so the lane is only for
processes of one host and one trust boundary.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pdkv.errors import TransferError

__all__ = ["CudaDriver", "IpcMapping", "HANDLE_BYTES"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

HANDLE_BYTES = 64
_LAZY_ENABLE_PEER_ACCESS = 0x1
_POINTER_MEMORY_TYPE = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_MEMORY_DEVICE, _MEMORY_ARRAY, _MEMORY_UNIFIED = 2, 3, 4  # CUmemorytype (host is 1)


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class CudaDriver:
    """The few driver calls the lane needs; each runs under a chosen device's primary context."""

    _lock = threading.Lock()
    _instance: CudaDriver | None = None

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise TransferError(f"CUDA driver not available: {exc}") from exc
        self.check(self.lib.cuInit(0), "cuInit")
        self._open = getattr(self.lib, "cuIpcOpenMemHandle_v2", None) or self.lib.cuIpcOpenMemHandle
        self._open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        self._range = getattr(self.lib, "cuMemGetAddressRange_v2", None) or self.lib.cuMemGetAddressRange

    @classmethod
    def get(cls) -> CudaDriver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise TransferError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def _on(self, device: int, fn: Callable[[], int], what: str) -> None:
        """Run driver call `fn` with `device`'s primary context current on this thread."""
        self.under(device, lambda: self.check(fn(), what))

    def under(self, device: int, body: Callable[[], T]) -> T:
        """Run `body` (driver calls) with `device`'s primary context current on this thread.

        torch's device guard makes the runtime set that context current, but not on a
        thread torch has not used for that device (it skips setting the device it already
        takes as current): pdkv's own loop thread, under an engine's synchronous face. There
        the primary context is made current by the driver; the check below makes sure.
        """
        import torch

        with torch.cuda.device(device):
            torch.cuda.init()
            ctx = ctypes.c_void_p()
            self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            if not ctx.value:
                ctx = self._primary(device)
            current = ctypes.c_int(-1)
            if ctx.value:
                self.check(self.lib.cuCtxGetDevice(ctypes.byref(current)), "cuCtxGetDevice")
            if current.value != device:
                raise TransferError(f"no CUDA context of device {device} current (got {current.value})")
            return body()

    def _primary(self, device: int) -> ctypes.c_void_p:
        """Make `device`'s primary context (the one torch uses) current on this thread."""
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        return ctx

    def address_range(self, device: int, ptr: int) -> tuple[int, int]:
        """(base, size) of the allocation holding `ptr`."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._on(
            device,
            lambda: self._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
            "cuMemGetAddressRange",
        )
        return base.value, size.value

    def export(self, device: int, ptr: int) -> tuple[bytes, int]:
        """An IPC handle of the allocation holding `ptr`, and `ptr`'s offset in it."""
        handle = _Handle()
        self._on(
            device, lambda: self.lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(ptr)), "cuIpcGetMemHandle"
        )
        base, _ = self.address_range(device, ptr)
        return ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES), ptr - base  # .reserved stops at a NUL

    def open(self, device: int, handle: bytes) -> tuple[int, int]:
        """Map a peer's allocation into `device`'s context: (address, size)."""
        if len(handle) != HANDLE_BYTES:
            raise TransferError(f"an IPC handle has {HANDLE_BYTES} bytes, not {len(handle)}")
        h = _Handle.from_buffer_copy(handle)
        ptr = ctypes.c_uint64()
        self._on(device, lambda: self._open(ctypes.byref(ptr), h, _LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return ptr.value, self.address_range(device, ptr.value)[1]

    def close(self, device: int, ptr: int) -> None:
        self._on(device, lambda: self.lib.cuIpcCloseMemHandle(ctypes.c_uint64(ptr)), "cuIpcCloseMemHandle")

    def is_device_memory(self, ptr: int) -> bool:
        """Whether `ptr` is GPU memory (device or managed); plain or pinned host memory is not."""
        kind = ctypes.c_uint(0)
        rc = self.lib.cuPointerGetAttribute(ctypes.byref(kind), _POINTER_MEMORY_TYPE, ctypes.c_uint64(ptr))
        return rc == 0 and kind.value in (_MEMORY_DEVICE, _MEMORY_ARRAY, _MEMORY_UNIFIED)  # unknown to CUDA: host


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
