"""KV buffers a serving engine owns, handed to pdkv by address (SGLang's `KVArgs` form).

An engine keeps its KV cache in tensors of its own, one per layer and kind; pdkv exports
them, or reads into them, in place. `EngineKV` views those buffers (no copy, no
ownership) with the face of a `DSAKVPool` that `PrefillExporter` and `DecodeFetcher`
use: a layout, the owned layers, a buffer per layer and kind, and what to register.

The layout is derived from the buffers' item lengths and the page size, so a prefill's
and a decode's fingerprints agree exactly when the bytes of their pages do. The memory
must outlive every exporter or fetcher that registered it. Buffers may lie anywhere (no
slab): an exporter publishes a CUDA IPC slab per allocation behind them for the
same-host GPU lane, and VMM memory as spans of chunks (`transfer.lanes.cuda_ipc.export`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Protocol

import torch

from pdkv.errors import LayoutError
from pdkv.layout import INDEX_SCALE_BYTES, BufferKind, KVLayout
from pdkv.pool import BufferInfos


class KVBuffers(Protocol):
    """What the transfer layer needs of a pool: a `DSAKVPool`, or an engine's `EngineKV`."""

    layout: KVLayout
    owned: range
    device: torch.device
    kv_buffer: list[torch.Tensor]  # per layer of the layout; empty for a layer not owned
    index_buffer: list[torch.Tensor]

    def infos(self, kind: BufferKind) -> BufferInfos:
        """The owned layers' buffers of `kind`: per layer its id, address, bytes, page bytes."""
        ...

    def registered_buffers(self) -> list[torch.Tensor]: ...

    def ipc_slabs(self) -> dict[BufferKind, torch.Tensor] | None: ...


def buffer_infos(
    layer_ids: Sequence[int], ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int]
) -> BufferInfos:
    """One kind of buffer as an engine lists it: per layer its id, address, bytes and the
    bytes of one page (`KVArgs.kv_layer_ids`, `kv_data_ptrs`, `kv_data_lens`, `kv_item_lens`)."""
    if not len(layer_ids) == len(ptrs) == len(lens) == len(items):
        raise LayoutError(f"{len(layer_ids)} layer ids, {len(ptrs)} addresses, {len(lens)} lengths, {len(items)} items")
    return BufferInfos(tuple(map(int, layer_ids)), tuple(map(int, ptrs)), tuple(map(int, lens)), tuple(map(int, items)))


class _CudaMemory:
    """Raw device memory as `torch.as_tensor` takes it (the CUDA array interface)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def view_memory(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor over `nbytes` at `ptr` on `device`, sharing the memory."""
    if nbytes <= 0 or ptr <= 0:
        raise LayoutError(f"no memory at {ptr:#x} (+{nbytes})")
    if device.type == "cuda":
        return torch.as_tensor(_CudaMemory(ptr, nbytes), device=device)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def _index_head_dim(token_bytes: int) -> int:
    """The indexer key width whose keys and scales take `token_bytes` a token."""
    for dim in range(1, token_bytes + 1):
        if dim + INDEX_SCALE_BYTES * (dim // 128) == token_bytes:
            return dim
    raise LayoutError(f"no indexer key width takes {token_bytes} bytes a token")


def _one(values: tuple[int, ...], what: str) -> int:
    if len(set(values)) != 1:
        raise LayoutError(f"{what} differ between layers: {sorted(set(values))}")
    return values[0]


class EngineKV:
    """An engine's latent and indexer buffers for layers `owned`, seen as a pdkv pool.

    `latent`, `index`: per owned layer, the buffer's address, bytes and page bytes (one
    item is one page of one layer). `layer_num`, `start_layer`: the model's layers (the
    owned ones are a contiguous run of them). `dtype`, `kv_lora_rank`, `qk_rope_head_dim`:
    what the bytes mean, covered by the fingerprint as for a `DSAKVPool`.
    """

    def __init__(
        self,
        latent: BufferInfos,
        index: BufferInfos,
        *,
        page_size: int,
        layer_num: int,
        start_layer: int = 0,
        device: str | torch.device = "cpu",
        dtype: str = "float8_e4m3fn",
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
    ) -> None:
        if latent.layer_ids != index.layer_ids:
            raise LayoutError(f"latent layers {latent.layer_ids} != indexer layers {index.layer_ids}")
        layers = latent.layer_ids
        if not layers or list(layers) != list(range(layers[0], layers[0] + len(layers))):
            raise LayoutError(f"owned layers must be a contiguous run, got {layers}")
        self.owned = range(layers[0], layers[-1] + 1)
        self.device = torch.device(device)
        kv_item, index_item = (
            _one(latent.item_lens, "latent item lengths"),
            _one(index.item_lens, "indexer item lengths"),
        )
        if page_size <= 0 or kv_item % page_size or index_item % page_size:
            raise LayoutError(f"items of {kv_item} and {index_item} bytes are not pages of {page_size} tokens")
        pages = min(n // kv_item for n in latent.data_lens)
        if pages < 2 or any(n % kv_item for n in latent.data_lens) or any(n % index_item for n in index.data_lens):
            raise LayoutError("every buffer must hold whole pages, two at least")
        self.layout = KVLayout(
            layer_num=layer_num,
            page_size=page_size,
            size=(pages - 1) * page_size,  # SGLang's pools keep one padding page more
            kv_cache_dim=kv_item // page_size,
            dtype=dtype,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            index_head_dim=_index_head_dim(index_item // page_size),
            start_layer=start_layer,
            device=str(self.device),
        )
        if self.owned.start < self.layout.start_layer or self.owned.stop > self.layout.end_layer:
            raise LayoutError(f"owned layers {self.owned} outside the model's [{start_layer}, {self.layout.end_layer})")
        self._latent, self._index = latent, index
        self.kv_buffer = self._views(latent, kv_item)
        self.index_buffer = self._views(index, index_item)

    def _views(self, infos: BufferInfos, item: int) -> list[torch.Tensor]:
        """A (pages, item) view per layer of the model; empty for a layer not owned."""
        empty = torch.empty((0, item), dtype=torch.uint8, device=self.device)
        views = [empty] * self.layout.layer_num
        for layer, ptr, n in zip(infos.layer_ids, infos.data_ptrs, infos.data_lens):
            views[layer - self.layout.start_layer] = view_memory(ptr, n, self.device).view(-1, item)
        return views

    def infos(self, kind: BufferKind) -> BufferInfos:
        return self._latent if kind is BufferKind.LATENT else self._index

    def registered_buffers(self) -> list[torch.Tensor]:
        """What a transfer layer registers: every owned layer's two buffers."""
        return [self.kv_buffer[i - self.layout.start_layer] for i in self.owned] + [
            self.index_buffer[i - self.layout.start_layer] for i in self.owned
        ]

    def ipc_slabs(self) -> None:
        """No slabs of its own: its allocations are exported one by one (see the module's note)."""
        return None
