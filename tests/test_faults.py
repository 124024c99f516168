"""Faults injected for real: SIGKILLed owners and decodes, a restarted registry, aborts,
deadlines. Nothing may hang, leak pinned pages, or hand a decode unverified KV."""

import asyncio
import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import pytest_asyncio

from pdkv import DeadlineExceeded, DSAKVPool, tiny
from transfer.app.router import Deployment, DeploymentSpec, Router
from transfer.deadline import Deadline
from transfer.decode import DecodeFetcher
from transfer.timeouts import Timeouts

pytestmark = pytest.mark.asyncio(loop_scope="module")

LEASE, PIN = 2.0, 3.0
SPEC = DeploymentSpec(  # overlap: decodes read while the prefill writes, so a kill lands mid-fetch
    engines=(3, 2),
    decoders=2,
    overlap=True,
    preset="tiny",
    prefill_pool_tokens=8192,
    decode_pool_tokens=8192,
    layer_delay=0.05,
    lease=LEASE,
    pin=PIN,
    start_timeout=180,
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def d():
    async with Deployment(SPEC) as dep:
        yield dep
    # decode0 lost peers (killed owners, restarts) and must still exit cleanly.
    assert _child(dep, "decode0").popen.returncode == 0


def _child(d, name):
    return next(c for c in d.launcher.children if c.name == name)


def _kill(d, name) -> None:
    child = _child(d, name)
    os.kill(child.pid, signal.SIGKILL)
    child.popen.wait(timeout=10)


async def _eventually(check, timeout: float, what: str):
    end = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.1)


async def _no_pins(d) -> bool:
    live = [c for e in d.engines for c in e.controls if _alive_url(d, c)]
    stats = await asyncio.gather(*(d.client.get_json(f"{c}/v1/stats") for c in live))
    return all(s["pinned_pages"] == 0 for s in stats)


def _alive_url(d, control_url) -> bool:
    names = {c.name for c in d.launcher.children if c.alive()}
    for e in d.engines:
        if control_url in e.controls:
            return f"{e.engine_id}-cp{e.controls.index(control_url)}" in names
    return False


async def test_owner_killed_during_fetch_fails_fast_naming_it(d):
    assert (await d.submit(200, engine_id="prefill0", decoder=0)).ok  # decode0 caches prefill0
    victim = asyncio.create_task(d.submit(3000, engine_id="prefill0", decoder=0))
    healthy = asyncio.create_task(d.submit(3000, engine_id="prefill1", decoder=0))
    await asyncio.sleep(0.2)  # 7 layers x 50 ms: mid-prefill, mid-fetch
    t0 = time.monotonic()
    _kill(d, "prefill0-cp1")
    out = await victim
    elapsed = time.monotonic() - t0
    assert not out.ok and "PeerLostError" in out.error and "cp rank 1" in out.error, out.error
    assert elapsed < 5.0
    assert (await healthy).ok  # another engine, same decode: unharmed
    stats = await d.client.get_json(f"{d.decoders[0].url}/v1/stats")
    assert stats["pages_in_use"] == 0  # the failed fetch's pages went back unreported

    async def engine_gone():
        listing = await d.client.get_json(f"{d.registry_url}/v1/engines")
        return "prefill0" not in listing

    # The CP group dies as a whole; its ranks' leases lapse (or they deregister).
    await _eventually(engine_gone, LEASE + 5, "registry dropped the dead engine")


async def test_restarted_engine_serves_with_new_keys(d):
    out = await d.submit(100, engine_id="prefill1", decoder=0)  # decode0 holds prefill1's ranks, run alone too
    assert out.ok, out.error
    await d.restart_engine("prefill0")
    for dec in (0, 1):  # decode0 dropped its stale peers; decode1 never knew the engine
        out = await d.submit(300, engine_id="prefill0", decoder=dec)
        assert out.ok, out.error
    peers = (await d.client.get_json(f"{d.decoders[0].url}/v1/stats"))["peers"]
    assert peers == 3 + 2  # the new prefill0 ranks and prefill1's: no stale peer kept


async def test_owner_killed_before_fetch_fails_fast(d):
    assert (await d.submit(100, engine_id="prefill1", decoder=1)).ok
    _kill(d, "prefill1-cp0")
    t0 = time.monotonic()
    out = await d.submit(100, engine_id="prefill1", decoder=1)
    assert not out.ok and "PeerLostError" in out.error and time.monotonic() - t0 < 5.0
    await d.restart_engine("prefill1")
    assert (await d.submit(100, engine_id="prefill1", decoder=1)).ok


