"""Buffers pdkv does not own (an engine's tensor per layer, handed over by address, as
SGLang's `KVArgs` carries them): exported by one process and read into another's, in place."""

import asyncio
import multiprocessing as mp

import numpy as np
import pytest
import torch

from pdkv import DSAKVPool, IncompatibleLayoutError, dsa_v32
from pdkv.errors import LayoutError
from pdkv.layout import BufferKind
from tests import children
from transfer.decode import DecodeFetcher
from transfer.engine_kv import EngineKV, buffer_infos
from transfer.metadata import OwnerPin, RoomTicket, decode, encode
from transfer.registry.server import RegistryServer

LAYERS, PAGE, PAGES = 5, 64, 40
KV_ITEM, INDEX_ITEM = 656 * PAGE, 132 * PAGE  # DeepSeek-V3.2's page of latent and of indexer


def _engine_tensors(
    items: tuple[int, int], seed: int, device: str = "cpu"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A tensor per layer and kind, allocated apart (interleaved with others that are
    dropped), as an engine's allocator leaves them: no slab, no order."""
    kv, index, spacers = [], [], []
    for layer in range(LAYERS):
        spacers.append(torch.empty(4096, dtype=torch.uint8, device=device))
        kv.append(_pattern((PAGES, items[0]), seed + 2 * layer).to(device))
        spacers.append(torch.empty(4096, dtype=torch.uint8, device=device))
        index.append(_pattern((PAGES, items[1]), seed + 2 * layer + 1).to(device))
    return kv, index


def _pattern(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8))


def _engine_kv(kv: list[torch.Tensor], index: list[torch.Tensor], page: int = PAGE) -> EngineKV:
    """`EngineKV` over the tensors, through their addresses only, as an engine hands them."""
    layers = range(LAYERS)
    return EngineKV(
        buffer_infos(layers, [t.data_ptr() for t in kv], [t.nbytes for t in kv], [t.shape[1] for t in kv]),
        buffer_infos(layers, [t.data_ptr() for t in index], [t.nbytes for t in index], [t.shape[1] for t in index]),
        page_size=page,
        layer_num=LAYERS,
        device=kv[0].device,
    )


def test_an_engines_buffers_take_the_layout_their_bytes_describe():
    pool = DSAKVPool(dsa_v32(size=(PAGES - 1) * PAGE, layer_num=LAYERS))
    latent, index = pool.infos(BufferKind.LATENT), pool.infos(BufferKind.INDEX)
    seen = EngineKV(latent, index, page_size=PAGE, layer_num=LAYERS)
    assert seen.layout.fingerprint == pool.layout.fingerprint  # the same bytes: one fingerprint
    assert seen.kv_buffer[2].data_ptr() == pool.kv_buffer[2].data_ptr()  # a view, not a copy
    seen.kv_buffer[2][3, 7] = 201
    assert pool.kv_buffer[2].view(torch.uint8).view(PAGES, -1)[3, 7] == 201


