"""A prefill engine that loses a rank mid-run, with real processes (issue 29 §8): only the
requests in flight on it fail, typed; the router sends the rest elsewhere or holds them
until the supervisor has restarted the engine whole; restarts are bounded."""

import asyncio
import os
import signal
import time

from transfer.app.router import Deployment, DeploymentSpec, RequestOutcome
from transfer.app.supervisor import EngineState

BYTES_PER_TOKEN = 7 * (48 + 132)  # tiny: 7 layers of latent KV and indexer


def _spec(engines: tuple[int, ...], max_restarts: int) -> DeploymentSpec:
    return DeploymentSpec(
        engines=engines,
        decoders=1,
        preset="tiny",
        prefill_pool_tokens=4096,
        decode_pool_tokens=4096,
        layer_delay=0.005,
        start_timeout=180,
        max_restarts=max_restarts,
        restart_backoff=0.2,
    )


def _kill(d: Deployment, name: str) -> int:
    """SIGKILL one rank; returns how many requests were in flight on its engine just then
    (read and killed with no await between, so no request slips in)."""
    in_flight = d.router.in_flight[name.split("-")[0]]
    child = next(c for c in d.launcher.children if c.name == name)
    os.kill(child.pid, signal.SIGKILL)
    child.popen.wait(timeout=10)
    return in_flight


async def _run_with_kill(
    d: Deployment, victim: str, requests: int, after: int
) -> tuple[list[tuple[RequestOutcome, float]], int, float]:
    """`requests` requests, 4 at a time; `victim` killed once `after` of them have ended.
    Returns each outcome with when it ended, the victim engine's requests in flight at the
    kill, and when the kill was."""
    sizes = [1 + (i * 37) % 400 for i in range(requests)]
    gate, ended = asyncio.Semaphore(4), []

    async def one(n: int) -> tuple[RequestOutcome, float]:
        async with gate:
            out = await d.submit(n, prefix_id=n % 3 if n % 4 == 0 else -1, prefix_tokens=64)
        ended.append(out)
        return out, time.monotonic()

    tasks = [asyncio.create_task(one(n)) for n in sizes]
    while len(ended) < after:
        await asyncio.sleep(0.002)
    in_flight, killed_at = _kill(d, victim), time.monotonic()
    return list(await asyncio.gather(*tasks)), in_flight, killed_at


def _check(outcomes: list[tuple[RequestOutcome, float]], in_flight: int, engine_id: str) -> list[RequestOutcome]:
    """Only requests in flight on the dead engine failed, each a typed loss of that engine;
    every other request's KV arrived whole. Returns the failures."""
    failed = [o for o, _ in outcomes if not o.ok]
    assert len(failed) <= in_flight, [o.error for o in failed]
    for o in failed:
        assert o.engine_id == engine_id and o.engine_lost and o.cause == "PeerLostError", o.error
    for o, _ in outcomes:
        assert not o.ok or o.decode.verified_bytes == o.num_tokens * BYTES_PER_TOKEN
    return failed


async def _back_up(d: Deployment, engine_id: str, timeout: float = 60) -> float:
    """Waits for the engine to serve again; returns when it did (time.monotonic)."""
    engine = next(e for e in d.engines if e.engine_id == engine_id)
    end = time.monotonic() + timeout
    while engine.state is not EngineState.UP:
        assert time.monotonic() < end, f"{engine_id} not back within {timeout}s: {[x.describe() for x in d.deaths]}"
        await asyncio.sleep(0.05)
    death = d.last_death(engine_id)
    assert death is not None and death.back_after is not None
    return death.at + death.back_after


async def test_a_rank_killed_mid_run_fails_only_the_requests_in_flight_on_its_engine():
    async with Deployment(_spec((2, 2), max_restarts=2)) as d:
        old_controls = list(d.engines[0].controls)
        outcomes, in_flight, killed_at = await _run_with_kill(d, "prefill0-cp1", requests=150, after=30)
        failed = _check(outcomes, in_flight, "prefill0")
        back_at = await _back_up(d, "prefill0")
        # While prefill0 was down, new requests went to prefill1 at once: what ended on
        # prefill0 then was in flight at the kill (a decode may finish before it is noticed).
        during = [o for o, t in outcomes if killed_at < t < back_at]
        assert sum(1 for o in during if o.engine_id == "prefill0") <= in_flight
        assert sum(1 for o in during if o.engine_id == "prefill1" and o.ok) >= 10
        assert len(failed) + sum(1 for o, _ in outcomes if o.ok) == 150
        # The whole CP group came back: new processes, registered under new incarnations.
        engine = d.engines[0]
        assert engine.restarts == 1 and len(set(engine.incarnations)) == 2
        assert not set(engine.controls) & set(old_controls)
        assert {c.name for c in d.launcher.children if c.alive()} >= {"prefill0-cp0", "prefill0-cp1"}
        again = await asyncio.gather(*(d.submit(50 + i) for i in range(8)))
        assert all(o.ok for o in again) and {o.engine_id for o in again} == {"prefill0", "prefill1"}
        assert d.dead_children() == []


async def test_with_one_engine_service_resumes_after_the_restart_and_restarts_are_bounded():
    async with Deployment(_spec((2,), max_restarts=1)) as d:
        outcomes, in_flight, killed_at = await _run_with_kill(d, "prefill0-cp1", requests=40, after=10)
        failed = _check(outcomes, in_flight, "prefill0")
        back_at = await _back_up(d, "prefill0")
        # Requests that arrived while the only engine was down waited for it, then succeeded.
        assert sum(1 for o, _ in outcomes if o.ok) == 40 - len(failed)
        assert any(o.ok for o, t in outcomes if t > back_at)
        assert "serving again" in d.deaths[0].describe()
        # Its one restart is spent: the next death leaves it down, and requests fail fast.
        _kill(d, "prefill0-cp0")
        t0 = time.monotonic()
        out = await d.submit(100)
        assert not out.ok and out.cause == "PeerLostError" and "no prefill engine to route to" in out.error
        assert time.monotonic() - t0 < 2.0
        assert d.engines[0].state is EngineState.DOWN and d.engines[0].restarts == 1
        assert "prefill0-cp0 (exit -9); down" in d.deaths[-1].describe()


async def test_without_restarts_a_dead_engine_stays_down_and_is_routed_around():
    """The library default (max_restarts=0): callers restart by hand; the router still passes
    the dead engine over, and a request pinned to it fails fast, naming the rank."""
    async with Deployment(_spec((1, 1), max_restarts=0)) as d:
        _kill(d, "prefill1-cp0")
        pinned = await asyncio.wait_for(d.submit(30, engine_id="prefill1"), 5)
        assert not pinned.ok and "prefill1-cp0 exited" in pinned.error
        outs = await asyncio.gather(*(d.submit(30 + i) for i in range(6)))
        assert all(o.ok and o.engine_id == "prefill0" for o in outs), [o.error for o in outs]
        assert d.engines[1].state is EngineState.DOWN and not d.engines[1].restarts
        await d.restart_engine("prefill1")  # by hand, as the fault tests do
        assert d.engines[1].state is EngineState.UP and (await d.submit(30, engine_id="prefill1")).ok
