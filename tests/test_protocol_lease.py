"""A room's lease (`transfer/decode/lease.py`): read by claims or as a ticket's, over the fakes of tests/fakes/."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from pdkv.errors import ClaimLostError, InvalidPagesError, PeerLostError
from tests.fakes.memory import FP, ROOM, SPANS, expected
from tests.fakes.pins import FakePins, FakeSignals
from tests.fakes.world import SLOT, World, nonce, world
from transfer.decode.claims import Claim
from transfer.decode.lease import RoomLease
from transfer.decode.tasks import Activity
from transfer.decode.tickets import TicketProtocol
from transfer.metadata import ClaimRelease, OwnerPin, ReadFrom, decode, decode_any


def pinned_lease(w: World, claim: Claim) -> tuple[RoomLease, FakeSignals]:
    """A lease on `w`'s room under `claim`, each owner pinning it (its pin table mapped here)."""
    activity = Activity("decode-test")
    activity.open = True
    ucx = FakeSignals(w.timeline)
    for cp, o in w.owners.items():
        ucx.cp_of[o.rank.agent_name] = cp
        w.fake[cp].pin = OwnerPin(cp_rank=cp, incarnation="abc", slot=SLOT, nonce=nonce(cp))
        o.pins = FakePins(w.timeline, cp, {SLOT: nonce(cp)})  # type: ignore[assignment]
    lease = RoomLease(w.ctx, activity, w.claims(), TicketProtocol(w.ctx, ucx), "e0", w.owners, claim)
    return lease, ucx


@pytest.mark.parametrize("cleared", [False, True], ids=["proved", "pin-cleared"])
async def test_lease_read_as_written_is_proved_by_pin_words_not_release_round_trips(cleared: bool) -> None:
    """A room claimed before it was whole is read by claims as its layers come; once every
    owner's last state names its pin, the read is proved by the pin words after the data and
    the claims released by notifications: no release request. A pin word cleared meanwhile
    fails the read and gives the claims up."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same), ready={0: 1, 2: 7})
    claim = Claim(ROOM)
    lease, ucx = pinned_lease(w, claim)
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    assert lease._prepared_read() is None  # not whole at the claim: read by claims
    w.fake[0].script, w.fake[2].script = [SPANS[0].stop], [SPANS[2].stop]  # the rest comes while it is read
    if cleared:
        w.owners[1].pins.words[SLOT] = 0  # type: ignore[union-attr]
        with pytest.raises(ClaimLostError, match="cp rank 1 "):
            await lease.read_once(w.dst)
        assert not ucx.notified and all(w.client.of(cp, "give_up") for cp in SPANS)
        return
    result = await lease.read_once(w.dst)
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(same))))
    t = w.timeline
    for cp in SPANS:
        assert t.last("landed", cp) < t.first("pin_word", cp)  # each word after its owner's data
        assert not w.client.of(cp, "release") and not w.client.of(cp, "give_up")
    await asyncio.sleep(0)
    assert {ucx.cp_of[agent] for agent, _ in ucx.notified} == set(SPANS)  # released by notifications
    assert all(decode(body, ClaimRelease, FP).claim == claim.token for _, body in ucx.notified)
    assert not result.freed and result.freed_on == ()
    await lease.release()  # as leaving `async with lease` does: released already, nothing asked
    await lease.give_up()
    assert not any(w.client.of(cp, "release") or w.client.of(cp, "give_up") for cp in SPANS)


async def test_lease_released_by_notifications_is_released_at_once_for_its_holder() -> None:
    """The notifications of a read proved by pin words may leave a moment after it returned;
    the claim counts as released from the return, so a `release` or `give_up` right after
    asks no owner (a release request racing the notification could fail a proved read, a
    give-up would abort a room that was read)."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same))
    claim = Claim(ROOM)
    lease, ucx = pinned_lease(w, claim)
    lease._tickets.release_delay = 60  # the notifications wait: the holder acts first
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    await lease.read_once(w.dst)  # read as a ticket's: the room was whole at the claim
    assert await lease.release() is False
    await lease.give_up()
    assert not any(w.client.of(cp, "release") or w.client.of(cp, "give_up") for cp in SPANS)
    lease._tickets.flush()
    assert {ucx.cp_of[agent] for agent, _ in ucx.notified} == set(SPANS)


