"""The KV geometry of a DSA (MLA latent + indexer) cache, as one frozen value.

Two processes that must exchange KV pages agree on a `KVLayout` fingerprint: it covers
what decides where a byte of a page lives, and leaves out what may differ per process
(the pool's size in tokens, the device).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdkv.errors import IncompatibleLayoutError, LayoutError

if TYPE_CHECKING:
    import torch

__all__ = ["BufferKind", "KVLayout", "dsa_v32", "tiny", "PRESETS", "INDEX_SCALE_BYTES", "geometry_fingerprint"]

# Bytes an element of each torch dtype a layout may name takes, by the dtype's name in torch:
# a layout is read by processes that never load torch (the registry, the router), and
# tests/test_layout.py holds the table to torch's own itemsize.
DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}

# One fp32 quantisation scale per indexer key.
INDEX_SCALE_BYTES = 4

# Fields that decide the byte layout of a page; the fingerprint covers exactly these.
_GEOMETRY_FIELDS = (
    "layer_num",
    "start_layer",
    "page_size",
    "kv_cache_dim",
    "store_dtype",
    "dtype",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "index_head_dim",
)


class BufferKind(enum.Enum):
    """The two buffers of a DSA layer: MLA latent KV and the sparse-attention indexer."""

    LATENT = "latent"
    INDEX = "index"


def geometry_fingerprint(geometry: Mapping[str, object]) -> str:
    """A stable short hash of geometry fields: equal for equal geometries, in any process."""
    return hashlib.sha256(json.dumps(dict(geometry), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one model's DSA KV cache in one pool.

    `kv_cache_dim` counts elements of `store_dtype` per token of latent KV; `dtype` is the
    model-facing dtype that reads view the stored bytes as.
    """

    layer_num: int
    page_size: int
    size: int
    kv_cache_dim: int
    store_dtype: str = "uint8"
    dtype: str = "float8_e4m3fn"
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128
    start_layer: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("layer_num", "page_size", "size", "kv_cache_dim", "index_head_dim"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{name} must be positive, got {getattr(self, name)}")
        if self.start_layer < 0:
            raise LayoutError(f"start_layer must be >= 0, got {self.start_layer}")
        if self.size % self.page_size:
            raise LayoutError(f"size ({self.size}) must be a multiple of page_size ({self.page_size})")
        for name in ("store_dtype", "dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise LayoutError(f"{name} {getattr(self, name)!r} is not a torch dtype a KV cache is kept in")

    # ---- derived geometry -------------------------------------------------------------
    @property
    def torch_store_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.store_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def end_layer(self) -> int:
        return self.start_layer + self.layer_num

    @property
    def kv_token_bytes(self) -> int:
        return self.kv_cache_dim * DTYPE_BYTES[self.store_dtype]

    @property
    def kv_page_bytes(self) -> int:
        """Bytes of one page of one layer of latent KV: the transfer item length."""
        return self.kv_token_bytes * self.page_size

    @property
    def kv_rows(self) -> int:
        """Token rows of a latent buffer: the pool plus one padding page, as SGLang."""
        return self.size + self.page_size

    @property
    def num_pages(self) -> int:
        """Pages addressable in every buffer (page 0 included)."""
        return self.kv_rows // self.page_size

    @property
    def index_token_bytes(self) -> int:
        return self.index_head_dim + INDEX_SCALE_BYTES * (self.index_head_dim // 128)

    @property
    def index_page_bytes(self) -> int:
        """Bytes of one indexer page: page_size fp8 keys token-major, then the scales."""
        return self.page_size * self.index_token_bytes

    @property
    def index_scale_offset(self) -> int:
        return self.page_size * self.index_head_dim

    @property
    def index_num_pages(self) -> int:
        # SGLang's (index_buf_size + page_size + 1) // page_size with index_buf_size = size.
        return (self.size + self.page_size + 1) // self.page_size

    @property
    def page_bytes_all_layers(self) -> int:
        return self.layer_num * (self.kv_page_bytes + self.index_page_bytes)

    # ---- identity -----------------------------------------------------------------------
    def geometry(self) -> dict[str, int | str]:
        return {name: getattr(self, name) for name in _GEOMETRY_FIELDS}

    @property
    def fingerprint(self) -> str:
        return geometry_fingerprint(self.geometry())

    def check_geometry(self, other: Mapping[str, object]) -> None:
        """The one layout check: raise `IncompatibleLayoutError` naming each geometry field
        where `other` (another layout's `geometry()`, or its wire form) differs."""
        mine = self.geometry()
        diff = tuple(k for k in _GEOMETRY_FIELDS if mine[k] != other.get(k))
        if diff:
            detail = ", ".join(f"{k}: local {mine[k]!r} != remote {other.get(k)!r}" for k in diff)
            raise IncompatibleLayoutError(f"KV layouts differ ({detail})", diff)

    def replace(self, **changes: object) -> KVLayout:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def dsa_v32(size: int = 64 * 1024, layer_num: int = 61, device: str = "cpu") -> KVLayout:
    """DeepSeek-V3.2 shaped: 61 layers, page 64, fp8 latent of 656 bytes a token."""
    return KVLayout(
        layer_num=layer_num,
        page_size=64,
        size=size,
        kv_cache_dim=656,  # 512 fp8 nope + 4 fp32 scales + 64 bf16 rope
        store_dtype="uint8",
        dtype="float8_e4m3fn",
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        index_head_dim=128,
        device=device,
    )


def tiny(size: int = 256, layer_num: int = 7, device: str = "cpu") -> KVLayout:
    """A small bf16 layout for tests: every code path, a few KiB a layer."""
    return KVLayout(
        layer_num=layer_num,
        page_size=4,
        size=size,
        kv_cache_dim=24,
        store_dtype="bfloat16",
        dtype="bfloat16",
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        index_head_dim=128,
        device=device,
    )


PRESETS = {"dsa_v32": dsa_v32, "tiny": tiny}
