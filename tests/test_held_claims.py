"""Claims a rank holds for its arbiter to hand out (`RoomTable.hold`, `HeldClaims`): the
logic on each side, without processes (the protocol end to end: test_protocol_held)."""

import time

import numpy as np
import pytest

from pdkv import ClaimLostError, RoomClaimedError
from transfer.metadata import HeldClaim, OwnerPin, OwnerRef, RoomState, RoomStatus
from transfer.prefill.held import HeldClaims, pages_digest
from transfer.prefill.rooms import RoomTable

A, B, C = "a" * 32, "b" * 32, "c" * 32


def whole(room: int = 1, consumers: int = 1) -> RoomTable:
    t = RoomTable(range(0, 2), num_pages=32, pin_seconds=60, pins=np.zeros(8, dtype=np.int64))
    t.publish(room, np.array([4, 5]), consumers=consumers, hold=True)
    t.mark_ready(room, 2)
    return t


async def test_a_room_holds_one_claim_once_whole_and_only_a_claim_it_could_grant():
    t = RoomTable(range(0, 2), num_pages=32, pin_seconds=60, pins=np.zeros(8, dtype=np.int64))
    t.publish(1, np.array([4, 5]), hold=True)
    assert t.hold(1) is None  # layer 1 not ready yet
    t.mark_ready(1, 2)
    token = t.hold(1)
    assert token is not None and t.hold(1) is None  # one a room
    assert t.granted(1) == 1 and t.being_read  # it holds the room's one claim, and a READ may come
    t.publish(2, np.array([6]), hold=True)
    t.mark_ready(2, 2)
    t.claim(2, B, "d0")
    assert t.hold(2) is None  # its one claim is taken
    t.publish_chunked(3, 2)
    t.add_chunk(3, np.array([7, 8]))
    assert t.hold(3) is None  # sent by chunks: read as it comes, by claims
    assert RoomTable(range(0, 2), num_pages=32, pin_seconds=60).hold(9) is None  # not live
    no_pins = RoomTable(range(0, 2), num_pages=32, pin_seconds=60)
    no_pins.publish(1, np.array([4]), hold=True)
    no_pins.mark_ready(1, 2)
    assert no_pins.hold(1) is None  # no pin word: nothing could prove a read of it


async def test_a_claim_the_room_could_not_grant_otherwise_takes_the_held_one_over():
    """The arbiter granted another claimant (so it never hands the held claim out): the
    relayed claim takes its place, and the held token pins nothing any more."""
    t = whole()
    held = t.hold(1)
    assert held is not None
    assert t.claim(1, B, "d0").status is RoomStatus.READY
    with pytest.raises(RoomClaimedError):
        t.claim(1, C, "d1")  # one consumer: B holds the room
    with pytest.raises(ClaimLostError):
        t.check_claim(1, held)
    assert t.release(1, B).freed


async def test_a_held_claim_a_reader_used_is_never_taken_over():
    """Once its reader (the claimant it was handed to) used it, it is that reader's claim."""
    t = whole()
    held = t.hold(1)
    assert held is not None
    t.check_claim(1, held)  # the reader polled under it
    with pytest.raises(RoomClaimedError):
        t.claim(1, B, "d1")
    t2 = whole(consumers=1)
    held2 = t2.hold(1)
    assert held2 is not None
    assert t2.read_from(1, held2, 1) == 1  # its reader said where it reads from: its prefix is freed
    with pytest.raises(ClaimLostError):
        t2.give_up(1, C)  # a stranger's give-up takes nothing of it
    assert t2.release(1, held2).freed


async def test_a_room_published_to_hold_gets_no_ticket_and_a_give_up_never_takes_its_held_claim():
    """No ticket for a room published to hold, on any rank (so all refuse alike). A give-up
    (from anyone, of a claim this rank never saw) does not take the held claim: the arbiter
    may have handed it out."""
    t = whole()
    assert await t.pin(1, timeout=1) is None
    held = t.hold(1)
    assert held is not None
    with pytest.raises(ClaimLostError):
        t.give_up(1, C)
    t.check_claim(1, held)  # still there for its reader


async def test_a_held_claim_the_arbiter_returns_ends_unread_and_only_that_one():
    """Given back as its claim ended unread at the arbiter: it ends unread here (the room
    aborted where nobody read it), once, used by a reader or not."""
    t = whole(consumers=2)
    held = t.hold(1)
    assert held is not None
    t.claim(1, B, "d0")
    assert not t.drop_held(1, C, ended=True)  # not the held claim: nothing done
    assert t.drop_held(1, held, ended=True) and t.granted(1) == 2 and t.state(1).status is RoomStatus.READY
    assert not t.drop_held(1, held, ended=True)  # once
    assert t.release(1, B).freed and t.counters.released == 1
    t2 = whole()
    held2 = t2.hold(1)
    assert held2 is not None
    t2.check_claim(1, held2)  # its reader used it: the arbiter handed it out
    assert not t2.drop_held(1, held2, ended=False)  # a refusal takes only an unused one
    assert t2.drop_held(1, held2, ended=True)  # its claimant's claim ended unread at the arbiter
    assert t2.state(1).status is RoomStatus.ABORTED
    t3 = whole()
    held3 = t3.hold(1)
    assert held3 is not None and t3.drop_held(1, held3, ended=True)
    assert t3.state(1).status is RoomStatus.ABORTED and t3.counters.aborted == 1  # nobody read it


