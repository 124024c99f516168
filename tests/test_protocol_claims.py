"""The decode's claim protocol (`transfer/decode/claims.py`) over the fakes of tests/fakes/."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import numpy as np
import pytest

from pdkv.errors import ClaimLostError, ClosedError, RoomAbortedError
from tests.fakes.control import Request
from tests.fakes.memory import LAYERS, PAGE, ROOM, SPANS, expected
from tests.fakes.world import World, assert_given_up_once, assert_nothing_after, reported, settle, until, world
from transfer.decode.claims import Claim
from transfer.lanes.base import Lane

# ---- 1. claims ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("freed", [(True, True, True), (True, False, True)])
async def test_claims_arbiter_first_read_then_release(freed: tuple[bool, ...]) -> None:
    pages = {0: [1, 2, 3, 4, 5], 1: [64, 10, 20, 30, 40], 2: [9, 8, 7, 6, 5]}  # each owner's own pages
    w = await world(src_pages=pages, dst=[0, 63, 5, 17, 2])
    for cp, f in enumerate(freed):
        w.fake[cp].freed = f
    assert isinstance(w.lane, Lane)

    result = await reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job()))

    t, reqs = w.timeline, w.client.requests
    # The lowest CP rank is claimed, and answers, before any other rank is asked anything.
    assert reqs[0] == Request("claim", 0)
    others = [i for i, e in enumerate(t.events) if e[0] == "request" and e[2] != 0]
    assert t.first("answer", "claim", 0) < min(others)
    # Each owner: claimed once, read whole, then released (after its last byte landed).
    for cp, span in SPANS.items():
        assert w.client.of(cp, "claim") == [Request("claim", cp)]
        assert w.client.of(cp, "release", "give_up") == [Request("release", cp)]
        assert t.last("landed", cp) < t.first("request", "release", cp)
        assert [(c, ly) for c, ly in w.lane.reads if c == cp] == [(cp, span)]
        assert not w.fake[cp].tokens  # nothing left pinned
    assert len(reqs) == 6
    # Byte for byte: every owner's own source pages of every layer, in the destination pages.
    np.testing.assert_array_equal(w.mem, expected(w.dst, {cp: np.asarray(p) for cp, p in pages.items()}))
    # The result.
    assert result.room == ROOM and result.engine_id == "e0"
    assert result.nbytes == LAYERS * len(w.dst) * PAGE
    assert result.control_messages == 6
    assert [(s.cp_rank, s.layers, s.nbytes, s.reads, s.lane) for s in result.owners] == [
        (cp, (span.start, span.stop), len(span) * len(w.dst) * PAGE, 1, "fake") for cp, span in SPANS.items()
    ]
    assert result.freed_on == tuple(cp for cp, f in enumerate(freed) if f)
    assert result.freed is all(freed)
    assert not w.feed.wanted  # every room it wanted pushed, forgotten


# ---- 2. layers arriving in steps -----------------------------------------------------------------


async def test_claims_read_layers_in_batches_as_they_become_ready() -> None:
    w = await world(ready={0: 0, 1: 3})  # rank 0: nothing ready; rank 1: nothing; rank 2: all
    w.fake[1].unknown = 1  # rank 1's room is published only at its second claim
    for cp, f in w.fake.items():
        w.timeline.add("ready", cp, f.ready_upto)
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))

    def read_of(cp: int) -> list[range]:
        return [ly for c, ly in w.lane.reads if c == cp]

    await until(lambda: read_of(2) and len(w.client.of(0, "poll")) == 1 and len(w.client.of(1, "poll")) == 1)
    assert read_of(0) == read_of(1) == []
    steps = [
        (0, 1, [range(0, 1)]),
        (1, 4, [range(3, 4)]),
        (0, 3, [range(0, 1), range(1, 3)]),
        (1, 5, [range(3, 4), range(4, 5)]),
    ]
    for cp, upto, reads in steps:
        w.fake[cp].advance(upto)
        done = (cp, reads)
        await until(lambda d=done: read_of(d[0]) == d[1] and w.timeline.where("landed", d[0], d[1][-1].start))
        await settle()
        assert read_of(cp) == reads  # one batch for what became ready (two layers at once too)
    result = await fetch

    # Nothing was read before it was ready: every read's layers were ready at the time.
    for i, event in enumerate(w.timeline.events):
        if event[0] == "read":
            for cp, _start, stop in event[2]:
                ready_then = max(e[2] for e in w.timeline.events[:i] if e[:2] == ("ready", cp))
                assert stop <= ready_then, (event, ready_then)
    # Each poll asked past what was already read; rank 1 claimed twice (UNKNOWN, then PENDING).
    assert [r.after for r in w.client.of(0, "poll")] == [0, 1]
    assert [r.after for r in w.client.of(1, "poll")] == [3, 4]
    assert len(w.client.of(1, "claim")) == 2 and not w.client.of(2, "poll")
    for cp in SPANS:
        assert w.timeline.last("landed", cp) < w.timeline.first("request", "release", cp)
    np.testing.assert_array_equal(w.mem, expected(w.dst, {cp: np.asarray(f.src_pages) for cp, f in w.fake.items()}))
    assert [s.reads for s in result.owners] == [2, 2, 1]
    assert result.control_messages == len(w.client.requests) == 4 + 4 + 3
    assert result.freed and result.freed_on == (0, 1, 2)


# ---- 3. a slow read and a refused release --------------------------------------------------------


async def test_claims_refused_release_raises_after_the_slow_read_ended() -> None:
    w = await world()
    w.lane.gates[0] = slow = asyncio.Event()
    w.lane.drain = True  # cancelled, the slow read still runs to its end
    w.fake[1].refuse = ClaimLostError("room 42: the claim is unknown on cp rank 1")
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))

    try:
        await until(lambda: w.timeline.where("refused", "release", 1), "rank 1 refused")
        await settle()
        assert w.lane.in_flight == 1 and not w.timeline.where("landed", 0)
        assert not fetch.done()  # the refusal is known, but rank 0's read has not ended
    finally:
        slow.set()  # a drained read waits for it whatever cancels it: never leave it shut
    with pytest.raises(ClaimLostError, match="cp rank 1"):
        await fetch
    outcome = w.timeline.first("outcome")

    t = w.timeline
    assert t.first("refused", "release", 1) < t.first("landed", 0) < t.first("read_end", (0,)) < outcome
    assert t.where("read_cancelled", (0,))
    assert_nothing_after(w, outcome)
    # Rank 1 was released (refused); rank 0 given up; rank 2 either released or given up, once.
    assert w.client.of(1, "release") == [Request("release", 1)] and not w.client.of(1, "give_up")
    assert w.client.of(0, "give_up") == [Request("give_up", 0)] and not w.client.of(0, "release")
    assert len(w.client.of(2, "release", "give_up")) == 1
    assert not w.fake[0].tokens


# ---- 4. cancellation at every await ---------------------------------------------------------------


async def _await_scenario(cancel_at: int | None) -> tuple[World, BaseException | None]:
    """Rank 0 ready; rank 1 half ready (one poll); rank 2 published at its second claim."""
    w = await world(ready={1: 4})
    w.fake[1].script = [5]
    w.fake[2].unknown = 1
    w.points.cancel_at = cancel_at
    fetch = asyncio.ensure_future(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))
    w.points.target = fetch
    outcome: BaseException | None = None
    try:
        await fetch
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        outcome = exc
    return w, outcome


def _count_awaits() -> list[tuple[Any, ...]]:
    w, outcome = asyncio.run(_await_scenario(None))
    assert outcome is None
    return w.points.labels


AWAITS = _count_awaits()


def test_await_scenario_awaits_every_kind() -> None:
    kinds = Counter(label[0] for label in AWAITS)
    assert kinds == {"claim": 4, "read": 4, "wait": 1, "poll": 1, "release": 3}, AWAITS


@pytest.mark.parametrize("n", range(len(AWAITS)), ids=[f"{i}-{'.'.join(map(str, a))}" for i, a in enumerate(AWAITS)])
async def test_claims_cancelled_at_every_await(n: int) -> None:
    w, outcome = await _await_scenario(n)

    assert isinstance(outcome, asyncio.CancelledError), outcome
    assert w.points.fired and w.points.labels[n] == AWAITS[n]
    assert_nothing_after(w, w.timeline.last("outcome"))
    released = {cp for cp in SPANS if w.client.of(cp, "release")}
    assert_given_up_once(w, released)
    # Releases are asked only after a rank's last byte landed, and a give-up only after the cancel.
    for cp in released:
        assert w.timeline.last("landed", cp) < w.timeline.first("request", "release", cp)
    cancel = w.timeline.first("cancel")
    assert all(i > cancel for i in w.timeline.where("request", "give_up"))
    assert not w.feed.wanted
    assert all(not f.tokens for f in w.fake.values())  # nothing left pinned, a release cut off too


# ---- 5. the room aborted mid-read ----------------------------------------------------------------


async def test_claims_room_aborted_mid_read() -> None:
    w = await world()
    for cp in SPANS:
        w.lane.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))
    await until(lambda: w.lane.in_flight == 3, "three reads in flight")
    assert w.feed.watches == 1 and not w.timeline.where("landed")
    w.feed.abort.set()
    with pytest.raises(RoomAbortedError):
        await fetch
    outcome = w.timeline.first("outcome")

    t = w.timeline
    for cp in SPANS:
        assert t.first("aborted") < t.first("read_cancelled", (cp,)) < outcome
        assert t.first("landed", cp) < t.first("read_cancelled", (cp,))  # its in-flight copy first
        assert all(i > t.first("read_end", (cp,)) for i in t.where("request", "give_up", cp))
    assert_nothing_after(w, outcome)
    assert_given_up_once(w)
    assert all(not f.tokens for f in w.fake.values())
    assert not w.feed.wanted


# ---- 7. the fetcher closed mid-fetch -----------------------------------------------------------------


@pytest.mark.parametrize("phase", ["arbiter_claim", "reads"])
async def test_claims_cancel_all_raises_closed(phase: str) -> None:
    w = await world()
    if phase == "arbiter_claim":
        w.fake[0].hold_claims = asyncio.Event()
    for cp in SPANS:
        w.lane.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))
    if phase == "arbiter_claim":
        await until(lambda: w.client.requests == [Request("claim", 0)])
    else:
        await until(lambda: w.lane.in_flight == 3, "three reads in flight")
    w.ctx.tasks.cancel_all()
    with pytest.raises(ClosedError):
        await fetch
    outcome = w.timeline.first("outcome")

    assert_nothing_after(w, outcome)
    assert_given_up_once(w)
    if phase == "arbiter_claim":  # no other rank was asked: only the lowest one is given up
        assert [r.cp for r in w.client.requests if r.op == "give_up"] == [0]
    else:
        assert all(not f.tokens for f in w.fake.values())


# ---- owners on a lane that reads several as one --------------------------------------------------


@pytest.mark.parametrize("pages", ["shared", "own"])
async def test_claims_read_owners_ready_at_once_as_one_batch(pages: str) -> None:
    """Owners on a lane that batches, every layer ready when claimed, go out as one read once
    each has joined or withdrawn: rank 1, whose layers come in steps, withdraws and reads its
    own. Owners whose source pages differ are read one by one."""
    own = {0: [1, 2, 3, 4, 5], 1: [9, 8, 7, 6, 5], 2: [5, 4, 3, 2, 1] if pages == "own" else [1, 2, 3, 4, 5]}
    w = await world(merged=(0, 1, 2), src_pages=own, ready={1: 4})
    merging = w.merging
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))
    await until(lambda: len(w.client.of(1, "poll")) == 1 and w.timeline.where("landed", 2, 5))
    w.fake[1].advance(5)
    result = await fetch

    assert merging.batch_calls == ([(0, 2)] if pages == "shared" else [])
    alone = [(1, range(3, 4)), (1, range(4, 5))]
    assert sorted(merging.reads, key=lambda r: (r[0], r[1].start)) == (
        alone if pages == "shared" else [(0, SPANS[0]), *alone, (2, SPANS[2])]
    )
    np.testing.assert_array_equal(w.mem, expected(w.dst, {cp: np.asarray(p) for cp, p in own.items()}))
    assert result.nbytes == LAYERS * len(w.dst) * PAGE
    assert [(s.cp_rank, s.nbytes) for s in result.owners] == [
        (cp, len(span) * len(w.dst) * PAGE) for cp, span in SPANS.items()
    ]
