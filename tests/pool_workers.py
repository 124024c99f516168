"""Rank bodies for the layer-split pool tests (imported by spawned processes)."""

from __future__ import annotations

import asyncio

import torch

from pdkv import LayerSplitDSAKVPool, OwnerBroadcaster, ShardPlan, dsa_v32, tiny
from transfer.app.synthetic import SyntheticLayer

PAGES = torch.tensor([3, 1, 7, 2, 9])  # deliberately out of order


def _tokens(layout, pages=PAGES):
    ps = layout.page_size
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


def write_all(pool: LayerSplitDSAKVPool, seed: int) -> None:
    """Every rank calls every write (collective order); non-owners keep nothing."""
    loc = _tokens(pool.layout)
    for layer in range(pool.layout.layer_num):
        data = SyntheticLayer(pool.layout, seed, layer, loc)
        pool.set_kv_buffer(layer, loc, data.kv_rows(pool.layout))
        pool.set_index_k_and_scale(layer, loc, data.index_k, data.index_scale)


def check_layer(pool: LayerSplitDSAKVPool, layer: int, seed: int, pages: torch.Tensor = PAGES) -> None:
    layout = pool.layout
    loc = _tokens(layout, pages)
    want = SyntheticLayer(layout, seed, layer, loc)
    got_kv = pool.get_key_buffer(layer)[loc].reshape(loc.numel(), -1).cpu()
    assert torch.equal(got_kv.contiguous().view(torch.uint8), want.kv), f"latent layer {layer}"
    value = pool.get_value_buffer(layer)[loc].reshape(loc.numel(), -1).cpu()
    assert torch.equal(value.contiguous().view(torch.uint8), want.kv[:, : value.shape[1] * value.element_size()])
    k, s = (t.cpu() for t in pool.get_index_k_and_scale(layer, loc.numel(), pages))
    assert torch.equal(k, want.index_k), f"index keys layer {layer}"
    assert torch.equal(s, want.index_scale.view(torch.uint8).view(-1, 4)), f"index scales layer {layer}"
    assert torch.equal(pool.get_index_k(layer, loc.numel() - 3, pages).cpu(), want.index_k[:-3])
    assert torch.equal(pool.get_index_k_scale(layer, 5, pages).cpu(), s[:5])


def owner_broadcast_reads(
    rank: int, world: int, layers: int, device: str = "cpu", backend: str | None = None, dsa: bool = False
) -> dict[str, int]:
    """`dsa`: DeepSeek-V3.2's layout, whose latent reads are float8 (which gloo cannot carry
    as such), else the small bf16 one."""
    if device == "cuda:rank":  # one GPU per rank
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    layout = dsa_v32(size=1024, layer_num=layers, device=device) if dsa else tiny(layer_num=layers, device=device)
    plan = ShardPlan(rank, world, layers)
    pool = LayerSplitDSAKVPool(layout, plan, OwnerBroadcaster(device=device, backend=backend))
    for layer in range(layers):
        expected_rows = layout.kv_rows if plan.owns(layer) else 0
        assert pool.kv_buffer[layer].shape[0] == expected_rows
    write_all(pool, seed=1)

    # Blocking reads, prefetching layer l+1 while layer l is read.
    for layer in range(layers):
        check_layer(pool, layer, seed=1)
        if layer + 1 < layers:
            pool.prefetch(layer + 1)  # lands while the caller computes on layer

    # Two slots: layer l stays readable while layer l+1 arrives, and nothing travels twice.
    pool.remote_kv.clear()
    pool.remote_index.clear()
    before = pool.remote_kv.broadcasts
    for layer in range(layers):
        check_layer(pool, layer, seed=1)
        if layer + 1 < layers:
            pool.prefetch(layer + 1)
        check_layer(pool, layer, seed=1)
    assert pool.remote_kv.broadcasts - before == layers

    # The asyncio face: await the broadcast, then read without blocking.
    async def read_async() -> None:
        for layer in range(layers):
            pool.prefetch(layer)
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            t = asyncio.create_task(ticker())
            await pool.wait_layer(layer)
            t.cancel()
            check_layer(pool, layer, seed=1)

    asyncio.run(read_async())

    # Only some pages travel: those pages read back exact, and fewer bytes moved.
    async def read_pages() -> None:
        for layer in range(layers):
            before = pool.remote_kv.bytes_broadcast
            pool.invalidate_layer(layer)
            await pool.wait_layer(layer, PAGES)
            check_layer(pool, layer, seed=1)
            if not plan.owns(layer):
                moved = pool.remote_kv.bytes_broadcast - before
                assert moved == len(PAGES) * layout.kv_page_bytes, moved

    asyncio.run(read_pages())

    # A write after a read invalidates the copy: the next read sees the new data.
    last = layers - 1
    pool.get_key_buffer(last)
    write_all(pool, seed=2)
    check_layer(pool, last, seed=2)
    check_layer(pool, 0, seed=2)

    # A slot holding some pages of a layer is not taken for others: asking for pages it
    # lacks broadcasts them (what sits there otherwise is left over from seed 2).
    write_all(pool, seed=3)
    head, tail = PAGES[:2], PAGES[2:]

    async def other_pages() -> None:
        for layer in range(layers):
            pool.prefetch(layer, head)
            await pool.wait_layer(layer, tail)
            check_layer(pool, layer, seed=3, pages=tail)
            await pool.wait_layer(layer, head)
            check_layer(pool, layer, seed=3, pages=head)
            await pool.wait_layer(layer, head[:1])  # held already: nothing travels
            check_layer(pool, layer, seed=3, pages=head)

    before = pool.remote_kv.broadcasts
    asyncio.run(other_pages())
    if len(plan.owned) < layers:
        assert pool.remote_kv.broadcasts - before == 3 * layers
    if layers >= 3 and len(plan.owned) < layers:
        slots_part_ways(pool, seed=3)
    return {"kv_broadcasts": pool.remote_kv.broadcasts, "owned": len(plan.owned)}


def slots_part_ways(pool: LayerSplitDSAKVPool, seed: int) -> None:
    """A whole layer goes as one buffer when both kinds land in slots of the same number,
    else as two: after a write of one kind only, the kinds' slots part ways, and the reads
    are still byte-exact on every rank."""
    pool.remote_kv.clear()
    pool.remote_index.clear()
    whole = pool.whole_layer_broadcasts
    pool.prefetch(0)
    pool.prefetch(1)
    assert pool.whole_layer_broadcasts - whole == 2
    loc = _tokens(pool.layout)
    pool.set_kv_buffer(1, loc, SyntheticLayer(pool.layout, seed, 1, loc).kv_rows(pool.layout))  # kv of 1 dropped
    pool.prefetch(2)  # the latent into the slot layer 1's left, the indexer into layer 0's
    assert pool.whole_layer_broadcasts - whole == 2
    for layer in (2, 1, 0):
        check_layer(pool, layer, seed)
