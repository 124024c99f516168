import asyncio
import time

import numpy as np
import pytest

from pdkv import ClaimLostError, ConflictError, InvalidPagesError, PageRangeError, RoomClaimedError, UnknownRoomError
from transfer.metadata import RoomStatus
from transfer.prefill.rooms import RoomTable

A, B, C = "a" * 32, "b" * 32, "c" * 32


def table(pin=60.0):
    freed = []
    t = RoomTable(
        range(3, 7), num_pages=32, pin_seconds=pin, on_free=lambda room, pages: freed.append((room, pages.tolist()))
    )
    return t, freed


async def test_every_claim_released_frees_once():
    t, freed = table()
    t.publish(1, np.array([4, 5, 9]), consumers=2)
    assert t.pinned_pages == 3
    t.mark_ready(1, 7)
    assert t.claim(1, A, "d0").status is RoomStatus.READY
    assert t.claim(1, A, "d0").src_pages == [4, 5, 9]  # the same claim again: idempotent
    t.claim(1, B, "d0")  # the same consumer may hold two claims: each is one fetch
    first = t.release(1, A)
    assert not first.freed and first.unreleased == 1 and freed == []
    last = t.release(1, B)
    assert last.freed and last.unreleased == 0
    assert freed == [(1, [4, 5, 9])] and t.pinned_pages == 0


async def test_a_single_consumer_room_grants_one_claim():
    t, _ = table()
    t.publish(1, np.array([4]))
    t.claim(1, A, "d0")
    with pytest.raises(RoomClaimedError, match="1 consumer claim"):
        t.claim(1, B, "d1")  # a duplicate decode, or a retry under a new claim
    t.release(1, A)
    with pytest.raises(UnknownRoomError, match="released"):
        t.claim(1, B, "d1")


async def test_released_room_cannot_be_released_again():
    """The hole: a second release of a freed room used to answer success."""
    t, _ = table()
    t.publish(1, np.array([4]))
    t.claim(1, A, "d0")
    t.release(1, A)
    with pytest.raises(ClaimLostError, match="released"):
        t.release(1, A)
    with pytest.raises(ClaimLostError):
        t.check_claim(1, A)


async def test_a_claim_never_granted_proves_nothing():
    t, _ = table()
    t.publish(1, np.array([4]), consumers=2)
    t.claim(1, A, "d0")
    with pytest.raises(ClaimLostError, match="not an open claim"):
        t.release(1, B)
    with pytest.raises(ClaimLostError, match="unknown"):
        t.release(99, A)


async def test_aborted_or_expired_rooms_refuse_release():
    t, freed = table(pin=0.0)
    t.publish(2, np.array([1]))
    t.claim(2, A, "d0")
    assert t.expire(time.monotonic() + 1) == [2]
    with pytest.raises(ClaimLostError, match="aborted"):
        t.release(2, A)
    t.publish(3, np.array([2]))
    t.claim(3, B, "d0")
    assert t.abort(3) and t.counters.aborted == 1 and t.counters.expired == 1
    with pytest.raises(ClaimLostError, match="aborted"):
        t.release(3, B)
    assert len(freed) == 2
    with pytest.raises(ConflictError):
        t.publish(3, np.array([2]))


async def test_claim_of_an_unpublished_room_grants_nothing():
    t, _ = table()
    assert t.claim(7, A, "d0").status is RoomStatus.UNKNOWN
    t.publish(7, np.array([3]))
    with pytest.raises(ClaimLostError):
        t.check_claim(7, A)  # the earlier answer granted no claim
    t.claim(7, A, "d0")
    t.check_claim(7, A)


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
    with pytest.raises(InvalidPagesError):
        t.publish(1, np.array([3, 3]))


# ---- tickets: pin words and their releases ---------------------------------------------------


async def test_a_ticket_holds_a_claim_its_word_is_cleared_before_the_pages_are_freed():
    pins = np.zeros(4, dtype=np.int64)
    seen = []
    t = RoomTable(range(0, 2), num_pages=32, pin_seconds=60, pins=pins, on_free=lambda r, p: seen.append(pins.copy()))
    t.publish(1, np.array([4, 5]))
    assert await t.pin(1, timeout=0.01) is None  # not every layer ready yet: no ticket
    t.mark_ready(1, 2)
    slot, nonce = await t.pin(1, timeout=1)
    assert pins[slot] == nonce != 0 and t.tickets_out == 1
    assert await t.pin(1, timeout=1) is None  # one ticket a room
    with pytest.raises(RoomClaimedError):
        t.claim(1, A, "d0")  # the ticket holds the single consumer's claim
    assert not t.release_ticket(1, slot, nonce ^ 1)  # forged: frees nothing
    assert t.release_ticket(1, slot, nonce) and t.tickets_out == 0
    assert len(seen) == 1 and not seen[0].any()  # cleared before on_free ran
    assert not t.release_ticket(1, slot, nonce)  # replayed


