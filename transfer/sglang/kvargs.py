"""What SGLang's `KVArgs` list, as pdkv's pools: the target model's layers, the draft
model's (MTP) layers, and the per-request auxiliary rows.

SGLang appends a draft model's buffers after the target's, in the latent KV and in the
DSA indexer state alike (`num_draft_entries` of them); under the layer split only the last
CP rank carries them. pdkv moves them as an engine of their own (`<engine>-draft`, one
rank, the draft's layers), published and read with the same room: a decode that serves
MTP fetches both, and a room is done once both are.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from sglang.srt.disaggregation.base.conn import KVArgs, StateType

from pdkv.errors import LayoutError
from transfer.engine_kv import EngineKV, buffer_infos

DRAFT_SUFFIX = "-draft"


def _dsa_state(args: KVArgs) -> tuple[list[int], list[int], list[int], list[int]]:
    """The DSA indexer state's layer ids (often none: positional), addresses, bytes, items."""
    kinds = [StateType(t) for t in (getattr(args, "state_types", None) or [])]
    if StateType.DSA not in kinds:
        raise LayoutError("pdkv moves SGLang's DSA pools: these KVArgs carry no DSA indexer state")
    i = kinds.index(StateType.DSA)
    ids = list(args.state_layer_ids[i]) if getattr(args, "state_layer_ids", None) else []
    return ids, list(args.state_data_ptrs[i]), list(args.state_data_lens[i]), list(args.state_item_lens[i])


def _drafts(args: KVArgs) -> int:
    return int(getattr(args, "num_draft_entries", 0) or 0)


def engine_kv_from_args(args: KVArgs, layer_num: int, device: Any) -> EngineKV:
    """The target model's latent KV and DSA indexer state that `args` lists, as a pool.

    Layer ids come from `kv_layer_ids` where SGLang gives them, else by position from
    `prefill_start_layer` (SGLang's DSA pools report none); the indexer's are the latent's
    unless listed."""
    n = len(args.kv_data_ptrs) - _drafts(args)
    layers = list(args.kv_layer_ids[:n]) if getattr(args, "kv_layer_ids", None) else None
    if layers is None:
        start = int(getattr(args, "prefill_start_layer", 0) or 0)
        layers = list(range(start, start + n))
    latent = buffer_infos(layers, args.kv_data_ptrs[:n], args.kv_data_lens[:n], args.kv_item_lens[:n])
    ids, ptrs, lens, items = _dsa_state(args)
    index = buffer_infos(ids[:n] or layers, ptrs[:n], lens[:n], items[:n])
    return EngineKV(latent, index, page_size=int(args.page_size), layer_num=layer_num, device=device)


def draft_kv_from_args(args: KVArgs, device: Any) -> EngineKV | None:
    """The draft model's (MTP) latent KV and indexer state, its layers numbered from 0;
    None where `args` carry none."""
    drafts = _drafts(args)
    if not drafts:
        return None
    n = len(args.kv_data_ptrs) - drafts
    _, ptrs, lens, items = _dsa_state(args)
    if len(ptrs) != n + drafts:
        raise LayoutError(
            f"{drafts} draft KV buffers but {len(ptrs) - n} draft indexer buffers: pdkv moves a DSA draft model"
        )
    layers = list(range(drafts))
    latent = buffer_infos(layers, args.kv_data_ptrs[n:], args.kv_data_lens[n:], args.kv_item_lens[n:])
    index = buffer_infos(layers, ptrs[n:], lens[n:], items[n:])
    return EngineKV(latent, index, page_size=int(args.page_size), layer_num=drafts, device=device)


class AuxRows:
    """SGLang's per-request auxiliary buffers (first output token, logprobs, ...): one row
    per request slot in each buffer, in host memory. A room carries its rows as one blob."""

    def __init__(self, ptrs: list[int], lens: list[int], items: list[int]) -> None:
        self.buffers = list(zip(map(int, ptrs), map(int, lens), map(int, items)))
        self.row_bytes = sum(item for _, _, item in self.buffers)
        if self.buffers and torch.cuda.is_available():  # rows are copied with the CPU: no GPU pointers
            from transfer.lanes.cuda_ipc.driver import CudaDriver

            driver = CudaDriver.get()
            if any(driver.is_device_memory(ptr) for ptr, _, _ in self.buffers):
                raise LayoutError("pdkv moves SGLang's aux rows from host memory; these aux buffers are on a GPU")

    def _at(self, index: int) -> list[tuple[int, int]]:
        spots = [(ptr + index * item, item) for ptr, n, item in self.buffers]
        if index < 0 or any(index * item + item > n for _, n, item in self.buffers):
            raise LayoutError(f"aux row {index} outside the auxiliary buffers")
        return spots

    def read(self, index: int) -> bytes:
        return b"".join(ctypes.string_at(addr, n) for addr, n in self._at(index))

    def write(self, index: int, blob: bytes) -> None:
        if len(blob) != self.row_bytes:
            raise LayoutError(f"an aux row of {len(blob)} bytes where this engine's rows take {self.row_bytes}")
        offset = 0
        for addr, n in self._at(index):
            ctypes.memmove(addr, blob[offset : offset + n], n)
            offset += n