@pytest.mark.parametrize("whole", [True, False], ids=["as-a-ticket", "by-claims"])
async def test_lease_whose_owner_was_forgotten_fails_its_read_typed_and_gives_up(whole: bool) -> None:
    """An owner forgotten between the claim and its lease (its engine re-registered, a peer
    lost) leaves the lease unprepared rather than failing the claim with its room held; the
    read then fails typed and gives the claims up, whether the room reads as a ticket's (its
    claim answers named the pins) or by claims."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same))
    claim = Claim(ROOM)
    if whole:
        pinned_lease(w, claim)  # the owners pin: their claim answers name the pins
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    w.owners[1].lane = None
    lease, _ = pinned_lease(w, claim)
    assert lease._prepared is None or not whole  # the preparation failed quietly, at the claim
    with pytest.raises(PeerLostError):
        await lease.read_once(w.dst)
    assert all(w.client.of(cp, "give_up") for cp in SPANS)


async def test_lease_whose_owner_names_another_ranks_pin_reads_by_claims() -> None:
    """A claim answer whose pin is another rank's does not make the room read as a
    ticket's (that read would look the owner's pin up and fail untyped): it is read by
    claims, which need no pin, byte for byte."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same))
    claim = Claim(ROOM)
    claims = w.claims()
    await claims.claim_all(w.owners, claim, w.job().deadline)
    for cp, state in claim.states.items():
        other = (cp + 1) % len(SPANS)
        pin = OwnerPin(cp_rank=other, incarnation="abc", slot=SLOT, nonce=nonce(other))
        claim.states[cp] = msgspec.structs.replace(state, pin=pin)
    activity = Activity("decode-test")
    activity.open = True
    ucx = FakeSignals(w.timeline)
    lease = RoomLease(w.ctx, activity, claims, TicketProtocol(w.ctx, ucx), "e0", w.owners, claim)
    assert lease._prepared_read() is None
    result = await lease.read_once(w.dst)
    assert result.freed and not ucx.notified  # released by claims, not by notifications
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(same))))


@pytest.mark.parametrize("whole", [True, False], ids=["as-a-ticket", "by-claims"])
async def test_lease_read_past_a_prefix_tells_each_owner_where_it_starts_before_its_data(whole: bool) -> None:
    """A read that skips the room's first pages (the decode's prefix) tells every owner where
    its claim reads from, once, before any byte lands, so each owner can free the prefix;
    only the pages past it are read, into the destination pages."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same), dst=[7, 3, 60])
    claim = Claim(ROOM)
    if whole:
        lease, ucx = pinned_lease(w, claim)
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    if not whole:  # the claim answers name no pin: read by claims, released by requests
        activity = Activity("decode-test")
        activity.open = True
        ucx = FakeSignals(w.timeline)
        for cp, o in w.owners.items():
            ucx.cp_of[o.rank.agent_name] = cp
        lease = RoomLease(w.ctx, activity, w.claims(), TicketProtocol(w.ctx, ucx), "e0", w.owners, claim)
    result = await lease.read_once(w.dst, skip=2)
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(same[2:]))))
    starts = [(ucx.cp_of[a], decode(b, ReadFrom, FP)) for a, b in ucx.notified[: len(SPANS)]]
    assert sorted(cp for cp, _ in starts) == list(SPANS)
    assert all((n.room, n.claim, n.start) == (ROOM, claim.token, 2) for _, n in starts)
    t = w.timeline
    assert all(t.first("notify", tuple(sorted(SPANS))) < t.first("landed", cp) for cp in SPANS)
    await asyncio.sleep(0)
    later = [decode_any(b, (ReadFrom, ClaimRelease), FP) for _, b in ucx.notified[len(SPANS) :]]
    assert not any(isinstance(n, ReadFrom) for n in later)  # told once
    assert result.nbytes == sum(s.nbytes for s in result.owners) and result.nbytes > 0


async def test_lease_reads_may_not_skip_fewer_pages_than_its_owners_were_told() -> None:
    """The owners may have freed the prefix the first read skipped: a later read under the
    same lease that would read it is refused typed, before anything is read; one that skips
    as many (or more) is read, and no owner is told again."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same), dst=[7, 3, 60])
    claim = Claim(ROOM)
    lease, ucx = pinned_lease(w, claim)
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    await lease.read(w.dst, skip=2)
    told = len(ucx.notified)
    assert told == len(SPANS)
    landed = len(w.timeline.events)
    with pytest.raises(InvalidPagesError, match="skip 2 pages"):
        await lease.read(np.array([7, 3, 60, 11]), skip=1)
    assert len(w.timeline.events) == landed  # nothing asked, nothing read
    await lease.read(np.array([8, 2]), skip=3)
    assert len(ucx.notified) == told
    await lease.release()