async def test_a_room_revoked_from_another_thread_proves_nothing_and_ends_before_any_answer_that_could():
    """`unpin_word`: a model thread that cannot wait for pdkv's loop revokes a live room (its
    publication's only): its word is cleared at once, and the loop ends it aborted as it next
    meets it, before a claim, release or ticket could prove a read; a room revoked before its
    publication came is refused when it does; a word that another room holds is left alone."""
    pins = np.zeros(1, dtype=np.int64)
    t = RoomTable(range(0, 1), num_pages=32, pin_seconds=60, pins=pins)
    pub = t.publish(1, np.array([4]))
    t.mark_ready(1, 1)
    t.claim(1, "tok", "d0")
    assert t.proves(1) and not t.unpin_word(1, pub + 1)  # another publication's: left alone
    assert t.unpin_word(1, pub) and not t.proves(1) and pins[0] == 0 and t.live_rooms == 1
    assert not t.unpin_word(1)  # cleared already
    with pytest.raises(ClaimLostError):  # a release would have proved the read: the room ends first
        t.release(1, "tok")
    assert t.live_rooms == 0 and t.state(1).status is RoomStatus.ABORTED

    for room, ask in ((2, "claim"), (3, "ticket")):
        t.publish(room, np.array([5]))
        t.mark_ready(room, 1)
        assert t.unpin_word(room)
        if ask == "claim":
            with pytest.raises(ClaimLostError):
                t.claim(room, "tok2", "d1")
        else:
            assert await t.pin(room, timeout=1) is None
        assert t.live_rooms == 0 and t.state(room).status is RoomStatus.ABORTED

    assert not t.unpin_word(7)  # not published yet: revoked all the same
    with pytest.raises(ConflictError, match="aborted"):
        t.publish(7, np.array([6]))
    assert t.state(7).status is RoomStatus.ABORTED

    t.publish(8, np.array([7]))
    pins[0] = 12345  # the slot handed to another room between the lookup and the compare
    assert not t.unpin_word(8) and pins[0] == 12345


async def test_a_chunked_room_is_pinned_once_its_last_chunk_is_in_not_at_its_first():
    pins = np.zeros(4, dtype=np.int64)
    t = RoomTable(range(0, 2), num_pages=32, pin_seconds=60, pins=pins, on_free=lambda r, p: None)
    t.publish_chunked(1, total_pages=3)
    asking = asyncio.ensure_future(t.pin(1, timeout=5))
    t.add_chunk(1, np.array([4, 5]))
    await asyncio.sleep(0.01)
    assert not asking.done()  # two of three pages: no ticket yet, and no early None either
    t.add_chunk(1, np.array([9]))
    slot, nonce = await asking
    assert pins[slot] == nonce != 0


async def test_an_aborted_room_with_its_ticket_out_clears_its_word_and_count():
    pins = np.zeros(2, dtype=np.int64)
    t = RoomTable(range(0, 1), num_pages=32, pin_seconds=60, pins=pins)
    for room in (1, 2):
        t.publish(room, np.array([room]))
        t.mark_ready(room, 1)
    (s1, n1), (s2, n2) = await t.pin(1, 1), await t.pin(2, 1)
    t.publish(3, np.array([3]))  # no slot left: claims still work, no ticket
    t.mark_ready(3, 1)
    assert await t.pin(3, 1) is None and t.claim(3, A, "d0").status is RoomStatus.READY
    t.abort(1)
    assert pins[s1] == 0 and pins[s2] == n2 and t.tickets_out == 1
    t.publish(4, np.array([6]))  # the freed slot, a fresh nonce
    t.mark_ready(4, 1)
    s4, n4 = await t.pin(4, 1)
    assert s4 == s1 and n4 != n1 and pins[s4] == n4


async def test_a_consumer_that_gives_up_unread_aborts_a_room_nobody_read():
    t, freed = table()
    t.publish(1, np.array([4, 5]))
    t.claim(1, A, "d0")
    reply = t.give_up(1, A)
    assert reply.freed and t.state(1).status is RoomStatus.ABORTED and freed == [(1, [4, 5])]
    assert t.counters.aborted == 1 and t.counters.released == 0  # its prefill hears: not read
    with pytest.raises(ClaimLostError, match="aborted"):
        t.claim(1, B, "d1")


