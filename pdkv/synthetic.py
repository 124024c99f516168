"""Deterministic stand-in KV content: what a prefill without weights writes.

Each token's bytes derive from a 64-bit hash of (seed, layer, token), so a page moved to
the wrong place, a layer swapped with another or a stale page from an earlier request
shows up as a byte mismatch. Cheap enough to fill and verify 32k-token requests.
"""

from __future__ import annotations

import torch

from pdkv.layout import KVLayout

__all__ = ["token_bytes", "synthetic_layer", "SyntheticLayer"]

_M1, _M2 = 0x5851F42D4C957F2D, 0x14057B7EF767814F  # odd 64-bit mixing constants


def _as_int64(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


def token_bytes(seed: int, layer_id: int, tokens: torch.Tensor, width: int, salt: int = 0) -> torch.Tensor:
    """(tokens, width) uint8, a function of (seed, layer, token position, salt) alone."""
    key = _as_int64(seed * _M1 + layer_id * _M2 + salt * 0x9E3779B97F4A7C15)
    h = tokens.reshape(-1).long() * _as_int64(_M1) + key
    h = h ^ (h >> 29)  # arithmetic shift is fine: mixing, not a bijection proof
    h = h * _as_int64(_M2)
    h = h ^ (h >> 32)
    per_token = h.view(torch.uint8).view(-1, 8)
    reps = -(-width // 8)
    cols = (torch.arange(width, device=tokens.device) * 29).to(torch.uint8)
    return per_token.repeat(1, reps)[:, :width] + cols


class SyntheticLayer:
    """The latent KV row bytes and the indexer key and scale of some tokens of one layer."""

    def __init__(self, layout: KVLayout, seed: int, layer_id: int, tokens: torch.Tensor) -> None:
        self.kv = token_bytes(seed, layer_id, tokens, layout.kv_token_bytes, salt=1)
        index = token_bytes(seed, layer_id, tokens, layout.index_token_bytes, salt=2)
        self.index_k = index[:, : layout.index_head_dim].contiguous()
        self.index_scale = index[:, layout.index_head_dim :].contiguous().view(torch.float32)

    def kv_rows(self, layout: KVLayout) -> torch.Tensor:
        """The latent rows in the model dtype, as `set_kv_buffer` takes them."""
        return self.kv.view(layout.torch_store_dtype).view(layout.torch_dtype)


def synthetic_layer(layout: KVLayout, seed: int, layer_id: int, tokens: torch.Tensor) -> SyntheticLayer:
    return SyntheticLayer(layout, seed, layer_id, tokens)
