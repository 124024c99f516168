"""pdkv's library end to end, in one file: a registry, a prefill engine of two CP ranks, a decode.

    python examples/quickstart.py

The prefill ranks are processes of their own in a real gloo group, each holding only its
share of the layers (`LayerSplitDSAKVPool`), as a context-parallel prefill does. Each rank
writes room 1's KV, publishes it and hands back its `OwnerPin`; the decode reads the room
with the `RoomTicket` made of those pins (no control request), then reads room 2 without a
ticket (by claims), and checks every byte of both.
"""

from __future__ import annotations

import asyncio
import datetime
import multiprocessing as mp
import os
import sys
import tempfile
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import numpy as np
import torch
import torch.distributed as dist

from pdkv import DSAKVPool, KVLayout, LayerSplitDSAKVPool, OwnerBroadcaster, ShardPlan, tiny
from transfer.decode import DecodeFetcher
from transfer.metadata import OwnerPin, RoomTicket, decode, encode
from transfer.prefill import PrefillExporter
from transfer.registry.server import RegistryServer

ENGINE, CP = "prefill0", 2
TOKENS = 10  # per room: two full pages of the tiny layout (4 tokens a page) and a part page
ROOMS = {1: np.array([5, 2, 9]), 2: np.array([7, 0, 3])}  # room -> its pages on the prefill
DST = {1: np.array([4, 0, 6]), 2: np.array([1, 2, 3])}  # ... and where the decode puts it
TIMEOUT = 60.0  # every wait of this example: a hung run fails instead of hanging


def layout() -> KVLayout:  # the same on both sides, or the decode refuses the owners
    return tiny(size=64)


PAGE = layout().page_size


