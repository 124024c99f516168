"""Export and map VMM allocations (cuMemCreate/cuMemMap) across processes of one host.

CUDA IPC handles (`transfer.lanes.cuda_ipc.driver`) cannot export memory made with the virtual memory
management API: PyTorch's expandable segments (`PYTORCH_CUDA_ALLOC_CONF=
expandable_segments:True`), torch_memory_saver and custom pools. Such memory is shared
the VMM way: each physical allocation behind the range is exported as a POSIX file
descriptor (`cuMemExportToShareableHandle`), the descriptors travel over a Unix socket
(`transfer.lanes.cuda_ipc.fd_pass`), and the reader imports them (`cuMemImportFromShareableHandle`)
and maps them itself (`cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`).

An expandable segment is one reserved VA range backed by many physical chunks (20 MiB
each for PyTorch's large pool), each its own allocation handle; a buffer may straddle
chunks, and a range may have unmapped holes where the allocator gave chunks back. So a
span is exported as its chunks: (offset from the span's base, size) and one descriptor
each, the base being the first chunk's start. The reader reserves one VA range of the
span's size and maps each chunk at its offset, which rebuilds the owner's layout: owner
address A is local address `local_base + (A - owner_base)`.

A chunk's extent is what `cuMemGetAddressRange` says for an address in it: for VMM
memory that is the mapping of the one handle holding the address, not the reservation
(NVIDIA's UCX and libfabric rely on this, openucx/ucx#11461, ofiwg/libfabric#12473).
Should a driver answer otherwise, the reader's `cuMemMap` of a size the handle does not
have fails, and the lane falls back to UCX: never a wrong mapping.

Every driver call runs under the device's primary context (torch's), made current by
`CudaDriver.under` (the IPC calls' way); the VMM calls go through a library handle of this
module's own, so the argument types set here change nothing for other callers. Nothing
here runs without CUDA.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from pdkv.errors import TransferError
from transfer.lanes.cuda_ipc.driver import CudaDriver

logger = logging.getLogger(__name__)

T = TypeVar("T")

_HANDLE_POSIX_FD = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_LOCATION_DEVICE = 0x1  # CU_MEM_LOCATION_TYPE_DEVICE
_ALLOCATION_PINNED = 0x1  # CU_MEM_ALLOCATION_TYPE_PINNED
_ACCESS_READ = 0x1  # CU_MEM_ACCESS_FLAGS_PROT_READ
_ACCESS_READWRITE = 0x3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0x0  # CU_MEM_ALLOC_GRANULARITY_MINIMUM
_MAX_HOLE_STEPS = 1 << 16  # granules walked through unmapped holes before giving up


class VmmError(TransferError):
    """A span that cannot be shared the VMM way, with the reason (the caller falls back
    to UCX and says why)."""


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):  # CUmemAllocationProp.allocFlags
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocProp(ctypes.Structure):  # CUmemAllocationProp (32 bytes on 64-bit Linux)
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Vmm:
    """The VMM driver calls, on a library handle of our own: the argument types set here
    must not change how other modules call the same library."""

    _lock = threading.Lock()
    _instance: _Vmm | None = None

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise VmmError(f"CUDA driver not available: {exc}") from exc
        u64, size, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
        sig: dict[str, list[type]] = {
            "cuMemRetainAllocationHandle": [p(u64), ctypes.c_void_p],
            "cuMemRelease": [u64],
            "cuMemGetAllocationPropertiesFromHandle": [p(_AllocProp), u64],
            "cuMemGetAllocationGranularity": [p(size), p(_AllocProp), ctypes.c_int],
            "cuMemExportToShareableHandle": [ctypes.c_void_p, u64, ctypes.c_int, ctypes.c_ulonglong],
            "cuMemImportFromShareableHandle": [p(u64), ctypes.c_void_p, ctypes.c_int],
            "cuMemAddressReserve": [p(u64), size, size, u64, ctypes.c_ulonglong],
            "cuMemAddressFree": [u64, size],
            "cuMemMap": [u64, size, size, u64, ctypes.c_ulonglong],
            "cuMemUnmap": [u64, size],
            "cuMemSetAccess": [u64, size, p(_AccessDesc), size],
            "cuMemCreate": [p(u64), size, p(_AllocProp), ctypes.c_ulonglong],
        }
        for name, argtypes in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        rng = getattr(lib, "cuMemGetAddressRange_v2", None) or lib.cuMemGetAddressRange
        rng.argtypes, rng.restype = [p(u64), p(size), u64], ctypes.c_int
        self.lib, self._range = lib, rng
        self.check(lib.cuInit(0), "cuInit")

    @classmethod
    def get(cls) -> _Vmm:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def under(self, device: int, body: Callable[[], T]) -> T:
        """Run `body` (many driver calls) with `device`'s primary context current (as the
        IPC calls do: the context is the thread's, whichever library handle set it)."""
        try:
            return CudaDriver.get().under(device, body)
        except VmmError:
            raise
        except TransferError as exc:
            raise VmmError(str(exc)) from exc

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise VmmError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def retain(self, addr: int) -> int | None:
        """The allocation handle mapped at `addr` (a reference the caller releases), or
        None where no VMM allocation is mapped there."""
        h = ctypes.c_uint64()
        rc = self.lib.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(addr))
        return h.value if rc == 0 else None

    def release(self, handle: int) -> None:
        rc = self.lib.cuMemRelease(handle)
        if rc != 0:
            logger.warning("cuMemRelease(%#x) returned %d", handle, rc)

    def props(self, handle: int) -> _AllocProp:
        prop = _AllocProp()
        self.check(
            self.lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(prop), handle),
            "cuMemGetAllocationPropertiesFromHandle",
        )
        return prop

    def granularity(self, prop: _AllocProp) -> int:
        g = ctypes.c_size_t()
        self.check(
            self.lib.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), _GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity",
        )
        return g.value

    def address_range(self, addr: int) -> tuple[int, int]:
        base, n = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self._range(ctypes.byref(base), ctypes.byref(n), addr), "cuMemGetAddressRange")
        return base.value, n.value

    def export_fd(self, handle: int) -> int:
        fd = ctypes.c_int(-1)
        self.check(
            self.lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, _HANDLE_POSIX_FD, 0),
            "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
        )
        return fd.value


