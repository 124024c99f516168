"""Prefill owners whose KV lies in buffers of their own, one tensor per layer and kind, as
SGLang's DSA pools allocate it: each a process of its own (spawned), exporting through
`PrefillExporter` over an `EngineKV`. Shared by the GPU tests and scripts/bench_fetch.py
(`--engine-buffers`).

`vmm`: the owner's allocator uses expandable segments (VMM memory), which CUDA IPC handles
cannot export: its decodes read it over UCX.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from dataclasses import dataclass

import numpy as np
import torch

from pdkv.sharding import get_layer_shard_range
from tests import children

KV_TOKEN, INDEX_TOKEN = 656, 132  # DeepSeek-V3.2's fp8 latent and indexer bytes a token


@dataclass(frozen=True)
class Shape:
    layers: int
    page_size: int
    pages: int  # per buffer, one padding page included (as SGLang's pools)

    @property
    def kv_item(self) -> int:
        return KV_TOKEN * self.page_size

    @property
    def index_item(self) -> int:
        return INDEX_TOKEN * self.page_size


def layer_pattern(shape: Shape, layer: int, kind: int, device: str = "cuda") -> torch.Tensor:
    """What an owner writes in `layer`'s buffer of `kind` (0 latent, 1 indexer): seeded bytes."""
    item = (shape.kv_item, shape.index_item)[kind]
    gen = torch.Generator(device=device).manual_seed(1000 * kind + layer)
    return torch.randint(0, 256, (shape.pages, item), generator=gen, device=device, dtype=torch.uint8)


def engine_buffers(shape: Shape, layers: range, fill: bool, device: str = "cuda") -> list[torch.Tensor]:
    """A tensor per layer and kind (latent first, then indexer), each its own allocation."""
    out = []
    for kind, item in ((0, shape.kv_item), (1, shape.index_item)):
        for layer in layers:
            t = torch.zeros((shape.pages, item), dtype=torch.uint8, device=device)
            if fill:
                t.copy_(layer_pattern(shape, layer, kind, device))
            out.append(t)
    return out


def engine_kv(shape: Shape, layers: range, buffers: list[torch.Tensor], device: str = "cuda"):  # type: ignore[no-untyped-def]
    from transfer.engine_kv import EngineKV, buffer_infos

    n = len(layers)
    latent, index = buffers[:n], buffers[n:]
    return EngineKV(
        buffer_infos(layers, [t.data_ptr() for t in latent], [t.nbytes for t in latent], [shape.kv_item] * n),
        buffer_infos(layers, [t.data_ptr() for t in index], [t.nbytes for t in index], [shape.index_item] * n),
        page_size=shape.page_size,
        layer_num=shape.layers,
        device=device,
    )


def run_owner(
    registry_url: str,
    engine_id: str,
    cp_rank: int,
    cp_size: int,
    shape: Shape,
    rooms: dict[int, list[int]],
    out: mp.Queue,
    stop: mp.Event,
    vmm: bool = False,
    unpinned: frozenset[int] = frozenset(),
    device: str = "cuda",
    partial: frozenset[int] = frozenset(),
) -> None:
    """One CP rank: publish `rooms` (room -> source pages), all layers ready; report
    (cp_rank, exported slabs or None, {room: OwnerPin}) on `out`; serve until `stop`.
    Rooms in `unpinned` get no ticket: they are read by claims. Rooms in `partial` are a
    prefill not finished: only the first half of the owned layers (at least one) is marked
    ready and no more ever is; they get no ticket, and a fetch of one waits."""
    if vmm:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    from transfer.prefill import PrefillExporter

    owned = range(*get_layer_shard_range(cp_rank, cp_size, shape.layers))
    buffers = engine_buffers(shape, owned, fill=True, device=device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    kv = engine_kv(shape, owned, buffers, device=device)

    async def serve() -> None:
        async with PrefillExporter(kv, engine_id, cp_rank, cp_size, registry_url) as exporter:
            for room, pages in rooms.items():
                # A room read by its ticket holds no claim for the arbiter; one read by claims does.
                exporter.publish_room(room, np.array(pages), hold=room in unpinned)
                half = owned.start + max(1, len(owned) // 2)
                exporter.mark_ready(room, half if room in partial else owned.stop)
            waiting = unpinned | partial
            pins = {room: await exporter.pin(room, 30) for room in rooms if room not in waiting}
            assert exporter.descriptor is not None
            ipc = exporter.descriptor.ipc
            out.put((cp_rank, None if ipc is None else len(ipc.slabs) + len(ipc.vmm), pins))
            while not stop.is_set():
                await asyncio.sleep(0.05)

    asyncio.run(serve())


def start_owners(  # type: ignore[no-untyped-def]
    registry_url: str,
    engine_id: str,
    cp_size: int,
    shape: Shape,
    rooms: dict[int, list[int]],
    vmm_ranks=(),
    unpinned: frozenset[int] = frozenset(),
    device: str = "cuda",
    partial: frozenset[int] = frozenset(),
):
    """Spawn `cp_size` owners (see `run_owner`); returns (processes, stop event,
    {cp_rank: (slabs, pins)})."""
    ctx = children.context()
    out, stop = ctx.Queue(), ctx.Event()
    rest = (unpinned, device, partial)
    procs = [
        ctx.Process(
            target=run_owner,
            args=(registry_url, engine_id, r, cp_size, shape, rooms, out, stop, r in vmm_ranks, *rest),
        )
        for r in range(cp_size)
    ]
    for p in procs:
        p.start()
    reports = {}
    for _ in procs:
        rank, slabs, pins = out.get(timeout=240)
        reports[rank] = (slabs, pins)
    return procs, stop, reports


def stop_owners(procs, stop) -> None:  # type: ignore[no-untyped-def]
    stop.set()
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
