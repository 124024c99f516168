"""A prefill exporter registers and publishes exactly its owned KV buffers; the engine
refuses any address outside what was registered before a READ is issued."""

import aiohttp
import numpy as np
import pytest
import torch

from pdkv import DSAKVPool, TransferError, tiny
from pdkv.buffers import LAYER_ALIGN
from pdkv.layout import BufferKind
from transfer.deadline import Deadline
from transfer.lanes.ucx.plan import ReadPlan
from transfer.lanes.ucx.transport import UcxTransport
from transfer.prefill import PrefillExporter
from transfer.registry.server import RegistryServer


async def test_only_owned_layer_buffers_are_registered_and_described():
    layout = tiny(layer_num=7)
    pool = DSAKVPool(layout, owned=range(3, 5))  # rank 1 of 3
    registry = RegistryServer()
    url = await registry.start()
    try:
        async with PrefillExporter(pool, "e0", 1, 3, url) as exporter:
            d = exporter.descriptor
            assert (d.layer_start, d.layer_end) == (3, 5)
            described = sorted((b.addr, b.length) for b in d.buffers)
            owned = sorted(
                (t.data_ptr(), t.nbytes) for layer in (3, 4) for t in (pool.kv_buffer[layer], pool.index_buffer[layer])
            )
            assert described == owned
            # and nothing else but the alignment padding between them (under LAYER_ALIGN after
            # each buffer) and the pin table, whose words decodes READ after their data
            padding = pool.slab.nbytes - sum(n for _, n in owned)
            assert 0 <= padding < len(owned) * LAYER_ALIGN
            assert exporter.transport.local_regions.total == pool.slab.nbytes + d.pins.nbytes + 8  # + its tag
            for b in d.buffers:
                want = layout.kv_page_bytes if b.kind is BufferKind.LATENT else layout.index_page_bytes
                assert b.item_len == want and b.num_items == layout.num_pages
            assert registry.registry.summary() == {"e0": {"registered": 1, "cp_size": 3}}
        assert registry.registry.summary() == {}  # it left the registry on close
    finally:
        await registry.aclose()


async def test_reads_outside_registered_regions_are_refused_before_any_read():
    layout = tiny(layer_num=3)
    src_pool, dst_pool = DSAKVPool(layout), DSAKVPool(layout)
    src_bytes = src_pool.slab.view(-1)
    src_bytes.copy_(torch.arange(src_bytes.numel()) % 251)
    registry = RegistryServer()
    url = await registry.start()
    reader = UcxTransport("reader-test", workers=1)
    try:
        reader.register([dst_pool.slab])
        async with PrefillExporter(src_pool, "e1", 0, 1, url) as exporter:
            d = exporter.descriptor
            await reader.add_peer(d.agent_name, d.agent_metadata, [(b.addr, b.length) for b in d.buffers])
            base, n = src_pool.slab.data_ptr(), 4096
            ok = ReadPlan(np.array([[dst_pool.slab.data_ptr(), n, 0]]), np.array([[base, n, 0]]), n)
            stats = await reader.read(d.agent_name, ok, Deadline.after(10))
            assert stats.nbytes == n
            assert torch.equal(dst_pool.slab.view(-1)[:n], src_pool.slab.view(-1)[:n])
            dst_pool.slab.zero_()
            # Outside the exported slab: below it, above it, and straddling its end.
            low, top_len = src_pool.slab.data_ptr(), src_pool.slab.nbytes
            for remote in ([low + top_len, n, 0], [low - n, n, 0], [low + top_len - 8, 64, 0]):
                bad = ReadPlan(np.array([[dst_pool.slab.data_ptr(), n, 0]]), np.array([remote]), n)
                with pytest.raises(TransferError, match="outside"):
                    await reader.read(d.agent_name, bad, Deadline.after(10))
            local_bad = ReadPlan(np.array([[dst_pool.slab.data_ptr() - n, n, 0]]), np.array([[base, n, 0]]), n)
            with pytest.raises(TransferError, match="outside"):
                await reader.read(d.agent_name, local_bad, Deadline.after(10))
            assert int(dst_pool.slab.sum()) == 0  # nothing was read
    finally:
        await reader.aclose()
        await registry.aclose()