async def test_a_held_claim_the_arbiter_refused_frees_its_place_for_the_claim_it_granted():
    """Refused because the arbiter had granted the room to another claimant already (whose
    claim comes here directly, the room not published here at its relay): its place is free
    again, nothing ends."""
    t = whole()
    held = t.hold(1)
    assert held is not None and t.drop_held(1, held, ended=False)
    assert t.granted(1) == 0 and t.counters.aborted == 0
    t.claim(1, B, "d0")
    assert t.release(1, B).freed


async def test_a_room_published_for_a_ticket_holds_nothing():
    t = RoomTable(range(0, 2), num_pages=32, pin_seconds=60, pins=np.zeros(8, dtype=np.int64))
    t.publish(1, np.array([4, 5]))
    t.mark_ready(1, 2)
    assert t.hold(1) is None and await t.pin(1, timeout=1) is not None


def _held(rank: int, incarnation: str = "i1", pages: list[int] | None = None, **state: object) -> HeldClaim:
    pin = OwnerPin(cp_rank=rank, incarnation=incarnation, slot=rank, nonce=100 + rank)
    s = RoomState(room=1, status=RoomStatus.READY, ready_upto=2, pin=pin)
    s = RoomState(**{**{f: getattr(s, f) for f in s.__struct_fields__}, **state})
    digest = pages_digest(pages or [4, 5])
    return HeldClaim(cp_rank=rank, incarnation=incarnation, claim=f"{rank:x}" * 32, state=s, pages=digest)


def _kept(held: HeldClaims, claim: HeldClaim) -> bool:
    return held.keep(claim)[0]


OTHERS = [OwnerRef(cp_rank=1, incarnation="i1"), OwnerRef(cp_rank=2, incarnation="i1")]


def test_the_arbiter_hands_out_every_rank_held_claim_once_or_none():
    held = HeldClaims(keep_s=60)
    assert _kept(held, _held(1))
    assert held.hand_out(1, OTHERS, [4, 5], A) is None  # rank 2 holds none yet: nothing taken
    assert _kept(held, _held(2))
    assert held.hand_out(1, OTHERS[:1] + [OwnerRef(cp_rank=2, incarnation="i2")], [4, 5], A) is None  # restarted
    assert held.hand_out(1, OTHERS, [4, 6], A) is None  # other pages than the arbiter's
    answers = held.hand_out(1, OTHERS, [4, 5], A)
    assert answers is not None and [(a.cp_rank, a.claim) for a in answers] == [(1, "1" * 32), (2, "2" * 32)]
    assert all(a.state is not None and a.state.src_pages == [4, 5] for a in answers)  # the arbiter's, matched
    assert held.hand_out(1, OTHERS, [4, 5], A) is None and held.handed_out == 1  # once


def test_a_held_claim_another_replaces_is_given_back():
    """A rank holds one claim a room: another in its name replaces it, and the one replaced
    goes back to be ended (it was not that rank's, or it is stale)."""
    held = HeldClaims(keep_s=60)
    first = _held(1)
    assert held.keep(first) == (True, None)
    assert held.keep(first) == (True, None)  # the same one again: nothing to give back
    other = HeldClaim(cp_rank=1, incarnation="i1", claim="e" * 32, state=first.state, pages=first.pages)
    assert held.keep(other) == (True, first)
    assert [h.claim for h in held.pop(1, unread=False)] == ["e" * 32] and held.pop(1, unread=False) == []


def test_claims_handed_out_go_back_once_their_claimant_gave_up_there():
    """The claimant the held claims went to gave its claim up on the arbiter (or vanished):
    they go back at once, whatever becomes of the room (another reader may still read it)."""
    held = HeldClaims(keep_s=60)
    assert _kept(held, _held(1)) and _kept(held, _held(2))
    assert held.hand_out(1, OTHERS, [4, 5], A) is not None
    assert held.given_up(1, B) == []  # another claimant's: not its claims
    assert [h.cp_rank for h in held.given_up(1, A)] == [1, 2] and held.given_up(1, A) == []
    assert held.pop(1, unread=True) == []  # given back once


def test_claims_handed_out_go_back_only_where_the_room_ended_unread():
    """Handed to a claimant whose answer was lost (or who died): the arbiter's room ends
    unread, and the ranks are told to end theirs; read, they are left to their reader."""
    for unread in (False, True):
        held = HeldClaims(keep_s=60)
        assert _kept(held, _held(1)) and _kept(held, _held(2))
        assert held.hand_out(1, OTHERS, [4, 5], A) is not None
        back = held.pop(1, unread)
        assert [h.cp_rank for h in back] == ([1, 2] if unread else [])


def test_a_held_claim_that_says_nothing_readable_or_has_lapsed_is_not_handed_out():
    held = HeldClaims(keep_s=60)
    assert not _kept(held, _held(1, status=RoomStatus.PENDING))
    assert not _kept(held, _held(1, pin=None))
    assert not _kept(held, _held(1, pin=OwnerPin(cp_rank=2, incarnation="i1", slot=1, nonce=1)))  # another's pin
    assert not _kept(held, _held(1, ready_pages=2))  # sent by chunks
    assert not _kept(held, _held(1, src_pages=[4, 5]))  # its pages come as their digest only
    lapsing = HeldClaims(keep_s=0.01)
    assert _kept(lapsing, _held(1)) and _kept(lapsing, _held(2))
    time.sleep(0.02)
    assert lapsing.hand_out(1, OTHERS, [4, 5], A) is None