def token_bytes(room: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the model would have computed for `room`'s tokens in `layer`: (latent, indexer)
    bytes per token, a function of (room, layer) so the decode knows what to expect."""
    lay, gen = layout(), torch.Generator().manual_seed(1000 * room + layer)
    kv = torch.randint(0, 256, (TOKENS, lay.kv_token_bytes), dtype=torch.uint8, generator=gen)
    index = torch.randint(0, 256, (TOKENS, lay.index_token_bytes), dtype=torch.uint8, generator=gen)
    return kv, index


def slots(pages: np.ndarray) -> torch.Tensor:
    """The token slots of a room's first TOKENS positions in `pages`."""
    pos = torch.arange(TOKENS)
    return torch.from_numpy(pages).long()[pos // PAGE] * PAGE + pos % PAGE


# ---- the prefill: one process per CP rank -------------------------------------------------------
def prefill_rank(rank: int, init: str, registry: str, pins: Queue[bytes], done: Event) -> None:
    # The ranks of one engine share a process group, as the model's ranks do; the pool's
    # owner broadcast (other ranks reading this rank's layers) runs over it.
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=CP, timeout=datetime.timedelta(seconds=60))
    lay = layout()
    pool = LayerSplitDSAKVPool(lay, ShardPlan(rank, CP, lay.layer_num), OwnerBroadcaster(device="cpu"))
    try:
        asyncio.run(export(rank, pool, registry, pins, done))
    finally:
        dist.destroy_process_group()


async def export(rank: int, pool: LayerSplitDSAKVPool, registry: str, pins: Queue[bytes], done: Event) -> None:
    async with PrefillExporter(pool, ENGINE, rank, CP, registry) as exporter:  # registers this rank
        for room, pages in ROOMS.items():
            # Pinned until the decode released it (or `Timeouts.pin`); room 1 is read by ticket (below).
            exporter.publish_room(room, pages, hold=room != 1)
            for layer in range(pool.layout.layer_num):  # every rank calls every write; owners keep theirs
                kv, index = token_bytes(room, layer)
                lay = pool.layout
                pool.set_kv_buffer(layer, slots(pages), kv.view(lay.torch_store_dtype).view(lay.torch_dtype))
                k, scale = index[:, : lay.index_head_dim], index[:, lay.index_head_dim :].contiguous()
                pool.set_index_k_and_scale(layer, slots(pages), k.contiguous(), scale.view(torch.float32))
                if pool.is_owned(layer):
                    exporter.mark_ready(room, layer + 1)  # a decode may read this layer now
        # Room 1 goes by ticket: this rank's pin, sent as the wire type (no pickle between processes).
        pin = await exporter.pin(1, timeout=TIMEOUT)
        assert pin is not None, "room 1 died before it was pinned"
        pins.put(encode(pin))
        await asyncio.to_thread(done.wait, TIMEOUT)  # serve reads until the decode is through


# ---- the decode -------------------------------------------------------------------------------
def check(pool: DSAKVPool, room: int) -> int:
    """Every byte of `room`'s tokens where the decode put them; the bytes checked."""
    lay, checked = pool.layout, 0
    for layer in range(lay.layer_num):
        kv, index = token_bytes(room, layer)
        got_kv = pool.get_key_buffer(layer)[slots(DST[room])].reshape(TOKENS, -1).contiguous().view(torch.uint8)
        k, scale = pool.get_index_k_and_scale(layer, TOKENS, torch.from_numpy(DST[room]))
        assert torch.equal(got_kv, kv), f"room {room} layer {layer}: latent KV differs"
        assert torch.equal(k, index[:, : lay.index_head_dim]), f"room {room} layer {layer}: indexer keys differ"
        assert torch.equal(scale.reshape(TOKENS, -1), index[:, lay.index_head_dim :]), f"room {room}: scales differ"
        checked += kv.numel() + index.numel()
    return checked


async def main() -> int:
    ctx = mp.get_context("spawn")  # a fresh interpreter per rank, as a launcher starts them
    pins: Queue[bytes] = ctx.Queue()
    done = ctx.Event()
    registry = RegistryServer()  # the bootstrap registry: prefill ranks register, decodes look up
    url = await registry.start()
    with tempfile.TemporaryDirectory() as tmp:
        ranks = [ctx.Process(target=prefill_rank, args=(r, f"file://{tmp}/gloo", url, pins, done)) for r in range(CP)]
        for p in ranks:
            p.start()
        try:
            # The router's job in a deployment: gather each rank's pin into the room's ticket.
            got = [decode(await asyncio.to_thread(pins.get, True, TIMEOUT), OwnerPin) for _ in range(CP)]
            pins_by_rank = sorted(got, key=lambda p: p.cp_rank)
            ticket = RoomTicket(engine_id=ENGINE, room=1, src_pages=ROOMS[1].tolist(), pins=pins_by_rank)
            pool = DSAKVPool(layout())  # the decode's own pool: every layer
            async with DecodeFetcher(pool, url) as fetcher:
                # With a ticket: every owner read at once, each pin word proved after the data.
                result = await fetcher.fetch(ENGINE, 1, DST[1], ticket=ticket, timeout=TIMEOUT)
                print(f"room 1 by ticket: {result.nbytes} bytes, {result.control_messages} control messages")
                # Without one: claims on every owner, layers read as their readiness arrives.
                result = await fetcher.fetch(ENGINE, 2, DST[2], timeout=TIMEOUT)
                print(f"room 2 by claims: {result.nbytes} bytes, {result.control_messages} control messages")
            checked = check(pool, 1) + check(pool, 2)
            print(f"ok: {checked} bytes of 2 rooms checked, each as the prefill wrote it")
        finally:
            done.set()
            for p in ranks:  # off the loop: the registry keeps answering the ranks' leaving
                await asyncio.to_thread(p.join, TIMEOUT)
            await registry.aclose()
    return 0 if all(p.exitcode == 0 for p in ranks) else 1


if __name__ == "__main__":
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL tells each agent it makes on stdout (ranks inherit it)
    sys.exit(asyncio.run(main()))
