"""Allocation of KV buffers, range checks, and the indexer page byte layout.

An indexer page holds `page_size` fp8 keys of `index_head_dim` bytes, token-major, then
`page_size` fp32 scales. The accessors view those two regions as (page, slot, bytes)
tensors, so one gather or scatter by (page, slot) moves whole keys and scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdkv.errors import LayoutError, PageRangeError
from pdkv.layout import INDEX_SCALE_BYTES, KVLayout


def alloc_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """A zeroed tensor; on the host, backed by numpy so large buffers get huge pages.

    UCX reads buffers on 4 KiB pages about half as fast as ones on transparent huge pages,
    and numpy (not torch.empty) advises the kernel to use them. The memory is also faulted
    in now, as a GPU allocation would be: a READ must not pay the page faults.
    """
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    arr = np.empty(max(nbytes, 1), dtype=np.uint8)
    arr.fill(0)  # touch every page
    raw = torch.from_numpy(arr)[:nbytes]
    return raw.view(dtype).view(shape)


LAYER_ALIGN = 256  # bytes: a layer's indexer starts, and each layer's region, on this boundary


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class LayerRegions:
    """Layers in one allocation, each one region: its latent KV, then its indexer.

    A layer's two buffers side by side let one broadcast carry the whole layer (one NCCL
    operation, not two: each costs a fixed latency a layer),
    and the allocation is still one thing to register with a transfer engine.
    """

    slab: torch.Tensor  # (layers, stride) uint8: everything, as registered
    kv: torch.Tensor  # (layers, kv_rows, 1, kv_cache_dim) in the store dtype: a strided view
    index: torch.Tensor  # (layers, index pages, index page bytes) uint8: a strided view
    views: tuple[torch.Tensor, ...]  # each layer's region (latent, padding, indexer), made once: ~3 us a read

    def region(self, i: int) -> torch.Tensor:
        """Layer `i`'s latent and indexer as one contiguous uint8 tensor."""
        return self.views[i]


def alloc_layers(layout: KVLayout, n: int) -> LayerRegions:
    """`n` zeroed layers of `layout`, each one [latent | indexer] region."""
    kv_bytes = layout.kv_rows * layout.kv_token_bytes
    index_bytes = layout.index_num_pages * layout.index_page_bytes
    index_at = _round_up(kv_bytes, LAYER_ALIGN)
    slab = alloc_zeros((n, index_at + _round_up(index_bytes, LAYER_ALIGN)), torch.uint8, layout.device)
    kv = slab[:, :kv_bytes].view(layout.torch_store_dtype).view(n, layout.kv_rows, 1, layout.kv_cache_dim)
    index = slab[:, index_at : index_at + index_bytes].view(n, layout.index_num_pages, layout.index_page_bytes)
    joint = index_at + index_bytes
    return LayerRegions(slab, kv, index, tuple(slab[i, :joint] for i in range(n)))


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as (rows, bytes) uint8: one row per token or page, whatever the store dtype."""
    return t.flatten(1).view(torch.uint8) if t.dim() > 1 else t.view(torch.uint8)[:, None]


def take(t: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """`t[index]` (advanced indexing). On the host through numpy, ~8x faster than torch
    for byte rows here; `t` must then have a numpy dtype (use `byte_rows`)."""
    if t.device.type != "cpu":
        return t[index]
    return torch.from_numpy(t.numpy()[tuple(i.cpu().numpy() for i in index)])


def put(t: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
    """`t[index] = values`, through numpy on the host (see `take`)."""
    if t.device.type != "cpu":
        t[index] = values.to(t.device)
        return
    t.numpy()[tuple(i.cpu().numpy() for i in index)] = values.cpu().numpy()


def check_locations(loc: torch.Tensor, limit: int, what: str) -> None:
    """Raise `PageRangeError` unless every entry of `loc` lies in [0, limit)."""
    if loc.numel() == 0:
        return
    lo, hi = int(loc.min()), int(loc.max())
    if lo < 0 or hi >= limit:
        raise PageRangeError(f"{what}: locations [{lo}, {hi}] outside [0, {limit})")


def as_store_rows(t: torch.Tensor, layout: KVLayout, width: int | None = None) -> torch.Tensor:
    """View `t` (one row per token) in the store dtype, flattening trailing dims."""
    rows = t.flatten(1).contiguous().view(layout.torch_store_dtype)
    if width is not None and rows.shape[1] != width:
        raise LayoutError(f"expected {width} {layout.store_dtype} per token, got {rows.shape[1]}")
    return rows


def index_key_view(buf: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """(pages, page_size, index_head_dim) view of the fp8 keys of an indexer buffer."""
    return buf[:, : layout.index_scale_offset].unflatten(1, (layout.page_size, layout.index_head_dim))


def index_scale_view(buf: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """(pages, page_size, 4) view of the fp32 scale bytes of an indexer buffer."""
    return buf[:, layout.index_scale_offset :].unflatten(1, (layout.page_size, INDEX_SCALE_BYTES))


def _page_slot(layout: KVLayout, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loc = loc.reshape(-1).long()
    return loc // layout.page_size, loc % layout.page_size


def _token_locs(layout: KVLayout, seq_len: int, page_indices: torch.Tensor) -> torch.Tensor:
    pages = page_indices.reshape(-1).long()
    if seq_len > pages.numel() * layout.page_size:
        raise PageRangeError(f"seq_len {seq_len} exceeds {pages.numel()} pages")
    check_locations(pages, layout.index_num_pages, "index page_indices")
    tokens = torch.arange(seq_len, device=pages.device)
    return pages[tokens // layout.page_size] * layout.page_size + tokens % layout.page_size


def gather_index_k(buf: torch.Tensor, layout: KVLayout, seq_len: int, page_indices: torch.Tensor) -> torch.Tensor:
    """The fp8 keys (as uint8) of the first `seq_len` tokens stored in `page_indices`."""
    page, slot = _page_slot(layout, _token_locs(layout, seq_len, page_indices.to(buf.device)))
    return take(index_key_view(buf, layout), page, slot)


def gather_index_scale(buf: torch.Tensor, layout: KVLayout, seq_len: int, page_indices: torch.Tensor) -> torch.Tensor:
    """The fp32 scale bytes (tokens x 4, uint8) of the first `seq_len` tokens."""
    page, slot = _page_slot(layout, _token_locs(layout, seq_len, page_indices.to(buf.device)))
    return take(index_scale_view(buf, layout), page, slot)


def scatter_index_k_and_scale(
    buf: torch.Tensor,
    layout: KVLayout,
    loc: torch.Tensor,
    index_k: torch.Tensor,
    index_k_scale: torch.Tensor,
) -> None:
    """Store keys (tokens x index_head_dim, fp8 or uint8) and fp32 scales of tokens `loc`."""
    page, slot = _page_slot(layout, loc.to(buf.device))
    keys = index_k.reshape(page.numel(), -1).contiguous().view(torch.uint8)
    scales = index_k_scale.reshape(page.numel(), -1).to(torch.float32).contiguous().view(torch.uint8)
    put(index_key_view(buf, layout), (page, slot), keys)
    put(index_scale_view(buf, layout), (page, slot), scales)


def move_index_tokens(buf: torch.Tensor, layout: KVLayout, tgt: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the indexer key and scale of each token `src[i]` to token `tgt[i]`."""
    tp, ts = _page_slot(layout, tgt)
    sp, ss = _page_slot(layout, src)
    for view in (index_key_view(buf, layout), index_scale_view(buf, layout)):
        put(view, (tp, ts), take(view, sp, ss))
