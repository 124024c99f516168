import asyncio
import time

import numpy as np
import pytest

from pdkv import PageRangeError, PdkvError, UnknownRoomError
from transfer.metadata import RoomStatus
from transfer.rooms import RoomTable


def table(pin=60.0):
    freed = []
    t = RoomTable(range(3, 7), num_pages=32, pin_seconds=pin, on_free=lambda room, pages: freed.append((room, pages.tolist())))
    return t, freed


async def test_release_by_every_consumer_frees_once():
    t, freed = table()
    t.publish(1, np.array([4, 5, 9]), consumers=2)
    assert t.pinned_pages == 3
    t.mark_ready(1, 7)
    assert t.state(1).status is RoomStatus.READY
    assert t.release(1, "a").status is RoomStatus.READY
    assert t.release(1, "a").status is RoomStatus.READY  # idempotent per consumer
    assert t.release(1, "b").status is RoomStatus.RELEASED
    assert freed == [(1, [4, 5, 9])] and t.pinned_pages == 0
    assert t.release(1, "b").status is RoomStatus.RELEASED


async def test_aborted_or_expired_rooms_refuse_release():
    t, freed = table(pin=0.0)
    t.publish(2, np.array([1]))
    assert t.expire(time.monotonic() + 1) == [2]
    with pytest.raises(UnknownRoomError, match="aborted"):
        t.release(2, "a")
    t.publish(3, np.array([2]))
    assert t.abort(3) and t.counters.aborted == 1 and t.counters.expired == 1
    assert len(freed) == 2
    with pytest.raises(PdkvError):
        t.publish(3, np.array([2]))


async def test_wait_returns_when_layers_become_ready():
    t, _ = table()
    waiter = asyncio.create_task(t.wait(5, after=3, timeout=5))
    await asyncio.sleep(0.01)
    t.publish(5, np.array([1, 2]))
    t.mark_ready(5, 4)
    state = await asyncio.wait_for(waiter, 1)
    assert state.ready_upto == 4 and state.src_pages == [1, 2]
    assert (await t.wait(5, after=4, timeout=0.05)).ready_upto == 4  # times out, still answers
    assert (await t.wait(99, after=3, timeout=0.01)).status is RoomStatus.UNKNOWN


async def test_bad_source_pages_refused():
    t, _ = table()
    with pytest.raises(PageRangeError):
        t.publish(1, np.array([32]))