async def test_decode_killed_mid_fetch_pins_expire_and_prefill_serves_on(d):
    task = asyncio.create_task(d.submit(3000, engine_id="prefill0", decoder=1))
    await asyncio.sleep(0.25)
    _kill(d, "decode1")
    out = await task
    assert not out.ok
    await _eventually(lambda: _no_pins(d), PIN + 5, "pinned pages freed at the pin deadline")
    stats = await asyncio.gather(*(d.client.get_json(f"{c}/v1/stats") for c in d.engines[0].controls))
    assert sum(s["aborted"] + s["expired"] for s in stats) >= 1
    assert (await d.submit(300, engine_id="prefill0", decoder=0)).ok


async def test_registry_restart_ranks_reregister_and_lookups_recover(d):
    await d.restart_registry()
    # decode0 has both engines cached: it needs no registry at all.
    assert (await d.submit(100, engine_id="prefill1", decoder=0)).ok

    async def both_back():
        listing = await d.client.get_json(f"{d.registry_url}/v1/engines")
        return all(listing.get(e, {}).get("registered") == n for e, n in (("prefill0", 3), ("prefill1", 2)))

    await _eventually(both_back, LEASE + 5, "ranks re-registered with the new registry")
    pool = DSAKVPool(tiny(size=512))  # a fresh decode: a real lookup against the new registry
    async with DecodeFetcher(pool, d.registry_url, ucx_workers=1) as fetcher:
        with pytest.raises(DeadlineExceeded):  # the engine resolves; the room never comes
            await fetcher.fetch("prefill0", 424242, np.arange(1, 5), timeout=1.0)
        assert fetcher.transport.peer_count == 3


async def test_aborts_before_during_and_after_leave_nothing_pinned(d):
    for delay in (0.0, 0.15, None):
        task = asyncio.create_task(d.submit(1500, engine_id="prefill1", decoder=0))
        if delay is None:
            out = await task
            assert out.ok
            await d.abort(d.engines[1], d.decoders[0], out.room)  # too late: a no-op
            continue
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await _eventually(lambda: _no_pins(d), 5, "no pinned pages after aborts")
    assert (await d.client.get_json(f"{d.decoders[0].url}/v1/stats"))["pages_in_use"] == 0


async def test_expired_fetch_fails_cleanly_and_pins_nothing(d):
    pool = DSAKVPool(tiny(size=512))
    async with DecodeFetcher(pool, d.registry_url, ucx_workers=1, timeouts=Timeouts(poll=0.2)) as fetcher:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await fetcher.fetch("prefill1", 777, np.arange(1, 5), timeout=0.5)
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()  # the same budget as an instant: what a request carries end to end
        with pytest.raises(DeadlineExceeded):
            await fetcher.fetch("prefill1", 778, np.arange(1, 5), deadline=Deadline(t0 + 0.5))
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(DeadlineExceeded):  # already past: fails before anything is asked
            await fetcher.fetch("prefill1", 779, np.arange(1, 5), deadline=Deadline(t0 - 1))
        with pytest.raises(ValueError):
            await fetcher.fetch("prefill1", 780, np.arange(1, 5), deadline=Deadline(t0 + 5), timeout=5)
    assert await _no_pins(d)


async def test_the_request_deadline_crosses_from_the_router_to_both_workers(d):
    """A request whose end-to-end budget is shorter than its prefill fails with the workers'
    own DeadlineExceeded, not a client timeout, and pins nothing."""
    router = Router(d, Timeouts(fetch=0.15))  # the prefill alone takes 7 x 50 ms
    try:
        t0 = time.monotonic()
        out = await router.submit_to(d.engines[1], d.decoders[0], 6000)  # 7 layers of 50 ms and more
        assert not out.ok and "DeadlineExceeded" in out.error, out.error
        assert time.monotonic() - t0 < 0.15 + Timeouts().request
    finally:
        await router.aclose()
    assert await _eventually(lambda: _no_pins(d), 10, "pins released after a deadline")


async def test_with_tickets_a_rank_killed_mid_prefill_fails_the_request_at_once(d):
    """Ticket mode: the decode starts only after the prefill; the router notices the exit."""
    d.spec = dataclasses.replace(d.spec, overlap=False)
    try:
        victim = asyncio.create_task(d.submit(3000, engine_id="prefill1", decoder=0))
        await asyncio.sleep(0.15)  # 7 layers x 50 ms: mid-prefill
        t0 = time.monotonic()
        _kill(d, "prefill1-cp0")
        out = await victim
        assert not out.ok and "PeerLostError" in out.error and "prefill1-cp0" in out.error, out.error
        assert time.monotonic() - t0 < 2.0  # not the CP group's collective timeout
    finally:
        d.spec = dataclasses.replace(d.spec, overlap=True)
    await d.restart_engine("prefill1")
    assert (await d.submit(300, engine_id="prefill1", decoder=0)).ok
