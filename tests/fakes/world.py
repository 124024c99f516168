"""A world of three owners over the fakes, and the helpers the protocol tests share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np

from tests.fakes.control import FakeClient, FakeFeed, FakeOwner
from tests.fakes.lane import FakeLane
from tests.fakes.memory import LAYERS, NUM_PAGES, PAGE, ROOM, SPANS
from tests.fakes.pins import FakePins, FakeSignals
from tests.fakes.timeline import Awaits, Timeline
from tests.wire_helpers import LAYOUT, rank_descriptor
from transfer.deadline import Deadline
from transfer.decode.claims import ClaimProtocol
from transfer.decode.owners import Owner
from transfer.decode.tasks import DecodeContext, Fetch
from transfer.decode.tickets import TicketProtocol
from transfer.metadata import OwnerPin, PinTable, RoomTicket
from transfer.timeouts import Timeouts

T = TypeVar("T")


def pin_table(cp: int) -> PinTable:
    return PinTable(addr=1 << 20 | cp << 16, slots=64, host_id="another-host", pid=1, fd=3, tag=1)


def nonce(cp: int) -> int:
    return 0x5EED0000 + cp


SLOT = 9


@dataclass
class World:
    timeline: Timeline
    owners: dict[int, Owner]
    fake: dict[int, FakeOwner]
    lane: FakeLane
    merging: FakeLane
    client: FakeClient
    feed: FakeFeed
    ctx: DecodeContext
    mem: np.ndarray
    dst: np.ndarray
    points: Awaits

    def job(self) -> Fetch:
        return Fetch("e0", ROOM, self.dst, Deadline.after(300), time.perf_counter())

    def claims(self) -> ClaimProtocol:
        return ClaimProtocol(self.ctx)


async def world(
    *,
    ready: dict[int, int] | None = None,
    src_pages: dict[int, list[int]] | None = None,
    dst: list[int] | None = None,
    pins: bool = False,
    merged: tuple[int, ...] = (),
) -> World:
    """Three owners (cp ranks 0..2 of tests.wire_helpers' layout), every layer ready unless
    `ready` says how far (a layer index) for some; one `FakeLane` reads them all, but the
    `merged` ranks, which one that reads several together (`World.merging`) reads."""
    timeline = Timeline()
    mem = np.zeros((LAYERS, NUM_PAGES, PAGE), np.uint8)
    lane, merging = FakeLane(timeline, mem), FakeLane(timeline, mem, batches=True, name="merging")
    dst_ids = np.asarray(dst if dst is not None else [7, 3, 60, 11, 0], np.int64)
    fakes, owners = {}, {}
    for cp, span in SPANS.items():
        rank = rank_descriptor(
            cp,
            control_url=f"http://owner{cp}.test:8000",
            agent_name=f"e0.cp{cp}.abc",
            pins=pin_table(cp) if pins else None,
        )
        pages = (
            src_pages[cp] if src_pages is not None else [(5 * cp + 2 * i + 1) % NUM_PAGES for i in range(len(dst_ids))]
        )
        fakes[cp] = FakeOwner(timeline, rank, pages, (ready or {}).get(cp, span.stop))
        own_lane = merging if cp in merged else lane
        owners[cp] = Owner(rank, {}, lane=own_lane, peer=await own_lane.open(rank, {}))
    client, feed = FakeClient(timeline, fakes), FakeFeed(timeline, fakes)
    pool = SimpleNamespace(layout=LAYOUT)
    ctx = DecodeContext(pool, Timeouts(), "decode-test", client, feed)  # type: ignore[arg-type]
    points = Awaits(timeline)
    client.points = feed.points = lane.points = points
    return World(timeline, owners, fakes, lane, merging, client, feed, ctx, mem, dst_ids, points)


async def until(condition: Any, what: str = "condition", spins: int = 1000) -> None:
    """Let the loop run until `condition()` holds (a bounded number of turns, not a time)."""
    for _ in range(spins):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never held")


async def settle(spins: int = 50) -> None:
    for _ in range(spins):
        await asyncio.sleep(0)


async def reported(w: World, work: Awaitable[T]) -> T:
    """`work`'s outcome, marked ("outcome") in the timeline as it reaches its caller."""
    try:
        return await work
    finally:
        w.timeline.add("outcome")


def assert_nothing_after(w: World, outcome: int) -> None:
    """No byte landed, and no read was in flight, once the outcome was reported."""
    assert not [e for e in w.timeline.events[outcome:] if e[0] in ("landed", "read")], w.timeline.events[outcome:]
    assert w.lane.in_flight == w.merging.in_flight == 0


def assert_given_up_once(w: World, released: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Every rank a claim request went to got exactly one release request: its own release
    (`released`) or else one give-up; a rank never asked got none."""
    for cp in SPANS:
        asked = bool(w.client.of(cp, "claim"))
        releases, give_ups = w.client.of(cp, "release"), w.client.of(cp, "give_up")
        if not asked:
            assert not releases and not give_ups, cp
        elif cp in released:
            assert len(releases) == 1 and not give_ups, (cp, w.client.requests)
        else:
            assert not releases and len(give_ups) == 1, (cp, w.client.requests)


async def ticket_world(
    *, merged: tuple[int, ...] = (), mapped: tuple[int, ...] = (0, 1)
) -> tuple[World, FakeSignals, TicketProtocol, RoomTicket]:
    """Three pinned owners: `mapped` ranks' pin tables mapped here (the rest READ over
    UCX); `merged` ranks on a lane that reads them together, the rest on a plain one."""
    w = await world(pins=True, merged=merged)
    ucx = FakeSignals(w.timeline)
    for cp, o in w.owners.items():
        ucx.cp_of[o.rank.agent_name] = cp
        if cp in mapped:
            o.pins = FakePins(w.timeline, cp, {SLOT: nonce(cp)})  # type: ignore[assignment]
        else:
            assert o.rank.pins is not None
            ucx.words[o.rank.pins.addr + 8 * SLOT] = nonce(cp)
    src = w.fake[0].src_pages
    pins = [OwnerPin(cp_rank=cp, incarnation="abc", slot=SLOT, nonce=nonce(cp)) for cp in SPANS]
    ticket = RoomTicket(engine_id="e0", room=ROOM, src_pages=src, pins=pins)
    return w, ucx, TicketProtocol(w.ctx, ucx), ticket


def pin_checks(t: Timeline, cp: int) -> list[int]:
    return t.where("pin_word", cp) + t.where("pin_read", cp)
