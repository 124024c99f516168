"""The prefill side of the same-host GPU lane: an owner's memory exported to this host.

A pool exports its two slabs; an engine that keeps a tensor per layer and kind exports a
slab per allocation behind them (its allocator may put several in one), spanning just them.
Buffers in VMM memory (expandable segments, memory savers), which IPC handles cannot
export, go as spans of chunks whose file descriptors a Unix socket hands to decodes of
the same user that name a span's key (published in the registry) and the secret.
"""

from __future__ import annotations

import logging
import secrets

import torch

from pdkv.errors import PdkvError
from pdkv.layout import BufferKind
from transfer.engine_kv import KVBuffers
from transfer.lanes.base import host_id
from transfer.lanes.cuda_ipc.driver import CudaDriver
from transfer.lanes.cuda_ipc.fd_pass import FdServer
from transfer.lanes.cuda_ipc.vmm import VmmExport, export_span, is_vmm
from transfer.lanes.runs import device_id
from transfer.metadata import IpcExport, IpcSlab, VmmSpan
from transfer.timeouts import Timeouts

NO_SECRET = "pdkv-no-secret"  # without one, a span's key (from the registry) and the uid guard it
_SPAN_GAP = 1 << 30  # VMM buffers further apart than this go in separate spans

logger = logging.getLogger(__name__)


class IpcExporter:
    """Exports a GPU pool's owned memory for decodes on this host, for as long as it runs."""

    def __init__(self, secret: str | None, timeouts: Timeouts) -> None:
        self._secret, self._timeouts = secret or NO_SECRET, timeouts
        self._spans: list[VmmExport] = []
        self._server: FdServer | None = None

    async def start(self, pool: KVBuffers) -> IpcExport | None:
        """The export (None: not a GPU pool, or nothing exportable: decodes read over UCX)."""
        if pool.device.type != "cuda":
            return None
        dev = device_id(pool.device)
        try:
            driver = CudaDriver.get()
            owned = pool.ipc_slabs()
            if owned is not None:
                slabs, vmm = _pool_slabs(driver, dev, owned), list[VmmSpan]()
            else:
                slabs, vmm = await self._engine_memory(driver, dev, pool)
        except PdkvError as exc:
            logger.warning("no CUDA IPC export (decodes will read over UCX): %s", exc)
            await self.aclose()
            return None
        uuid = str(torch.cuda.get_device_properties(dev).uuid)
        address = self._server.address if self._server is not None else None
        return IpcExport(host_id=host_id(), gpu_uuid=uuid, slabs=slabs, vmm=vmm, fd_socket=address)

    async def _engine_memory(
        self, driver: CudaDriver, dev: int, pool: KVBuffers
    ) -> tuple[list[IpcSlab], list[VmmSpan]]:
        """An engine's buffers: IPC slabs for those in ordinary allocations, VMM spans for the rest."""
        buffers = [t for t in pool.registered_buffers() if t.numel() > 0]
        in_vmm = [is_vmm(dev, t.data_ptr()) for t in buffers]
        slabs = _allocation_slabs(driver, dev, [t for t, v in zip(buffers, in_vmm) if not v])
        ranges = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t, v in zip(buffers, in_vmm) if v)
        if not ranges:
            return slabs, []
        self._server = FdServer(self._secret, timeout=self._timeouts.connect)
        await self._server.start()
        spans = []
        for lo, hi in _spans(ranges):
            exported = export_span(dev, lo, hi)
            self._spans.append(exported)
            key = secrets.token_hex(16)
            self._server.serve(key, exported.fds)
            spans.append(VmmSpan(addr=exported.base, chunks=exported.wire_chunks(), key=key))
        logger.info("exported %d VMM spans (%d chunks) for decodes on this host", len(spans), len(self._chunks()))
        return slabs, spans

    def _chunks(self) -> list[object]:
        return [c for s in self._spans for c in s.chunks]

    async def aclose(self) -> None:
        if self._server is not None:
            await self._server.aclose()
            self._server = None
        for span in self._spans:
            span.close()
        self._spans = []


def _spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted address ranges grouped into spans (an expandable segment keeps them close)."""
    out = [list(ranges[0])]
    for lo, hi in ranges[1:]:
        if lo - out[-1][1] > _SPAN_GAP:
            out.append([lo, hi])
        else:
            out[-1][1] = max(out[-1][1], hi)
    return [(lo, hi) for lo, hi in out]


def _pool_slabs(driver: CudaDriver, dev: int, owned: dict[BufferKind, torch.Tensor]) -> list[IpcSlab]:
    slabs, exported = [], {}
    for kind, slab in owned.items():
        if slab.data_ptr() not in exported:  # both kinds lie in one slab: export it once
            exported[slab.data_ptr()] = driver.export(dev, slab.data_ptr())
        handle, offset = exported[slab.data_ptr()]
        slabs.append(IpcSlab(kind=kind, addr=slab.data_ptr(), length=slab.nbytes, alloc_offset=offset, handle=handle))
    return slabs


def _allocation_slabs(driver: CudaDriver, dev: int, buffers: list[torch.Tensor]) -> list[IpcSlab]:
    """A slab per allocation behind the owned buffers (an engine keeps a tensor per layer
    and kind; its allocator may put several in one allocation), spanning just them."""
    spans: dict[int, list[int]] = {}  # allocation base -> [lowest buffer address, highest end]
    for t in buffers:
        base, _ = driver.address_range(dev, t.data_ptr())
        span = spans.setdefault(base, [t.data_ptr(), t.data_ptr() + t.nbytes])
        span[0], span[1] = min(span[0], t.data_ptr()), max(span[1], t.data_ptr() + t.nbytes)
    slabs = []
    for base, (lo, hi) in sorted(spans.items()):
        handle, _ = driver.export(dev, base)
        slabs.append(IpcSlab(addr=lo, length=hi - lo, alloc_offset=lo - base, handle=handle))
    return slabs
