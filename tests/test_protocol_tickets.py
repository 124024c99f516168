"""The decode's ticket protocol (`transfer/decode/tickets.py`) and its landings, over the fakes of tests/fakes/."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
import pytest

from pdkv.errors import ClaimLostError, ClosedError, PeerLostError
from tests.fakes.memory import LAYERS, PAGE, ROOM, SPANS, expected
from tests.fakes.world import (
    SLOT,
    World,
    assert_nothing_after,
    nonce,
    pin_checks,
    pin_table,
    reported,
    settle,
    ticket_world,
    until,
)
from transfer.deadline import Deadline
from transfer.decode.landing import Landing
from transfer.decode.tasks import Fetch
from transfer.decode.tickets import TicketProtocol
from transfer.metadata import TicketRelease
from transfer.results import FetchResult

# ---- 6. tickets ------------------------------------------------------------------------------------


async def test_ticket_reads_every_owner_at_once_then_proves_each_pin() -> None:
    w, ucx, tickets, ticket = await ticket_world(mapped=(0, 1))
    for cp in SPANS:
        w.lane.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, tickets.fetch(w.owners, ticket, w.job())))
    await until(lambda: w.lane.in_flight == 3, "every read started")
    assert not w.timeline.where("landed")  # all three reads started before any completed
    for cp in (2, 0, 1):  # completions in an order of the test's choosing
        w.lane.gates[cp].set()
        await settle(5)
    result = await fetch
    outcome = w.timeline.first("outcome")
    await settle(5)

    t = w.timeline
    for cp in SPANS:
        (check,) = pin_checks(t, cp)
        assert t.last("landed", cp) < check < outcome  # each pin word after its own data
    assert t.where("pin_read", 2) and not t.where("pin_word", 2)  # rank 2's table is not mapped here
    assert ucx.releases() == {cp: TicketRelease(room=ROOM, slot=SLOT, nonce=nonce(cp)) for cp in SPANS}
    assert t.first("notify") > outcome  # released only after the fetch returned to its caller
    assert not w.client.requests  # a ticket asks nobody
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))
    assert result.control_messages == 0 and not result.freed
    assert result.nbytes == LAYERS * len(w.dst) * PAGE
    assert [(s.cp_rank, s.layers) for s in result.owners] == [(cp, (s.start, s.stop)) for cp, s in SPANS.items()]


async def test_ticket_releases_wait_out_their_delay_unless_flushed() -> None:
    w, ucx, _, ticket = await ticket_world()
    tickets = TicketProtocol(w.ctx, ucx, release_delay=0.2)
    await tickets.fetch(w.owners, ticket, w.job())
    await settle(20)
    assert not ucx.notified  # a caller on another thread sees the outcome first
    await asyncio.sleep(0.3)
    assert set(ucx.releases()) == set(SPANS)
    tickets.releases.close()  # no owner here clears a word: its releases would be sent again

    ucx.notified.clear()
    tickets = TicketProtocol(w.ctx, ucx, release_delay=60)
    await tickets.fetch(w.owners, ticket, w.job())
    tickets.flush()  # the fetcher closes: nothing may be left to the pins' expiry
    assert set(ucx.releases()) == set(SPANS)
    tickets.flush()
    assert len(ucx.notified) == len(SPANS)  # sent once


@pytest.mark.parametrize("mapped", [(0, 1, 2), ()], ids=["mapped", "read"])
async def test_ticket_cleared_pin_word_fails_and_releases_at_once(mapped: tuple[int, ...]) -> None:
    w, ucx, tickets, ticket = await ticket_world(mapped=mapped)
    if 1 in mapped:
        w.owners[1].pins.words[SLOT] = 0  # type: ignore[union-attr]
    else:
        ucx.words[pin_table(1).addr + 8 * SLOT] = 0
    w.lane.gates[2] = asyncio.Event()  # rank 2 still reading when rank 1's pin fails
    with pytest.raises(ClaimLostError, match="cp rank 1 "):
        await reported(w, tickets.fetch(w.owners, ticket, w.job()))
    outcome = w.timeline.first("outcome")

    t = w.timeline
    assert t.first("read_cancelled", (2,)) < t.first("notify") < outcome  # released at once, reads ended
    assert ucx.releases() == {cp: TicketRelease(room=ROOM, slot=SLOT, nonce=nonce(cp)) for cp in SPANS}
    assert_nothing_after(w, outcome)
    await settle(5)
    assert len(ucx.notified) == 3  # and once only


async def test_ticket_merged_lane_reads_its_owners_in_one_call() -> None:
    w, ucx, tickets, ticket = await ticket_world(merged=(0, 1, 2), mapped=(0, 1, 2))
    merging = w.merging
    result = await reported(w, tickets.fetch(w.owners, ticket, w.job()))
    outcome = w.timeline.first("outcome")
    await settle(5)

    assert merging.batch_calls == [(0, 1, 2)] and not merging.reads and not w.lane.reads
    t = w.timeline
    for cp in SPANS:
        assert t.last("landed", cp) < t.first("pin_word", cp) < outcome < t.first("notify")
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))
    assert [(s.cp_rank, s.layers, s.nbytes, s.lane) for s in result.owners] == [
        (cp, (s.start, s.stop), len(s) * PAGE * len(w.dst), "merging") for cp, s in SPANS.items()
    ]
    assert result.nbytes == LAYERS * len(w.dst) * PAGE
    assert len(ucx.notified) == 3


async def landed_read(
    aux: bytes | None = None, before_the_data: Callable[[World], None] | None = None
) -> tuple[World, Landing, asyncio.Task[FetchResult]]:
    """A merged read of every owner (pin tables mapped) with a landing, stopped where its
    bytes have landed and the lane has told the landing, but its task has not heard yet (a
    GPU kernel that has passed). `before_the_data` runs while the read is in flight."""
    w, ucx, _, ticket = await ticket_world(merged=(0, 1, 2), mapped=(0, 1, 2))
    tickets = TicketProtocol(w.ctx, ucx, release_delay=60)  # a synchronous caller's
    merging, landing = w.merging, Landing()
    merging.gates[0], merging.heard = asyncio.Event(), asyncio.Event()
    job = Fetch("e0", ROOM, w.dst, Deadline.after(300), time.perf_counter(), landing)
    read = asyncio.create_task(reported(w, tickets.read(tickets.prepare(w.owners, ticket, aux), job)))
    await until(lambda: merging.in_flight == 1, "the read launched")
    assert landing.proved_result() is None  # launched, not landed
    if before_the_data is not None:
        before_the_data(w)
    merging.gates[0].set()
    await until(lambda: w.timeline.where("told"), "the lane told the landing")
    return w, landing, read


async def test_a_landing_holds_a_merged_reads_result_before_its_task_hears_and_the_proof_is_made_once() -> None:
    w, landing, read = await landed_read(aux=b"first token")
    seen = landing.proved_result()  # as a scheduler's poll finds it, before the decode's loop hears of the landing
    assert seen is not None and not read.done() and w.timeline.where("told", True)
    assert (seen.room, seen.nbytes, seen.aux) == (ROOM, LAYERS * len(w.dst) * PAGE, b"first token")
    t = w.timeline
    assert all(t.last("landed", cp) < t.first("pin_word", cp) < t.first("told") for cp in SPANS)  # after the data
    src = np.asarray(w.fake[0].src_pages)
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, src)))
    for o in w.owners.values():  # the room ends on its owners after it was proved: too late to matter
        o.pins.words.clear()  # type: ignore[union-attr]
    w.merging.heard.set()
    result = await read
    assert len(t.where("pin_word")) == len(SPANS)  # proved once, by the lane's thread; the task followed it
    assert result is seen  # one result, timed where it was proved
    await settle(5)
    assert t.where("notify", tuple(SPANS))  # released at once: the caller was told before the loop heard


def _abort_on_cp1(w: World) -> None:
    w.owners[1].pins.words.clear()  # type: ignore[union-attr]


async def test_a_landing_whose_pin_word_was_cleared_during_the_read_never_holds_a_result() -> None:
    w, landing, read = await landed_read(before_the_data=_abort_on_cp1)
    assert w.timeline.where("told", False) and landing.proved_result() is None  # refused: nothing for the caller
    w.merging.heard.set()
    with pytest.raises(ClaimLostError):
        await read
    assert len(w.timeline.where("pin_word", 1)) == 1  # the task took the lane thread's verdict
    assert landing.proved_result() is None


def _forget_cp1(w: World) -> None:
    owner = w.owners[1]
    owner.pins.close()  # type: ignore[union-attr]  # as `Owners` forgets an engine (another fetch lost its peer)
    owner.pins = None


async def test_a_landed_read_whose_owner_was_forgotten_meanwhile_fails_typed() -> None:
    """An owner forgotten while the kernel ran (its table dropped) cannot be proved by a
    load: neither the lane's thread nor the loop passes the read."""
    w, landing, read = await landed_read(before_the_data=_forget_cp1)
    assert w.timeline.where("told", False) and landing.proved_result() is None
    w.merging.heard.set()
    with pytest.raises(PeerLostError, match="cp rank 1"):
        await read


