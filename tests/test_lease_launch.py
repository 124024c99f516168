"""A room claimed whole, read under its lease (`RoomLease.read_once`, SGLang's receiver's read),
on a lane whose reads launch by a call: the launch goes out once the destination ids are
bounded, and every outcome (a refusal of the pages, a cancel, a lost owner) comes only once
the copy has ended. Fake owners and a fake launching lane (`tests/test_gather.py`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdkv.errors import InvalidPagesError, PageRangeError, PeerLostError
from tests.fakes.memory import NUM_PAGES, ROOM, SPANS, expected
from tests.fakes.world import World, assert_nothing_after, reported, settle, world
from tests.test_gather import _cancelled_twice_after_the_copy, _LaunchingBatch
from tests.test_protocol_lease import pinned_lease
from transfer.decode import lease as lease_module
from transfer.decode.claims import Claim
from transfer.decode.lease import RoomLease

SAME = [1, 4, 9, 16, 25]  # every owner's source pages: the room is whole, read as a ticket's


async def _claimed_whole() -> tuple[World, RoomLease, asyncio.Event]:
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, SAME), merged=tuple(SPANS))
    w.merging.batch = lambda peers: _LaunchingBatch(w.merging, peers)  # type: ignore[method-assign]
    gate = asyncio.Event()  # holds every copy until set
    for cp in SPANS:
        w.merging.gates[cp] = gate
    claim = Claim(ROOM)
    lease, _ = pinned_lease(w, claim)
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    assert lease._prepared_read() is not None
    return w, lease, gate


async def test_a_read_launched_once_its_ids_are_bounded_lands_the_rooms_bytes():
    w, lease, gate = await _claimed_whole()
    read = asyncio.create_task(lease.read_once(w.dst))
    await settle(5)
    assert len(w.timeline.where("launch")) == 1 and not read.done()
    gate.set()
    result = await read
    assert len(w.timeline.where("launch")) == 1
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(SAME))))
    assert result.nbytes > 0


async def test_repeated_pages_are_refused_once_the_copy_has_ended_and_the_claim_is_given_up():
    w, lease, gate = await _claimed_whole()
    twice = w.dst.copy()
    twice[-1] = twice[0]
    read = asyncio.create_task(reported(w, lease.read_once(twice)))
    await settle(5)
    assert w.timeline.where("launch") and not read.done()  # launched, then held by its copy
    assert not lease._activity.idle.is_set()  # a closing fetcher waits for the copy and the give-up
    gate.set()
    with pytest.raises(InvalidPagesError, match="repeat"):
        await read
    assert_nothing_after(w, w.timeline.first("outcome"))
    assert all(w.client.of(cp, "give_up") for cp in SPANS)
    assert lease._activity.idle.is_set()


async def test_pages_out_of_range_or_a_deadline_and_a_timeout_launch_nothing():
    w, lease, _ = await _claimed_whole()
    with pytest.raises(PageRangeError):
        await lease.read_once(np.array([*w.dst[:-1], NUM_PAGES]))
    w, lease, _ = await _claimed_whole()
    with pytest.raises(ValueError, match="not both"):
        await lease.read_once(w.dst, deadline=w.job().deadline, timeout=5.0)
    assert not w.timeline.where("launch")


async def test_a_read_cancelled_twice_after_its_launch_reports_only_once_the_copy_has_ended():
    w, lease, gate = await _claimed_whole()
    await _cancelled_twice_after_the_copy(w, lease.read_once(w.dst), gate)
    assert all(w.client.of(cp, "give_up") for cp in SPANS)


async def test_an_owner_lost_at_the_launch_is_the_reads_counted_failure(monkeypatch: pytest.MonkeyPatch):
    """Not the caller's pages' fault: counted as the fetch's failure, as before the launch
    moved ahead of the read, and the claim is given up."""
    w, lease, _ = await _claimed_whole()
    counted: list[Exception] = []
    monkeypatch.setattr(lease_module, "observe_fetch_failure", lambda engine, exc: counted.append(exc))

    def lost(*args: object, **kwargs: object) -> None:
        raise PeerLostError("its mapping was dropped", w.owners[0].rank.agent_name)

    prepared = lease._prepared_read()
    assert prepared is not None
    for _, _, batch in prepared.together:
        batch.start = lost  # type: ignore[method-assign]
    with pytest.raises(PeerLostError):
        await lease.read_once(w.dst)
    assert len(counted) == 1 and isinstance(counted[0], PeerLostError)
    assert all(w.client.of(cp, "give_up") for cp in SPANS)