async def test_giving_up_takes_only_a_free_claim_and_never_another_consumers():
    t, freed = table()
    t.publish(2, np.array([4]), consumers=2)
    t.claim(2, A, "d0")
    assert not t.give_up(2, B).freed  # B never reached this rank: one of the free claims ends
    with pytest.raises(RoomClaimedError):
        t.claim(2, C, "d2")  # none left
    with pytest.raises(ClaimLostError):
        t.give_up(2, C)  # nothing of its own to give up: A's claim stays
    assert t.release(2, A).freed and t.state(2).status is RoomStatus.RELEASED  # one consumer read it
    assert t.counters.released == 1 and t.counters.aborted == 0


async def test_a_room_given_up_before_it_was_published_is_refused_when_it_is():
    t, freed = table()
    assert not t.give_up(3, A).freed
    with pytest.raises(ConflictError, match="aborted"):
        t.publish(3, np.array([1]))
    assert freed == []


async def test_a_claim_for_a_group_of_readers_raises_the_rooms_claims_to_that_many():
    t, freed = table()
    t.publish(4, np.array([4, 5]))  # published for one consumer
    t.claim(4, A, "tp0", readers=2)  # a decode of two attention-TP ranks, each reading it whole
    t.claim(4, B, "tp1", readers=2)
    assert not t.release(4, A).freed and t.release(4, B).freed  # freed by the group's last read
    with pytest.raises(UnknownRoomError, match="released"):
        t.claim(4, C, "d2", readers=2)


# ---- a decode's prefix: the pin narrows to what its readers read (`read_from`) ------------------
async def test_every_reader_past_a_prefix_frees_it_at_once_and_the_release_the_rest():
    t, freed = table()
    t.publish(1, np.array([4, 5, 9, 12, 13]), consumers=2)
    t.mark_ready(1, 7)
    t.claim(1, A, "d0", readers=2)
    t.claim(1, B, "d1", readers=2)
    assert t.read_from(1, A, 3) == 0 and freed == []  # the other reader has not said: may read page 0
    assert t.read_from(1, B, 2) == 2  # both said: below the lowest start
    assert freed == [(1, [4, 5])] and t.pinned_pages == 3 and t.counters.freed_ahead == 2
    assert t.state(1).src_pages == [4, 5, 9, 12, 13]  # the room as published: readers index it
    assert not t.release(1, B).freed
    assert freed[1:] == [(1, [9])]  # B read its part: A alone reads, from page 3
    assert t.release(1, A).freed
    assert freed == [(1, [4, 5]), (1, [9]), (1, [12, 13])]  # each page once
    assert t.pinned_pages == 0 and t.counters.released == 1 and t.counters.freed_ahead == 3


async def test_a_reader_with_no_prefix_keeps_the_pin_whole():
    t, freed = table()
    t.publish(1, np.array([4, 5, 9]), consumers=2)
    t.mark_ready(1, 7)
    t.claim(1, A, "d0", readers=2)
    t.claim(1, B, "d1", readers=2)  # B reads from page 0: it says nothing
    t.read_from(1, A, 2)
    assert freed == [] and t.pinned_pages == 3
    t.release(1, A)  # A read: B may still read every page
    assert freed == [] and t.pinned_pages == 3
    assert t.release(1, B).freed and freed == [(1, [4, 5, 9])]


async def test_a_reader_not_claimed_yet_or_a_ticket_keeps_the_pin_whole():
    t, freed = table()
    t.publish(1, np.array([4, 5, 9]), consumers=2)
    t.mark_ready(1, 7)
    t.claim(1, A, "d0")
    t.read_from(1, A, 2)
    assert freed == []  # a second consumer may still claim it and read from page 0
    t.claim(1, B, "d1")
    t.read_from(1, B, 1)
    assert freed == [(1, [4])]
    freed2: list = []
    pins = np.zeros(4, dtype=np.int64)  # with a pin table: the room can be read by a ticket
    t2 = RoomTable(range(3, 7), 32, 60.0, lambda room, pages: freed2.append((room, pages.tolist())), pins)
    t2.publish(2, np.array([4, 5]), consumers=2)
    t2.mark_ready(2, 7)
    t2.claim(2, A, "d0")
    assert await t2.pin(2, 1.0) is not None  # a ticket holds the other claim: it reads from page 0
    t2.read_from(2, A, 1)
    assert freed2 == []


async def test_a_room_narrowed_grants_no_further_claim():
    """Once pages are freed ahead, a claimant that raises the readers could read them: refused."""
    t, freed = table()
    t.publish(1, np.array([4, 5, 9]))
    t.mark_ready(1, 7)
    t.claim(1, A, "d0")
    t.read_from(1, A, 1)
    assert freed == [(1, [4])]
    with pytest.raises(RoomClaimedError, match="first 1 pages were freed"):
        t.claim(1, B, "d1", readers=2)
    assert t.claim(1, A, "d0").room == 1  # the holder's own claim again: idempotent
    assert t.release(1, A).freed and freed == [(1, [4]), (1, [5, 9])]