def is_vmm(device: int, ptr: int) -> bool:
    """Whether `ptr` lies in VMM memory (cuMemCreate/cuMemMap): the only kind
    `cuMemRetainAllocationHandle` answers for. The reference it takes is released."""
    vmm = _Vmm.get()

    def body() -> bool:
        h = vmm.retain(ptr)
        if h is None:
            return False
        vmm.release(h)
        return True

    return vmm.under(device, body)


@dataclass(frozen=True)
class VmmChunk:
    """One physical allocation of a span: where it starts from the span's base, its size."""

    offset: int
    size: int


@dataclass
class VmmExport:
    """The chunks behind owner addresses [lo, hi), exported as descriptors this object
    owns (open while exported; `close()` closes them). Publish `base`, `chunks` (as
    `wire_chunks()`), and serve `fds` (in chunk order) with `transfer.lanes.cuda_ipc.fd_pass.FdServer`."""

    device: int
    lo: int
    hi: int
    base: int  # the first chunk's start (<= lo)
    chunks: list[VmmChunk]
    fds: list[int]
    closed: bool = False

    @property
    def size(self) -> int:
        last = self.chunks[-1]
        return last.offset + last.size

    def wire_chunks(self) -> list[tuple[int, int]]:
        return [(c.offset, c.size) for c in self.chunks]

    def covers(self, addr: int, nbytes: int) -> bool:
        """Whether owner bytes [addr, addr + nbytes) all lie in exported chunks (not in a hole)."""
        return _covered(self.chunks, addr - self.base, nbytes)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for fd in self.fds:
                try:
                    os.close(fd)
                except OSError as exc:
                    logger.warning("closing a VMM export descriptor: %s", exc)
            self.fds = []


def _covered(chunks: Sequence[VmmChunk], start: int, nbytes: int) -> bool:
    """Whether [start, start + nbytes) (offsets from the span's base) lies in `chunks`,
    which are sorted and disjoint; adjacent chunks join."""
    end = start + nbytes
    if nbytes <= 0 or start < 0:
        return False
    for c in chunks:
        if c.offset + c.size <= start:
            continue
        if c.offset > start:
            return False  # a hole before the rest
        start = c.offset + c.size
        if start >= end:
            return True
    return False


def export_span(device: int, lo: int, hi: int) -> VmmExport:
    """Export the VMM chunks covering owner addresses [lo, hi) on `device`.

    Raises `VmmError` with the reason when the span cannot be shared this way: `lo` is not
    VMM memory (use CUDA IPC), a chunk was created without the POSIX descriptor handle
    type, lives on another device, or the driver refuses the export."""
    if hi <= lo:
        raise VmmError(f"empty span [{lo:#x}, {hi:#x})")
    vmm = _Vmm.get()
    return vmm.under(device, lambda: _export(vmm, device, lo, hi))


