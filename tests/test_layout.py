"""A layout is read without torch: its dtype table holds to torch, and the control-plane
processes (registry, router) start without loading torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdkv.errors import LayoutError
from pdkv.layout import DTYPE_BYTES, KVLayout


@pytest.mark.parametrize("name", sorted(DTYPE_BYTES))
def test_the_dtype_table_holds_to_torch(name: str) -> None:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    assert dtype.itemsize == DTYPE_BYTES[name]


def test_a_layout_naming_no_kv_dtype_is_refused() -> None:
    with pytest.raises(LayoutError, match="complex64"):
        KVLayout(layer_num=1, page_size=4, size=8, kv_cache_dim=16, store_dtype="complex64")
    with pytest.raises(LayoutError, match="Tensor"):
        KVLayout(layer_num=1, page_size=4, size=8, kv_cache_dim=16, dtype="Tensor")


def test_a_layouts_token_bytes_follow_its_store_dtype() -> None:
    bf16 = KVLayout(layer_num=1, page_size=4, size=8, kv_cache_dim=16, store_dtype="bfloat16", dtype="bfloat16")
    assert bf16.kv_token_bytes == 32
    assert bf16.torch_store_dtype is torch.bfloat16


@pytest.mark.parametrize("module", ["transfer.app.bootstrap_registry", "transfer.app.router", "transfer.metadata"])
def test_the_control_plane_starts_without_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0, f"{module} loads torch"