async def test_a_start_that_is_unknown_late_or_beyond_frees_nothing():
    t, freed = table()
    t.publish(1, np.array([4, 5, 9]))
    t.mark_ready(1, 7)
    t.claim(1, A, "d0")
    with pytest.raises(InvalidPagesError, match="page 4 of its 3"):
        t.read_from(1, A, 4)
    with pytest.raises(ClaimLostError, match="not an open claim"):
        t.read_from(1, B, 1)  # a claim this room never granted
    with pytest.raises(ClaimLostError, match="unknown"):
        t.read_from(7, A, 1)  # a room never published here
    assert freed == []
    t.read_from(1, A, 2)
    with pytest.raises(InvalidPagesError, match="reads from page 2"):
        t.read_from(1, A, 1)  # back below what was freed
    t.read_from(1, A, 2)  # the same again: nothing more
    assert freed == [(1, [4, 5])]
    t.release(1, A)
    with pytest.raises(ClaimLostError, match="released"):
        t.read_from(1, A, 3)  # after the release (the notice came late): the room is gone
    assert freed == [(1, [4, 5]), (1, [9])] and t.counters.freed_ahead == 2


async def test_a_start_after_an_abort_or_an_expiry_frees_nothing_twice():
    t, freed = table(pin=0.0)
    t.publish(1, np.array([4, 5, 9]))
    t.mark_ready(1, 7)
    t.claim(1, A, "d0")
    t.read_from(1, A, 2)
    assert t.abort(1) and freed == [(1, [4, 5]), (1, [9])]  # the abort frees what was still pinned
    with pytest.raises(ClaimLostError, match="aborted"):
        t.read_from(1, A, 2)
    t.publish(2, np.array([6, 7]))
    t.mark_ready(2, 7)
    t.claim(2, B, "d0")
    t.read_from(2, B, 1)
    assert t.expire(time.monotonic() + 1) == [2]
    with pytest.raises(ClaimLostError, match="aborted"):
        t.read_from(2, B, 2)
    assert freed[2:] == [(2, [6]), (2, [7])] and t.counters.expired == 1 and t.counters.aborted == 1


async def test_a_given_up_reader_reads_nothing_more():
    t, freed = table()
    t.publish(1, np.array([4, 5, 9]), consumers=2)
    t.mark_ready(1, 7)
    t.claim(1, A, "d0", readers=2)
    t.claim(1, B, "d1", readers=2)
    t.read_from(1, A, 2)
    t.give_up(1, B)  # B's read failed: only A reads, from page 2
    assert freed == [(1, [4, 5])]
    assert t.release(1, A).freed and freed == [(1, [4, 5]), (1, [9])] and t.counters.released == 1


async def test_chunks_below_every_start_are_freed_as_they_come():
    """SGLang's decode names its pages (and its prefix) before the prefill has sent them."""
    t, freed = table()
    t.publish_chunked(1, total_pages=5)
    t.claim(1, A, "d0")
    t.read_from(1, A, 3)
    assert freed == []
    t.add_chunk(1, np.array([4, 5]))
    assert freed == [(1, [4, 5])] and t.pinned_pages == 0
    t.add_chunk(1, np.array([9, 12]))
    assert freed == [(1, [4, 5]), (1, [9])] and t.pinned_pages == 1
    with pytest.raises(InvalidPagesError, match="page 6 of its 5"):
        t.read_from(1, A, 6)
    t.add_chunk(1, np.array([13]), aux=b"x")
    assert t.state(1).src_pages == [4, 5, 9, 12, 13] and t.state(1).status is RoomStatus.READY
    assert t.release(1, A).freed and freed[2:] == [(1, [12, 13])] and t.counters.freed_ahead == 3


async def test_a_room_is_being_read_while_a_ticket_is_out_or_a_claim_open():
    """What drives an owner fast over TCP: a ticket out, or a claim open on something written."""
    pins = np.zeros(2, dtype=np.int64)
    t = RoomTable(range(0, 1), num_pages=32, pin_seconds=60, pins=pins)
    t.publish(1, np.array([4]))
    assert not t.being_read  # published, nobody reading yet
    t.mark_ready(1, 1)
    slot, nonce = await t.pin(1, 1)
    assert t.being_read
    assert t.release_ticket(1, slot, nonce) and not t.being_read
    t.publish(2, np.array([5]))
    t.claim(2, A, "d0")
    assert not t.being_read  # claimed ahead of its prefill: nothing to read yet
    t.mark_ready(2, 1)
    assert t.being_read
    t.release(2, A)
    assert not t.being_read
    t.publish_chunked(3, total_pages=2)
    t.claim(3, A, "d0")
    assert not t.being_read
    t.add_chunk(3, np.array([6]))
    assert t.being_read  # its first chunk may be read as it comes
