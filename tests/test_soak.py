"""Soak: 2,000 fetches of random sizes with random aborts against CP=4, bounded in time.

At the end nothing is pinned, no page is in use, registered memory and open peer
connections have not grown, and every completed fetch was verified byte for byte.
"""

import asyncio
import random

import pytest

from transfer.app.router import Deployment, DeploymentSpec

REQUESTS, CONCURRENCY, WALL_LIMIT_S = 2000, 16, 600
SPEC = DeploymentSpec(engines=(4,), decoders=1, preset="tiny", prefill_pool_tokens=16384, decode_pool_tokens=16384)


async def _stats(d):
    return await d.stats()


@pytest.mark.asyncio
@pytest.mark.soak
async def test_soak_2000_fetches_with_random_aborts():
    rng = random.Random(2026)
    async with Deployment(SPEC) as d:
        assert (await d.submit(64)).ok  # connections up before the baseline is taken
        before = await _stats(d)
        gate = asyncio.Semaphore(CONCURRENCY)
        aborted = 0

        async def one(i: int):
            nonlocal aborted
            n = rng.randint(1, 600)
            async with gate:
                task = asyncio.create_task(d.submit(n, prefix_id=i % 3 if i % 5 == 0 else -1, prefix_tokens=32))
                if rng.random() < 0.1:
                    await asyncio.sleep(rng.random() * 0.05)
                    task.cancel()
                try:
                    return n, await task
                except asyncio.CancelledError:
                    aborted += 1
                    return n, None

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(REQUESTS))), WALL_LIMIT_S)
        done = [(n, o) for n, o in results if o is not None]
        assert [o.error for _, o in done if not o.ok] == []
        for n, o in done:
            assert o.decode.verified_bytes == n * 7 * (48 + 132)
        assert len(done) + aborted == REQUESTS and aborted > 50

        for _ in range(100):  # frees are asynchronous: let the last releases land
            after = await _stats(d)
            if all(s["pinned_pages"] == 0 and s["live_rooms"] == 0 for s in after["prefill"]):
                break
            await asyncio.sleep(0.1)
        assert all(s["pinned_pages"] == 0 and s["live_rooms"] == 0 for s in after["prefill"]), after
        assert [s["registered_bytes"] for s in after["prefill"]] == [s["registered_bytes"] for s in before["prefill"]]
        dec_before, dec_after = before["decode"][0], after["decode"][0]
        assert dec_after["pages_in_use"] == 0 and dec_after["peers"] == dec_before["peers"] == 4
        # A cancel may land after the decode finished its fetch: the router then reports the
        # request aborted while the decode counted a fetch. Every fetch the decode saw ended
        # one way or the other, and only aborts failed.
        fetched = dec_after["fetches"] - dec_before["fetches"]
        failed = dec_after["failures"] - dec_before["failures"]
        assert len(done) <= fetched <= len(done) + aborted
        assert failed <= aborted and fetched + failed <= REQUESTS