def _export(vmm: _Vmm, device: int, lo: int, hi: int) -> VmmExport:
    found: list[tuple[int, int]] = []  # (chunk start, size)
    fds: list[int] = []
    gran = 0
    holes = 0
    addr = lo
    try:
        while addr < hi:
            h = vmm.retain(addr)
            if h is None:
                if not found:
                    raise VmmError(f"{addr:#x} is not VMM memory (cuMemRetainAllocationHandle refused)")
                # A hole (chunks the allocator gave back): walk it granule by granule, bounded.
                holes += 1
                if holes > _MAX_HOLE_STEPS:
                    raise VmmError(f"more than {_MAX_HOLE_STEPS} unmapped granules in [{lo:#x}, {hi:#x})")
                addr = (addr // gran + 1) * gran
                continue
            try:
                prop = vmm.props(h)
                if not prop.requestedHandleTypes & _HANDLE_POSIX_FD:
                    raise VmmError(
                        f"the allocation at {addr:#x} was created without the POSIX descriptor handle "
                        f"type (requestedHandleTypes={prop.requestedHandleTypes:#x}): it cannot be exported"
                    )
                if prop.location.type != _LOCATION_DEVICE or prop.location.id != device:
                    raise VmmError(
                        f"the allocation at {addr:#x} lives at location type {prop.location.type} "
                        f"id {prop.location.id}, not on device {device}"
                    )
                gran = gran or vmm.granularity(prop)
                start, size = vmm.address_range(addr)
                if not (start <= addr < start + size) or start % gran or size % gran:
                    raise VmmError(
                        f"cuMemGetAddressRange({addr:#x}) gave [{start:#x}, +{size:#x}), not a chunk "
                        f"holding it on {gran:#x}-byte granules"
                    )
                if found and start < found[-1][0] + found[-1][1]:
                    raise VmmError(f"chunk at {start:#x} overlaps the one before it")
                fds.append(vmm.export_fd(h))
                found.append((start, size))
            finally:
                vmm.release(h)
            addr = start + size
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    base = found[0][0]
    chunks = [VmmChunk(start - base, size) for start, size in found]
    logger.info(
        "exported VMM span [%#x, %#x) on device %d: %d chunks from %#x, %d unmapped granules",
        lo,
        hi,
        device,
        len(chunks),
        base,
        holes,
    )
    return VmmExport(device=device, lo=lo, hi=hi, base=base, chunks=chunks, fds=fds)


@dataclass
class VmmMapping:
    """A peer's span mapped on `device`: owner address A reads at `local(A)`."""

    device: int
    owner_base: int
    base: int  # the local VA range's start
    size: int
    chunks: list[VmmChunk]
    handles: list[int] = field(default_factory=list)
    mapped: list[VmmChunk] = field(default_factory=list)
    closed: bool = False

    def holds(self, owner_addr: int, nbytes: int) -> bool:
        return _covered(self.mapped, owner_addr - self.owner_base, nbytes)

    def translate(self, owner_addr: int, nbytes: int) -> int:
        """The local address of owner bytes [owner_addr, owner_addr + nbytes), checked."""
        if not self.holds(owner_addr, nbytes):
            raise VmmError(f"[{owner_addr:#x}, +{nbytes}) lies outside the mapped chunks")
        return self.base + (owner_addr - self.owner_base)

    def close(self) -> None:
        """Unmap, free the VA range, release the imported handles; idempotent. No kernel
        may be reading the range (the device is synchronized first)."""
        if self.closed:
            return
        self.closed = True
        vmm = _Vmm.get()
        try:
            vmm.under(self.device, self._teardown)
        except TransferError as exc:
            logger.warning("closing a VMM mapping: %s", exc)

    def _teardown(self) -> None:
        vmm = _Vmm.get()
        vmm.lib.cuCtxSynchronize()  # an unmap under a running reader faults it
        for c in self.mapped:
            rc = vmm.lib.cuMemUnmap(self.base + c.offset, c.size)
            if rc != 0:
                logger.warning("cuMemUnmap(%#x, %#x) returned %d", self.base + c.offset, c.size, rc)
        self.mapped = []
        if self.base:
            rc = vmm.lib.cuMemAddressFree(self.base, self.size)
            if rc != 0:
                logger.warning("cuMemAddressFree(%#x, %#x) returned %d", self.base, self.size, rc)
        for h in self.handles:
            vmm.release(h)
        self.handles = []


def import_span(
    device: int,
    chunks: Sequence[tuple[int, int]] | Sequence[VmmChunk],
    fds: Sequence[int],
    *,
    owner_base: int = 0,
    writable: bool = False,
) -> VmmMapping:
    """Map a peer's exported span on `device`: one VA range of the span's size, each chunk
    at its offset, readable (and writable if asked) by `device`.

    `chunks`: (offset, size) per chunk, in order, as the owner published them; `fds`: the
    descriptors fetched for them, in the same order. The descriptors stay the caller's:
    once this returns they are no longer needed and may be closed. `owner_base`: the
    owner's address of offset 0, for `translate`. Raises `VmmError` and undoes what it did
    when any step fails."""
    parsed = [c if isinstance(c, VmmChunk) else VmmChunk(int(c[0]), int(c[1])) for c in chunks]
    if not parsed:
        raise VmmError("no chunks to import")
    if len(parsed) != len(fds):
        raise VmmError(f"{len(parsed)} chunks but {len(fds)} descriptors")
    end = 0
    for c in parsed:
        if c.size <= 0 or c.offset < end:
            raise VmmError(f"chunks out of order or empty at offset {c.offset:#x}")
        end = c.offset + c.size
    if parsed[0].offset != 0:
        raise VmmError("the first chunk must start at offset 0 (the span's base)")
    m = VmmMapping(device=device, owner_base=owner_base, base=0, size=end, chunks=parsed)
    vmm = _Vmm.get()
    try:
        vmm.under(device, lambda: _map(vmm, m, fds, _ACCESS_READWRITE if writable else _ACCESS_READ))
    except BaseException:
        m.close()
        raise
    logger.info("mapped a VMM span of %d chunks (%#x bytes) on device %d at %#x", len(parsed), end, device, m.base)
    return m


def _map(vmm: _Vmm, m: VmmMapping, fds: Sequence[int], access: int) -> None:
    for fd in fds:
        imported = ctypes.c_uint64()
        vmm.check(
            vmm.lib.cuMemImportFromShareableHandle(ctypes.byref(imported), ctypes.c_void_p(fd), _HANDLE_POSIX_FD),
            "cuMemImportFromShareableHandle",
        )
        m.handles.append(imported.value)
    gran = vmm.granularity(vmm.props(m.handles[0]))
    for c in m.chunks:
        if c.offset % gran or c.size % gran:
            raise VmmError(f"chunk [{c.offset:#x}, +{c.size:#x}) is not on {gran:#x}-byte granules")
    va = ctypes.c_uint64()
    vmm.check(vmm.lib.cuMemAddressReserve(ctypes.byref(va), m.size, gran, 0, 0), "cuMemAddressReserve")
    m.base = int(va.value)
    for c, h in zip(m.chunks, m.handles):
        vmm.check(vmm.lib.cuMemMap(m.base + c.offset, c.size, 0, h, 0), f"cuMemMap(chunk at +{c.offset:#x})")
        m.mapped.append(c)
    desc = _AccessDesc(_Location(_LOCATION_DEVICE, m.device), access)
    for start, length in _runs(m.chunks):  # one call per run of adjacent chunks
        vmm.check(vmm.lib.cuMemSetAccess(m.base + start, length, ctypes.byref(desc), 1), f"cuMemSetAccess(+{start:#x})")


def _runs(chunks: Sequence[VmmChunk]) -> list[tuple[int, int]]:
    """Maximal runs of adjacent chunks, as (offset, length)."""
    runs: list[tuple[int, int]] = []
    for c in chunks:
        if runs and runs[-1][0] + runs[-1][1] == c.offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + c.size)
        else:
            runs.append((c.offset, c.size))
    return runs


