"""Real processes over loopback UCX: a registry, prefill engines of CP 1-4, two decoders.

Every fetched byte of every layer is checked by the decode worker against the function
the prefill wrote it from; a mismatch fails the request, and these tests assert success.
"""

import asyncio

import numpy as np
import pytest
import pytest_asyncio
import torch

from pdkv import IncompatibleLayoutError, NotReadyError, UnknownRoomError, DSAKVPool, tiny
from pdkv.pages import fragmented_page_order
from pdkv.synthetic import RequestContent, request_seed
from transfer.api import DecodeReply, DecodeRequest, PrefillReply, PrefillRequest
from transfer.decode import DecodeFetcher
from transfer.router import Deployment, DeploymentSpec
from transfer.timeouts import Timeouts
from tests.test_metadata import rank_descriptor

pytestmark = pytest.mark.asyncio(loop_scope="module")

LAYERS = 7  # divides evenly by none of 2, 3, 4
SPEC = DeploymentSpec(
    engines=(1, 2, 3, 4), decoders=2, preset="tiny", prefill_pool_tokens=4096, decode_pool_tokens=8192,
    layer_delay=0.005, start_timeout=180,
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def deployment():
    async with Deployment(SPEC) as d:
        yield d
    codes = d.launcher.children
    assert all(c.popen.returncode == 0 for c in codes), {c.name: c.popen.returncode for c in codes}


def _ok(outcomes):
    bad = [o for o in outcomes if not o.ok]
    assert not bad, bad[:3]
    for o in outcomes:
        layout = tiny()
        assert o.decode.verified_bytes == o.num_tokens * LAYERS * (layout.kv_token_bytes + layout.index_token_bytes)


@pytest.mark.parametrize("engine", ["prefill0", "prefill1", "prefill2", "prefill3"])
async def test_each_cp_size_assembles_every_layer_byte_exact(deployment, engine):
    outcomes = [await deployment.submit(n, engine_id=engine) for n in (1, 4, 37, 129, 300)]
    _ok(outcomes)


async def test_32_rooms_concurrently_into_one_decode(deployment):
    _ok(await asyncio.gather(*(deployment.submit(10 + 5 * i, engine_id="prefill3", decoder=0) for i in range(32))))


async def test_two_decoders_fetch_from_one_engine(deployment):
    _ok(await asyncio.gather(*(deployment.submit(50 + i, engine_id="prefill2", decoder=i % 2) for i in range(12))))


async def test_release_frees_pages_everywhere_and_reuse_is_clean(deployment):
    # 60 rooms of 50 pages through a pool of 1023 pages: every page is reused many times.
    _ok([await deployment.submit(200, engine_id="prefill2") for _ in range(60)])
    stats = await deployment.stats()
    assert all(s["pinned_pages"] == 0 and s["live_rooms"] == 0 for s in stats["prefill"])
    assert all(s["pages_in_use"] == 0 for s in stats["decode"])
    assert sum(s["published"] for s in stats["prefill"]) == sum(s["released"] for s in stats["prefill"])


async def test_second_fetch_of_a_released_room_fails_clearly(deployment):
    done = await deployment.submit(20, engine_id="prefill1")
    assert done.ok
    again = DecodeRequest(engine_id="prefill1", room=done.room, num_tokens=20)
    with pytest.raises(UnknownRoomError, match="released"):
        await deployment.client.request("POST", f"{deployment.decoders[0].url}/v1/decode", DecodeReply, again)


async def test_one_owner_read_is_split_over_lanes_byte_exact(deployment):
    """More lanes than owners: each owner's READ is cut into pieces posted at once."""
    engine, room, n = deployment.engines[0], 4242, 1000  # CP=1: one owner, four lanes
    await deployment.client.request("POST", f"{engine.intake}/v1/prefill", PrefillReply, PrefillRequest(room=room, num_tokens=n))
    pool = DSAKVPool(tiny(size=8192))
    pages = fragmented_page_order(np.arange(pool.layout.num_pages), np.random.default_rng(3))[: -(-n // pool.layout.page_size)]
    async with DecodeFetcher(pool, deployment.registry_url, lanes=4) as fetcher:
        reads = []
        inner = fetcher.engine.read

        async def spy(*args, **kwargs):
            reads.append(await inner(*args, **kwargs))
            return reads[-1]

        fetcher.engine.read = spy
        result = await fetcher.fetch("prefill0", room, pages)
    assert max(x.pieces for x in reads) == 4 and result.nbytes == sum(x.nbytes for x in reads)
    content = RequestContent(request_seed("prefill0", room), n)
    assert content.mismatched_layers(pool, torch.from_numpy(pages)) == []


async def test_fetch_starts_before_the_last_layer_is_ready(deployment):
    out = await deployment.submit(64, engine_id="prefill0")
    assert out.ok
    assert out.decode.reads > 1  # one owner, 7 layers: several READ batches as layers came


async def test_decode_with_another_layout_is_refused(deployment):
    other = DSAKVPool(tiny(layer_num=LAYERS + 1, size=64))
    async with DecodeFetcher(other, deployment.registry_url, lanes=1) as fetcher:
        with pytest.raises(IncompatibleLayoutError, match="layer_num") as info:
            await fetcher.fetch("prefill1", 12345, np.arange(1, 3), timeout=10)
    assert "layer_num" in info.value.differing


async def test_engine_missing_an_owner_is_refused(deployment):
    for rank in (0, 1):  # rank 2 of 3 never registers
        await deployment.client.request(
            "PUT", f"{deployment.registry_url}/v1/engines/e0/ranks/{rank}", body=rank_descriptor(rank)
        )
    pool = DSAKVPool(tiny(layer_num=LAYERS, size=64))
    async with DecodeFetcher(pool, deployment.registry_url, lanes=1, timeouts=Timeouts(lookup=0.5)) as fetcher:
        with pytest.raises(NotReadyError, match=r"ranks \[2\] of 3"):
            await fetcher.fetch("e0", 1, np.arange(1, 3), timeout=5)
