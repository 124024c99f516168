"""A decode that holds a room's first pages (its radix-cache prefix) reads only the pages past
them, and its owners free the prefix as soon as every reader of the room has said where it
starts (`ReadFrom`, a UCX notification); the releases free exactly the rest, each page once.

Owners run in processes of their own (`tests.test_release_faults`' engine, with no faults),
the decode here, over real UCX; each owner reports every `on_free` in order.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from tests.test_release_faults import Engine, _exact, _fetcher, registry_url  # noqa: F401  (a fixture)


async def _frees(engine: Engine, room: int, count: int, within: float = 15.0) -> list[list[list[int]]]:
    """Each owner's frees of `room` (pages, in order) once each has made `count` (or at `within`)."""
    end = time.monotonic() + within
    while True:
        reports = await asyncio.to_thread(engine.report)
        frees = [[pages for r, pages, _ in report[0] if r == room] for report in reports]
        if all(len(f) >= count for f in frees) or time.monotonic() > end:
            return frees
        await asyncio.sleep(0.05)


async def test_two_readers_past_a_prefix_free_it_before_their_releases_and_each_page_once(registry_url):  # noqa: F811
    """Two readers of one room (a decode's attention-TP ranks) skip 3 and 2 pages: once both
    have said so, every owner frees the first 2 pages while the room is still held; the
    reader from page 2 releasing frees page 2 (the other reads from page 3); the last release
    the rest. Both reads byte-exact; nothing expired or aborted."""
    engine = await asyncio.to_thread(Engine, "pfx", registry_url, "")
    room, pages = 600, [5, 9, 2, 7, 11]
    try:
        async with _fetcher(registry_url) as fetcher:
            await asyncio.to_thread(engine.publish, room, pages, 2)
            one = await fetcher.claim(engine.name, room, readers=2)
            two = await fetcher.claim(engine.name, room, readers=2)
            await one.read(np.array([40, 41]), skip=3)
            assert await _frees(engine, room, 1, within=1.0) == [[], []]  # the other reader may read page 0
            await two.read(np.array([50, 51, 52]), skip=2)
            assert await _frees(engine, room, 1) == [[[5, 9]]] * 2  # ahead of any release
            for _, counters, _, _ in await asyncio.to_thread(engine.report):
                assert counters["live_rooms"] == 1 and counters["pinned_pages"] == 3
            assert await two.release() is False
            assert await _frees(engine, room, 2) == [[[5, 9], [2]]] * 2
            assert await one.release() is True
            assert await _frees(engine, room, 3) == [[[5, 9], [2], [7, 11]]] * 2
            assert _exact(fetcher.pool, [7, 11], [40, 41]) and _exact(fetcher.pool, [2, 7, 11], [50, 51, 52])
            for _, counters, _, _ in await asyncio.to_thread(engine.report):
                assert counters["pinned_pages"] == 0 and counters["released"] == 1
                assert counters["aborted"] == 0 and counters["expired"] == 0
    finally:
        await asyncio.to_thread(engine.close)


async def test_a_reader_with_no_prefix_keeps_the_whole_room_pinned_while_it_reads(registry_url):  # noqa: F811
    """One reader skips 2 pages and is done (read and released as SGLang's receiver reads,
    `read_once`: its start and its release are notifications); the other reads the whole room
    and still holds its claim: no page is freed ahead, and its release frees all of them."""
    engine = await asyncio.to_thread(Engine, "pfx0", registry_url, "")
    room, pages = 610, [3, 8, 6, 1]
    try:
        async with _fetcher(registry_url) as fetcher:
            await asyncio.to_thread(engine.publish, room, pages, 2)
            one = await fetcher.claim(engine.name, room, readers=2)
            two = await fetcher.claim(engine.name, room, readers=2)
            await two.read(np.array([70, 71, 72, 73]))
            await one.read_once(np.array([60, 61]), skip=2)
            assert await _frees(engine, room, 1, within=1.5) == [[], []]
            await two.release()
            assert await _frees(engine, room, 1) == [[pages]] * 2
            assert _exact(fetcher.pool, [6, 1], [60, 61]) and _exact(fetcher.pool, pages, [70, 71, 72, 73])
    finally:
        await asyncio.to_thread(engine.close)
