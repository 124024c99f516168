"""Prometheus metrics (`/metrics` on every service; `transfer.metrics`)."""

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pdkv import DSAKVPool, tiny
from transfer.bootstrap import RegistryServer
from transfer.prefill import PrefillExporter


async def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


async def test_an_exporters_rooms_are_scraped_without_the_secret():
    layout = tiny(layer_num=4)
    registry = RegistryServer(secret="s3cret")
    url = await registry.start()
    try:
        async with PrefillExporter(DSAKVPool(layout, owned=range(2, 4)), "e9", 1, 2, url, secret="s3cret") as exp:
            labels = (("cp_rank", "1"), ("engine", "e9"))
            before = await _scrape(exp.control_url)
            assert before[("pdkv_pinned_pages", labels)] == 0
            exp.publish_room(5, np.array([3, 4, 9]))
            after = await _scrape(exp.control_url)
            assert after[("pdkv_pinned_pages", labels)] == 3 and after[("pdkv_pinned_rooms", labels)] == 1
            assert after[("pdkv_rooms_published_total", labels)] == before[("pdkv_rooms_published_total", labels)] + 1
            exp.abort_room(5)
            assert (await _scrape(exp.control_url))[("pdkv_pinned_pages", labels)] == 0
        assert ("pdkv_pinned_pages", labels) not in await _scrape(url)  # closed: no longer reported
    finally:
        await registry.aclose()
