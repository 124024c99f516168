"""A prefill exporter registers and publishes exactly its owned KV buffers."""

from pdkv import DSAKVPool, tiny
from transfer.bootstrap import RegistryServer
from transfer.metadata import BufferKind
from transfer.prefill import PrefillExporter


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
            assert exporter.engine.local_regions.total == sum(n for _, n in owned)
            for b in d.buffers:
                want = layout.kv_page_bytes if b.kind is BufferKind.LATENT else layout.index_page_bytes
                assert b.item_len == want and b.num_items == layout.num_pages
            assert registry.registry.summary() == {"e0": {"registered": 1, "cp_size": 3}}
        assert registry.registry.summary() == {}  # it left the registry on close
    finally:
        await registry.aclose()