async def test_control_endpoints_refuse_garbage_and_keep_serving():
    pool = DSAKVPool(tiny(layer_num=3))
    registry = RegistryServer()
    url = await registry.start()
    try:
        async with PrefillExporter(pool, "e2", 0, 1, url) as exporter, aiohttp.ClientSession() as http:
            base = exporter.control_url
            for method, path, body in (
                ("GET", "/v1/rooms/abc", None),
                ("GET", "/v1/rooms/-5", None),
                ("GET", f"/v1/rooms/{2**70}", None),
                ("POST", "/v1/rooms/1/release", b"\x92\x01"),
                ("POST", "/v1/rooms/1/release", b""),
            ):
                async with http.request(method, base + path, data=body) as resp:
                    assert resp.status in (400, 404), (path, resp.status)
            exporter.publish_room(9, np.array([1, 2]))
            exporter.mark_ready(9, 3)
            async with http.get(base + "/v1/rooms/9?after=-1") as resp:
                assert resp.status == 200
    finally:
        await registry.aclose()


async def test_readiness_is_pushed_on_a_stream_not_polled():
    """Layers become ready one by one, 50 ms apart: after the first fetch (whose stream was
    still opening) a fetch makes a claim and no long-poll, reading each layer as it comes (the
    last state names the pin: the read is proved by the pin word, released by notification)."""
    import asyncio

    from transfer.decode import DecodeFetcher

    layout = tiny(layer_num=4)
    src = DSAKVPool(layout)
    src.slab.view(-1).copy_(torch.arange(src.slab.nbytes) % 253)
    registry = RegistryServer()
    url = await registry.start()
    try:
        async with PrefillExporter(src, "e7", 0, 1, url) as exporter, DecodeFetcher(DSAKVPool(layout), url) as fetcher:
            for room in range(3):
                exporter.publish_room(room, np.array([4, 9, 2]))
                fetch = asyncio.create_task(fetcher.fetch("e7", room, [1, 2, 3], timeout=20))
                for layer in range(layout.layer_num):
                    await asyncio.sleep(0.05)
                    exporter.mark_ready(room, layer + 1)
                result = await fetch
                assert result.owners[0].reads >= 2  # read as layers came (one READ a layer, unless late)
                if room:
                    assert result.control_messages == 1  # a claim: readiness pushed, released by notification
            dst = fetcher.pool.kv_buffer[3].view(torch.uint8).reshape(layout.num_pages, -1)
            want = src.kv_buffer[3].view(torch.uint8).reshape(layout.num_pages, -1)
            assert torch.equal(dst[[1, 2, 3]], want[[4, 9, 2]])
    finally:
        await registry.aclose()


async def test_a_room_sent_by_chunks_is_read_chunk_by_chunk_as_they_come():
    """A chunked prefill: the room's pages arrive a chunk at a time, each chunk in every
    layer; the decode reads each chunk as it comes and ends with the last."""
    import asyncio

    from pdkv import InvalidPagesError
    from transfer.decode import DecodeFetcher

    layout = tiny(layer_num=3)
    src = DSAKVPool(layout)
    src.slab.view(-1).copy_(torch.arange(src.slab.nbytes) % 239)
    registry = RegistryServer()
    url = await registry.start()
    chunks = [np.array([5, 6]), np.array([11]), np.array([2, 30, 8])]
    dst_pages = [1, 2, 3, 4, 5, 6]
    try:
        async with PrefillExporter(src, "e8", 0, 1, url) as exporter, DecodeFetcher(DSAKVPool(layout), url) as fetcher:
            for room in range(2):
                exporter.publish_chunked(room, total_pages=6)
                fetch = asyncio.create_task(fetcher.fetch("e8", room, dst_pages, timeout=20))
                for i, chunk in enumerate(chunks):
                    await asyncio.sleep(0.05)
                    exporter.add_chunk(room, chunk, aux=b"first token %d" % room if i == len(chunks) - 1 else None)
                result = await fetch
                assert result.owners[0].reads >= 2  # chunk by chunk, as they came
                assert result.aux == b"first token %d" % room  # the engine's bytes came with the room
                if room:
                    assert result.control_messages == 1  # chunks' readiness pushed too
            dst = fetcher.pool
            want = np.concatenate(chunks)
            for layer in range(layout.layer_num):
                for a, b in (
                    (dst.kv_buffer[layer], src.kv_buffer[layer]),
                    (dst.index_buffer[layer], src.index_buffer[layer]),
                ):
                    got = a.view(torch.uint8).reshape(layout.num_pages, -1)[dst_pages]
                    assert torch.equal(got, b.view(torch.uint8).reshape(layout.num_pages, -1)[want])
            exporter.publish_chunked(9, total_pages=2)
            with pytest.raises(InvalidPagesError):
                exporter.add_chunk(9, np.array([3, 4, 5]))  # beyond its pages
            with pytest.raises(InvalidPagesError, match="last chunk"):
                exporter.add_chunk(9, np.array([3]), aux=b"early")  # aux before the room is complete
            exporter.add_chunk(9, np.array([3]))
            with pytest.raises(InvalidPagesError):
                exporter.add_chunk(9, np.array([3]))  # a page twice
    finally:
        await registry.aclose()
