"""The DSA KV pool: MLA latent KV plus the sparse-attention indexer cache, per layer.

`DSAKVPool` holds every layer. `LayerSplitDSAKVPool` (in `pdkv.layer_split`) holds only
the layers its CP rank owns and serves reads of the others through an owner broadcast.
Both keep `kv_buffer[i]` / `index_buffer[i]` indexed by local layer, so a non-owned
layer is a 0-row placeholder rather than a gap.

Owned layers live in one contiguous slab, each layer one region holding its latent KV and
then its indexer (`pdkv.buffers.LayerRegions`): a transfer engine registers that slab once,
pages of different layers or kinds can never alias, and a whole layer can travel as one
broadcast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdkv.buffers import (
    alloc_layers,
    as_store_rows,
    byte_rows,
    check_locations,
    gather_index_k,
    gather_index_scale,
    move_index_tokens,
    put,
    scatter_index_k_and_scale,
    take,
)
from pdkv.errors import PageRangeError
from pdkv.layout import BufferKind, KVLayout

__all__ = ["DSAKVPool", "BufferInfos", "CpuKVCopy"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BufferInfos:
    """Owned buffers of one kind, as a transfer layer registers them (SGLang's triple)."""

    layer_ids: tuple[int, ...]
    data_ptrs: tuple[int, ...]
    data_lens: tuple[int, ...]
    item_lens: tuple[int, ...]


@dataclass
class CpuKVCopy:
    """A host copy of some pages of every owned layer; None for a layer not owned."""

    kv: list[torch.Tensor | None]
    index: list[torch.Tensor | None]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy; from a GPU through pinned memory, so the copy runs at DMA speed."""
    if not t.is_cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host


class DSAKVPool:
    """A DSA KV pool that holds the layers in `owned` (by default all of them)."""

    def __init__(self, layout: KVLayout, owned: range | None = None) -> None:
        self.layout = layout
        self.owned = owned if owned is not None else range(layout.start_layer, layout.end_layer)
        if self.owned.step != 1 or (
            len(self.owned) and (self.owned.start < layout.start_layer or self.owned.stop > layout.end_layer)
        ):
            raise PageRangeError(f"owned layers {self.owned} outside the layout's layers")
        self.device = torch.device(layout.device)
        self._layers = (layout.start_layer, layout.end_layer)
        n = len(self.owned)
        self.regions = alloc_layers(layout, n)
        self.kv_buffer = [self._layer_view(self.kv_slab, i) for i in self._layer_range()]
        self.index_buffer = [self._layer_view(self.index_slab, i) for i in self._layer_range()]
        # Each layer's latent in the model dtype, made once: a view costs ~2 us on every read.
        self.kv_read = [self._model_dtype(b) for b in self.kv_buffer]
        logger.debug("pool %s owns layers [%d, %d)", layout.fingerprint, self.owned.start, self.owned.stop)

    @property
    def slab(self) -> torch.Tensor:
        """Every owned layer's bytes, as registered: (owned layer, region bytes) uint8."""
        return self.regions.slab

    @property
    def kv_slab(self) -> torch.Tensor:
        """The owned layers' latent buffers, (owned layer, ...) in the store dtype (strided)."""
        return self.regions.kv

    @property
    def index_slab(self) -> torch.Tensor:
        """The owned layers' indexer buffers, (owned layer, pages, page bytes) uint8 (strided)."""
        return self.regions.index

    # ---- layer bookkeeping ----------------------------------------------------------------
    def _layer_range(self) -> range:
        return range(self.layout.start_layer, self.layout.end_layer)

    def _layer_view(self, slab: torch.Tensor, layer_id: int) -> torch.Tensor:
        if layer_id in self.owned:
            return slab[layer_id - self.owned.start]
        return slab.new_empty((0, *slab.shape[2:]))

    def _local(self, layer_id: int) -> int:
        start, end = self._layers  # not the layout's properties: every read comes here
        if not start <= layer_id < end:
            raise PageRangeError(f"layer {layer_id} outside the pool's layers [{start}, {end})")
        return layer_id - start

    def _model_dtype(self, latent: torch.Tensor) -> torch.Tensor:
        """A latent buffer as reads return it: viewed in the model dtype."""
        same = self.layout.store_dtype == self.layout.dtype
        return latent if same else latent.view(self.layout.torch_dtype)

    def is_owned(self, layer_id: int) -> bool:
        return self._local(layer_id) + self.layout.start_layer in self.owned

    @property
    def layer_shard_start(self) -> int:
        """First global layer this pool owns: the label of its contiguous owned range."""
        return self.owned.start

    # ---- read hooks: a full pool reads its own buffers -------------------------------------
    def _kv_for_read(self, layer_id: int) -> torch.Tensor:
        """The layer's latent in the model dtype."""
        return self.kv_read[self._local(layer_id)]

    def _index_for_read(self, layer_id: int) -> torch.Tensor:
        return self.index_buffer[self._local(layer_id)]

    def _before_write(self, layer_id: int, kind: BufferKind) -> None:
        """Called before any write of `layer_id`; the layer-split pool invalidates here."""

    def _owned_kv(self, layer_id: int) -> torch.Tensor | None:
        """The owned buffer to write, or None when this pool does not hold `layer_id`."""
        return self.kv_buffer[self._local(layer_id)] if self.is_owned(layer_id) else None

    def _owned_index(self, layer_id: int) -> torch.Tensor | None:
        return self.index_buffer[self._local(layer_id)] if self.is_owned(layer_id) else None

    # ---- latent KV ----------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's latent KV, (rows, 1, kv_cache_dim) in the model dtype."""
        return self._kv_for_read(layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The layer's latent KV without the rope part: the first kv_lora_rank elements."""
        return self.get_key_buffer(layer_id)[..., : self.layout.kv_lora_rank]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """Store whole latent rows (tokens x kv_cache_dim, model dtype) at token `loc`."""
        check_locations(loc, self.layout.kv_rows, "set_kv_buffer loc")
        self._before_write(layer_id, BufferKind.LATENT)
        buf = self._owned_kv(layer_id)
        if buf is None:
            return
        rows = as_store_rows(cache_k.to(self.layout.torch_dtype), self.layout, self.layout.kv_cache_dim)
        put(byte_rows(buf), (loc.reshape(-1).long(),), byte_rows(rows))

    def set_mla_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor
    ) -> None:
        """Store the nope and rope parts, each already in its stored representation."""
        check_locations(loc, self.layout.kv_rows, "set_mla_kv_buffer loc")
        self._before_write(layer_id, BufferKind.LATENT)
        buf = self._owned_kv(layer_id)
        if buf is None:
            return
        nope = as_store_rows(cache_k_nope, self.layout)
        rope = as_store_rows(cache_k_rope, self.layout, self.layout.kv_cache_dim - nope.shape[1])
        put(byte_rows(buf), (loc.reshape(-1).long(),), byte_rows(torch.cat([nope, rope], dim=1)))

    # ---- indexer ------------------------------------------------------------------------------
    def get_index_buffer(self, layer_id: int) -> torch.Tensor:
        return self._index_for_read(layer_id)

    def get_index_k(self, layer_id: int, seq_len: int, page_indices: torch.Tensor) -> torch.Tensor:
        return gather_index_k(self._index_for_read(layer_id), self.layout, seq_len, page_indices)

    def get_index_k_scale(self, layer_id: int, seq_len: int, page_indices: torch.Tensor) -> torch.Tensor:
        return gather_index_scale(self._index_for_read(layer_id), self.layout, seq_len, page_indices)

    def get_index_k_and_scale(
        self, layer_id: int, seq_len: int, page_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self._index_for_read(layer_id)
        return (
            gather_index_k(buf, self.layout, seq_len, page_indices),
            gather_index_scale(buf, self.layout, seq_len, page_indices),
        )

    def set_index_k_and_scale(
        self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor, index_k_scale: torch.Tensor
    ) -> None:
        check_locations(loc, self.layout.index_num_pages * self.layout.page_size, "set_index loc")
        self._before_write(layer_id, BufferKind.INDEX)
        buf = self._owned_index(layer_id)
        if buf is not None:
            scatter_index_k_and_scale(buf, self.layout, loc, index_k, index_k_scale)

    # ---- whole-pool operations ----------------------------------------------------------------
    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Copy the KV of tokens `src_loc` to tokens `tgt_loc` in every owned layer."""
        for loc, what in ((tgt_loc, "move_kv_cache tgt_loc"), (src_loc, "move_kv_cache src_loc")):
            check_locations(loc, self.layout.kv_rows, what)
        if tgt_loc.numel() != src_loc.numel():
            raise PageRangeError(f"move_kv_cache: {tgt_loc.numel()} targets, {src_loc.numel()} sources")
        if tgt_loc.numel() == 0:
            return
        tgt, src = tgt_loc.reshape(-1).long().to(self.device), src_loc.reshape(-1).long().to(self.device)
        for layer_id in self.owned:
            self._before_write(layer_id, BufferKind.LATENT)
            self._before_write(layer_id, BufferKind.INDEX)
        for buf in self.kv_buffer:
            if buf.shape[0]:
                rows = byte_rows(buf)
                put(rows, (tgt,), take(rows, src))
        for buf in self.index_slab:
            move_index_tokens(buf, self.layout, tgt, src)

    def _page_indices(self, indices: torch.Tensor) -> torch.Tensor:
        return (indices.reshape(-1)[:: self.layout.page_size] // self.layout.page_size).long()

    def get_cpu_copy(self, indices: torch.Tensor) -> CpuKVCopy:
        """Copy the tokens `indices` (whole pages) of every owned layer to host memory."""
        check_locations(indices, self.layout.kv_rows, "get_cpu_copy indices")
        tok = indices.reshape(-1).long().to(self.device)
        pages = self._page_indices(tok)
        kv, idx = _to_host(self.kv_slab[:, tok]), _to_host(self.index_slab[:, pages])
        return CpuKVCopy(
            kv=[kv[layer - self.owned.start] if layer in self.owned else None for layer in self._layer_range()],
            index=[idx[layer - self.owned.start] if layer in self.owned else None for layer in self._layer_range()],
        )

    def load_cpu_copy(self, copy: CpuKVCopy, indices: torch.Tensor) -> None:
        """Write a `get_cpu_copy` result back to the tokens `indices` of every owned layer."""
        check_locations(indices, self.layout.kv_rows, "load_cpu_copy indices")
        tok = indices.reshape(-1).long().to(self.device)
        pages = self._page_indices(tok)
        for layer_id in self.owned:
            local = self._local(layer_id)
            kv, idx = copy.kv[local], copy.index[local]
            if kv is None or idx is None or kv.shape[0] != tok.numel() or idx.shape[0] != pages.numel():
                raise PageRangeError(f"load_cpu_copy: the copy does not match layer {layer_id}")
            self._before_write(layer_id, BufferKind.LATENT)
            self._before_write(layer_id, BufferKind.INDEX)
            self.kv_buffer[local][tok] = kv.to(self.device, non_blocking=True)
            self.index_buffer[local][pages] = idx.to(self.device, non_blocking=True)

    # ---- what a transfer layer registers -----------------------------------------------------
    def _infos(self, buffers: list[torch.Tensor], item_len: int) -> BufferInfos:
        layers = tuple(self.owned)
        return BufferInfos(
            layer_ids=layers,
            data_ptrs=tuple(buffers[self._local(i)].data_ptr() for i in layers),
            data_lens=tuple(buffers[self._local(i)].nbytes for i in layers),
            item_lens=tuple(item_len for _ in layers),
        )

    def infos(self, kind: BufferKind) -> BufferInfos:
        """The owned layers' buffers of `kind`; item_len is one page of one layer."""
        if kind is BufferKind.LATENT:
            return self._infos(self.kv_buffer, self.layout.kv_page_bytes)
        return self._infos(self.index_buffer, self.layout.index_page_bytes)

    # SGLang's names for the same (its transfer backends call these on its pools).
    def get_contiguous_buf_infos(self) -> BufferInfos:
        return self.infos(BufferKind.LATENT)

    def get_state_buf_infos(self) -> BufferInfos:
        return self.infos(BufferKind.INDEX)

    def registered_buffers(self) -> list[torch.Tensor]:
        """What a transfer layer registers: the slab of owned layers."""
        return [self.slab]

    def ipc_slabs(self) -> dict[BufferKind, torch.Tensor] | None:
        """Where each kind's buffers lie, for a same-host decode to map by CUDA IPC (one slab
        holds both); None off the GPU or owning nothing."""
        if self.device.type != "cuda" or self.slab.numel() == 0:
            return None
        return {BufferKind.LATENT: self.slab, BufferKind.INDEX: self.slab}