async def test_ticket_merged_and_plain_lanes_read_at_once() -> None:
    w, ucx, tickets, ticket = await ticket_world(merged=(0, 2), mapped=(0, 2))
    merging = w.merging
    for cp in SPANS:
        w.lane.gates[cp] = merging.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, tickets.fetch(w.owners, ticket, w.job())))
    await until(lambda: merging.in_flight == 1 and w.lane.in_flight == 1, "both reads started")
    assert not w.timeline.where("landed")
    for gate in merging.gates.values():
        gate.set()
    result = await fetch

    assert merging.batch_calls == [(0, 2)] and w.lane.reads == [(1, SPANS[1])]
    assert [s.cp_rank for s in result.owners] == [0, 1, 2]
    assert [s.lane for s in result.owners] == ["merging", "fake", "merging"]
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))


async def test_ticket_cancel_all_raises_closed_and_releases() -> None:
    w, ucx, tickets, ticket = await ticket_world()
    for cp in SPANS:
        w.lane.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, tickets.fetch(w.owners, ticket, w.job())))
    await until(lambda: w.lane.in_flight == 3, "every read started")
    w.ctx.tasks.cancel_all()
    with pytest.raises(ClosedError):
        await fetch
    outcome = w.timeline.first("outcome")
    assert_nothing_after(w, outcome)
    assert w.timeline.first("notify") < outcome and len(ucx.notified) == 3