def create_unshareable(device: int, size: int) -> tuple[int, Callable[[], None]]:
    """Test aid: `size` bytes (rounded up to the granule) of VMM memory on `device` made
    with no shareable handle type, mapped read-write; returns (address, free)."""
    vmm = _Vmm.get()

    def body() -> tuple[int, Callable[[], None]]:
        prop = _AllocProp()
        prop.type = _ALLOCATION_PINNED
        prop.requestedHandleTypes = 0  # CU_MEM_HANDLE_TYPE_NONE
        prop.location = _Location(_LOCATION_DEVICE, device)
        gran = vmm.granularity(prop)
        n = -(-size // gran) * gran
        h, va = ctypes.c_uint64(), ctypes.c_uint64()
        vmm.check(vmm.lib.cuMemCreate(ctypes.byref(h), n, ctypes.byref(prop), 0), "cuMemCreate")
        vmm.check(vmm.lib.cuMemAddressReserve(ctypes.byref(va), n, gran, 0, 0), "cuMemAddressReserve")
        vmm.check(vmm.lib.cuMemMap(va.value, n, 0, h.value, 0), "cuMemMap")
        desc = _AccessDesc(_Location(_LOCATION_DEVICE, device), _ACCESS_READWRITE)
        vmm.check(vmm.lib.cuMemSetAccess(va.value, n, ctypes.byref(desc), 1), "cuMemSetAccess")

        def free() -> None:
            def undo() -> None:
                vmm.check(vmm.lib.cuMemUnmap(va.value, n), "cuMemUnmap")
                vmm.check(vmm.lib.cuMemAddressFree(va.value, n), "cuMemAddressFree")
                vmm.check(vmm.lib.cuMemRelease(h.value), "cuMemRelease")

            vmm.under(device, undo)

        return va.value, free

    return vmm.under(device, body)
