"""Helpers shared by the tests that prefill rooms in a real deployment and fetch them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest_asyncio
import torch

from pdkv import DSAKVPool
from transfer.app.api import PrefillReply, PrefillRequest
from transfer.app.router import Deployment, DeploymentSpec
from transfer.app.synthetic import RequestContent, fragmented_page_order, request_seed


def module_deployment(spec: DeploymentSpec) -> Callable[..., Any]:
    """A module-scoped `deployment` fixture: `spec` deployed once for the module's tests."""

    @pytest_asyncio.fixture(loop_scope="module", scope="module")
    async def deployment() -> AsyncIterator[Deployment]:
        async with Deployment(spec) as d:
            yield d

    return deployment


async def prefill(deployment, engine, room: int, n: int, consumers: int = 1, ticket: bool = False) -> PrefillReply:  # type: ignore[no-untyped-def]
    """Have `engine` write `room` of `n` tokens (published for `consumers` claims); with
    `ticket`, the reply carries the room's ticket, which holds one of them."""
    req = PrefillRequest(room=room, num_tokens=n, consumers=consumers, ticket=ticket)
    return await deployment.client.request("POST", f"{engine.intake}/v1/prefill", PrefillReply, req)


def fragmented_pages(pool: DSAKVPool, n: int, seed: int) -> np.ndarray:
    """Destination pages for `n` tokens, drawn as a busy allocator would hand them out."""
    order = fragmented_page_order(np.arange(1, pool.layout.num_pages), np.random.default_rng(seed))
    return order[: -(-n // pool.layout.page_size)]


def kv_is_exact(pool: DSAKVPool, engine_id: str, room: int, n: int, pages: object) -> bool:
    """True if every layer of `pages` holds exactly what `engine_id` wrote for `room`."""
    content = RequestContent(request_seed(engine_id, room), n)
    return content.mismatched_layers(pool, torch.from_numpy(np.asarray(pages))) == []


def fetch_in_own_process(registry_url: str, engine_id: str, room: int, n: int, seed: int, out) -> None:  # type: ignore[no-untyped-def]
    """A decode of its own (run in a spawned process): fetch `room` by claims and report
    (freed, freed_on, bytes exact) on `out`."""
    import asyncio

    from pdkv import tiny
    from transfer.decode import DecodeFetcher

    async def run() -> None:
        pool = DSAKVPool(tiny(size=8192))
        async with DecodeFetcher(pool, registry_url, ucx_workers=1) as fetcher:
            pages = fragmented_pages(pool, n, seed)
            result = await fetcher.fetch(engine_id, room, pages)
            out.put((result.freed, result.freed_on, kv_is_exact(pool, engine_id, room, n, pages)))

    asyncio.run(run())


UNTOUCHED = 77  # what a decode's pool holds where no fetch wrote


async def one_of_two_reads(  # type: ignore[no-untyped-def]
    fetchers,
    pools: list[DSAKVPool],
    engine_id: str,
    room: int,
    n: int,
    seed: int,
    refused: tuple[type, ...],
    *beside: Awaitable[Any],
) -> None:
    """Two decodes fetch a single-consumer `room` by claims at once (which asks first by
    `seed`'s parity), with `beside` awaited meanwhile (its prefill): one reads it exact, the
    other is refused with one of `refused` and its pool holds none of the room."""
    from transfer.decode import FetchResult

    for pool in pools:
        pool.slab.fill_(UNTOUCHED)
    pages = [fragmented_pages(pool, n, 2 + seed) for pool in pools]
    order = [1, 0] if seed % 2 else [0, 1]  # either fetcher asks first
    tasks = {k: asyncio.create_task(fetchers[k].fetch(engine_id, room, pages[k], timeout=30)) for k in order}
    outcomes = await asyncio.gather(tasks[0], tasks[1], *beside, return_exceptions=True)
    won = [k for k in (0, 1) if isinstance(outcomes[k], FetchResult)]
    assert len(won) == 1, outcomes
    lost = 1 - won[0]
    assert isinstance(outcomes[lost], refused), outcomes
    assert kv_is_exact(pools[won[0]], engine_id, room, n, pages[won[0]])
    assert bool(torch.all(pools[lost].slab == UNTOUCHED)), f"room {room}: bytes landed in the loser's pool"