def test_buffers_that_do_not_make_a_pool_are_refused():
    kv, index = _engine_tensors((KV_ITEM, INDEX_ITEM), 0)
    good = _engine_kv(kv, index)
    latent, idx = good.infos(BufferKind.LATENT), good.infos(BufferKind.INDEX)
    with pytest.raises(LayoutError, match="contiguous"):
        EngineKV(
            buffer_infos([0, 2], latent.data_ptrs[:2], latent.data_lens[:2], latent.item_lens[:2]),
            buffer_infos([0, 2], idx.data_ptrs[:2], idx.data_lens[:2], idx.item_lens[:2]),
            page_size=PAGE,
            layer_num=LAYERS,
        )
    with pytest.raises(LayoutError, match="differ between layers"):
        odd = buffer_infos(range(LAYERS), latent.data_ptrs, latent.data_lens, (KV_ITEM,) * 4 + (KV_ITEM // 2,))
        EngineKV(odd, idx, page_size=PAGE, layer_num=LAYERS)
    with pytest.raises(LayoutError, match="pages of"):
        EngineKV(latent, idx, page_size=PAGE * 3, layer_num=LAYERS)
    with pytest.raises(LayoutError, match="whole pages"):
        short = buffer_infos(range(LAYERS), latent.data_ptrs, [n - 1 for n in latent.data_lens], latent.item_lens)
        EngineKV(short, idx, page_size=PAGE, layer_num=LAYERS)
    with pytest.raises(LayoutError, match="layer ids"):
        buffer_infos(range(LAYERS), latent.data_ptrs[:2], latent.data_lens, latent.item_lens)


# ---- one process exports an engine's tensors, another reads them into its own -------------------
def _exporter_process(
    registry_url: str, rooms: dict[int, list[int]], device: str, out: mp.Queue, stop: mp.Event
) -> None:
    from transfer.prefill import PrefillExporter

    async def run() -> None:
        kv, index = _engine_tensors((KV_ITEM, INDEX_ITEM), 1000, device)
        async with PrefillExporter(_engine_kv(kv, index), "engine0", 0, 1, registry_url) as exporter:
            for room, pages in rooms.items():
                exporter.publish_room(room, np.array(pages))
                exporter.mark_ready(room, LAYERS)
            pin = await exporter.pin(max(rooms), timeout=5)
            out.put(encode(pin))
            while not stop.is_set():
                await asyncio.sleep(0.02)

    asyncio.run(run())


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
async def test_a_room_moves_between_engine_tensors_of_two_processes_byte_exact(device):
    registry = RegistryServer()
    url = await registry.start()
    ctx = children.context()
    out, stop = ctx.Queue(), ctx.Event()
    rooms = {1: [3, 17, 4, 39, 5], 2: [30, 31, 32, 2]}
    child = ctx.Process(target=_exporter_process, args=(url, rooms, device, out, stop), daemon=True)
    child.start()
    try:
        pin = decode(await asyncio.to_thread(out.get, True, 60), OwnerPin)
        mine, theirs = (
            _engine_tensors((KV_ITEM, INDEX_ITEM), 7, device),
            _engine_tensors((KV_ITEM, INDEX_ITEM), 1000, device),
        )
        async with DecodeFetcher(_engine_kv(*mine), url, ucx_workers=1) as fetcher:
            by_claims = [20, 21, 9, 1, 38]
            result = await fetcher.fetch("engine0", 1, by_claims, timeout=30)
            assert result.nbytes == len(by_claims) * LAYERS * (KV_ITEM + INDEX_ITEM)
            ticket = RoomTicket(engine_id="engine0", room=2, src_pages=rooms[2], pins=[pin])
            by_ticket = [11, 12, 13, 14]
            assert (await fetcher.fetch("engine0", 2, by_ticket, ticket=ticket, timeout=30)).control_messages == 0
            for room, dst in ((1, by_claims), (2, by_ticket)):
                for layer in range(LAYERS):
                    for kind in (0, 1):
                        got, want = mine[kind][layer][dst], theirs[kind][layer][rooms[room]]
                        assert torch.equal(got, want), (room, layer, kind)
            untouched = sorted(set(range(PAGES)) - set(by_claims) - set(by_ticket))
            fresh = _engine_tensors((KV_ITEM, INDEX_ITEM), 7, device)
            for kind in (0, 1):  # no byte outside the destination pages moved
                assert all(torch.equal(mine[kind][x][untouched], fresh[kind][x][untouched]) for x in range(LAYERS))

        other = _engine_tensors((KV_ITEM // 2, INDEX_ITEM // 2), 7, device)  # pages of 32 tokens: other bytes
        async with DecodeFetcher(_engine_kv(*other, page=PAGE // 2), url, ucx_workers=1) as fetcher:
            with pytest.raises(IncompatibleLayoutError):
                await fetcher.fetch("engine0", 1, [1, 2, 3, 4, 5], timeout=10)
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
        await registry.aclose()
