"""The gather lane's host logic, without a GPU: how a plan is cut into launches, the
waiting thread that turns a launch's end into a future of the loop, and a ticket's read
launched before its bookkeeping (over the fakes of tests/fakes/)."""

import asyncio
import contextlib
import threading
import time

import msgspec
import numpy as np
import pytest

from pdkv.errors import ClaimLostError, ClosedError, MetadataError, PageRangeError
from tests.fakes.lane import FakeBatch
from tests.fakes.memory import LAYERS, NUM_PAGES, PAGE, ROOM, SPANS, expected
from tests.fakes.world import SLOT, assert_nothing_after, nonce, reported, settle, ticket_world
from transfer.decode.tasks import to_the_end
from transfer.lanes.cuda_ipc.gather import Gatherer, _polled, _Waiter, launch_split
from transfer.lanes.runs import check_pages
from transfer.metadata import TicketRelease
from transfer.timeouts import CALLER_YIELD_SECONDS


def test_launch_split_takes_the_fewest_ids_that_hold_a_plan_else_several_launches():
    caps = (1012, 8179)  # two tiers of a launch's page ids
    assert launch_split(128, 1, caps) == (1012, 128)  # 8k tokens: 256 ids, the small launch
    assert launch_split(506, 1, caps) == (1012, 506)
    assert launch_split(507, 1, caps) == (8179, 507)  # one more page: the large one
    assert launch_split(512, 4, caps) == (8179, 512)  # five lists of ids a page
    assert launch_split(5000, 1, caps) == (8179, 4089)  # two launches
    assert launch_split(5000, 1, caps[:1]) == (1012, 506)  # a driver without large parameters
    assert launch_split(100_000, 1, (1 << 20,)) == (1 << 20, 65535)  # the grid's limit
    assert launch_split(1, 1, caps) == (1012, 1)


class _Kernel:
    def __init__(self, fails: bool = False) -> None:
        self.fails = fails

    def make_current(self) -> None:
        if self.fails:
            raise RuntimeError("no context on this thread")


class _Launch:
    def __init__(self, seconds: float | None = 0.25, error: Exception | None = None) -> None:
        self._seconds, self._error = seconds, error

    def wait(self) -> None:
        if self._error is not None:
            raise self._error

    def seconds(self) -> float | None:
        return self._seconds


async def test_waiter_resolves_each_launch_with_its_seconds_in_order_and_errors_as_raised():
    waiter = _Waiter(_Kernel())
    try:
        ok = [waiter.ended(_Launch(0.1 * i)) for i in range(5)]
        bad = waiter.ended(_Launch(error=RuntimeError("cudaErrorIllegalAddress")))
        after = waiter.ended(_Launch(7.0))  # the thread survives a failed wait
        assert await asyncio.wait_for(asyncio.gather(*ok), 10) == [0.1 * i for i in range(5)]
        with pytest.raises(RuntimeError, match="IllegalAddress"):
            await asyncio.wait_for(bad, 10)
        assert await asyncio.wait_for(after, 10) == 7.0
        assert await asyncio.wait_for(waiter.ended(_Launch(None)), 10) is None  # an untimed launch
    finally:
        waiter.close()


async def test_waiter_without_a_context_fails_every_wait_rather_than_leaving_it_pending():
    waiter = _Waiter(_Kernel(fails=True))
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="no context"):
                await asyncio.wait_for(waiter.ended(_Launch()), 10)
    finally:
        waiter.close()


async def test_waiter_closed_refuses_new_waits_and_still_ends_those_queued_before():
    waiter = _Waiter(_Kernel())
    queued = waiter.ended(_Launch(0.5))
    waiter.close()
    assert await asyncio.wait_for(queued, 10) == 0.5
    with pytest.raises(ClosedError):
        waiter.ended(_Launch())


def test_waiter_outlives_a_loop_closed_before_its_launch_ended():
    """A wake for a loop that is gone must not end the thread: later waits still resolve."""
    waiter = _Waiter(_Kernel())
    gate = threading.Event()

    class _Slow(_Launch):
        def wait(self) -> None:
            gate.wait(10)

    try:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(_start(waiter, _Slow()))
        loop.close()
        gate.set()  # its wake now meets a closed loop
        assert asyncio.run(_wait(waiter, _Launch(2.0))) == 2.0
    finally:
        waiter.close()


async def _start(waiter: _Waiter, launch: _Launch) -> None:
    waiter.ended(launch)


async def _wait(waiter: _Waiter, launch: _Launch) -> float:
    return await asyncio.wait_for(waiter.ended(launch), 10)


class _Watch:
    def __init__(self, told: bool = True, fails: bool = False) -> None:
        self.told, self.fails = told, fails
        self.at: list[tuple[float, str]] = []

    def landed(self) -> bool:
        self.at.append((time.perf_counter(), threading.current_thread().name))
        if self.fails:
            raise RuntimeError("a watch that breaks its promise")
        return self.told


async def test_a_watch_is_told_on_the_waiting_thread_and_a_told_caller_goes_first():
    """The waiting thread tells the watch as the kernel ends, before the loop hears; once the
    caller was told, the loop hears `CALLER_YIELD_SECONDS` later (its continuation would hold the
    interpreter lock as the caller looks), and the launch's end is stamped before that."""
    waiter = _Waiter(_Kernel())
    try:
        for told in (True, False):
            watch, launch = _Watch(told), _Launch(None)
            assert await asyncio.wait_for(waiter.ended(launch, watch), 10) is None
            heard = time.perf_counter()
            ((at, thread),) = watch.at
            assert thread == "pdkv-gather-wait"
            assert launch.ended_at <= at  # stamped before the watch, not at the loop's wake-up
            if told:
                assert heard - at >= CALLER_YIELD_SECONDS
    finally:
        waiter.close()


async def test_a_watch_that_raises_does_not_end_the_waiting_thread():
    waiter = _Waiter(_Kernel())
    try:
        watch = _Watch(fails=True)
        assert await asyncio.wait_for(waiter.ended(_Launch(0.5), watch), 10) == 0.5  # heard at once
        assert watch.at
        assert await asyncio.wait_for(waiter.ended(_Launch(2.0)), 10) == 2.0  # later launches still end
    finally:
        waiter.close()


class _Polled(_Launch):
    """A launch that has ended once asked `after` times (`passed`), or whose asking fails."""

    def __init__(self, after: int, error: Exception | None = None) -> None:
        super().__init__(0.5)
        self.after, self.asked, self.passed_error = after, 0, error
        self.ended_at = 0.0

    def passed(self) -> bool:
        self.asked += 1
        if self.passed_error is not None:
            raise self.passed_error
        return self.asked > self.after


async def test_a_polling_loop_sees_the_end_between_its_turns_and_keeps_serving():
    """The loop asks between its turns: other tasks run meanwhile, and the end is stamped
    when it is seen."""
    waiter = _Waiter(_Kernel())
    try:
        turns = 0

        async def other() -> None:
            nonlocal turns
            for _ in range(5):
                turns += 1
                await asyncio.sleep(0)

        launch = _Polled(after=20)
        seen, _ = await asyncio.gather(_polled(launch, waiter), other())  # type: ignore[arg-type]
        assert seen == 0.5 and launch.asked == 21 and turns == 5
        assert launch.ended_at > 0
        with pytest.raises(RuntimeError, match="IllegalAddress"):  # a sticky error is the read's
            await _polled(_Polled(0, RuntimeError("cudaErrorIllegalAddress")), waiter)  # type: ignore[arg-type]
    finally:
        waiter.close()


async def test_a_cancelled_poll_returns_only_once_the_kernel_has_ended():
    """No byte after the caller moved on: cancelled mid-poll, the read waits for the kernel."""
    waiter = _Waiter(_Kernel())
    gate = threading.Event()
    waited: list[float] = []

    class _Slow(_Polled):
        def wait(self) -> None:
            gate.wait(10)
            waited.append(time.perf_counter())

    try:
        task = asyncio.ensure_future(_polled(_Slow(after=10**9), waiter))  # type: ignore[arg-type]
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting for the kernel
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        assert waited and waited[0] <= time.perf_counter()
    finally:
        waiter.close()


# ---- a ticket's read launched first (`TicketProtocol.launch`, then `land` or `abandon`) ---------


class _LaunchingBatch(FakeBatch):
    """A batch launched by a call, as the GPU lane's `GatherBatch.start`: its copy runs from
    then on as a task, as a kernel does, whatever its caller does meanwhile."""

    def start(self, src, dst, dst_below, watch=None):  # type: ignore[no-untyped-def]
        check_pages(src, NUM_PAGES, "source")
        self.lane.timeline.add("launch")
        return asyncio.ensure_future(self.lane.read_batch(self, src, dst, dst_below, watch))

    async def landed(self, started, watch=None):  # type: ignore[no-untyped-def]
        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:
            await self.settle(started)
            raise

    async def settle(self, started):  # type: ignore[no-untyped-def]
        with contextlib.suppress(Exception):  # the copy's failure: the read has failed already
            await to_the_end(started)


async def _cancelled_twice_after_the_copy(w, work, gate: asyncio.Event) -> None:  # type: ignore[no-untyped-def]
    """Run `work`, cancel it twice while the copy is held, then let the copy end: the cancel
    reaches the caller only after it, and nothing lands after that outcome."""
    task = asyncio.create_task(reported(w, work))
    for _ in range(2):
        await settle(5)
        task.cancel()
    await settle(5)
    assert not task.done()  # the copy is still running
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_nothing_after(w, w.timeline.first("outcome"))


async def _launching(merged=(0, 1, 2)):  # type: ignore[no-untyped-def]
    w, ucx, tickets, ticket = await ticket_world(merged=merged, mapped=(0, 1, 2))
    w.merging.batch = lambda peers: _LaunchingBatch(w.merging, peers)  # type: ignore[method-assign]
    gate = asyncio.Event()
    for cp in SPANS:
        w.merging.gates[cp] = gate
    return w, ucx, tickets, ticket, gate


async def test_a_ticket_read_is_launched_before_its_bookkeeping_and_proved_after_its_data():
    w, ucx, tickets, ticket, gate = await _launching()
    express = tickets.launch(w.owners, ticket, w.dst)
    assert express is not None and w.timeline.where("launch")  # out before the caller first awaits
    read = asyncio.create_task(reported(w, tickets.land(express, w.job())))
    await settle(5)
    assert not read.done()
    gate.set()
    result = await read
    outcome = w.timeline.first("outcome")
    await settle(5)
    t = w.timeline
    assert all(t.last("landed", cp) < t.first("pin_word", cp) < outcome < t.first("notify") for cp in SPANS)
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))
    assert result.nbytes == LAYERS * len(w.dst) * PAGE and [s.cp_rank for s in result.owners] == list(SPANS)
    assert ucx.releases() == {cp: TicketRelease(room=ROOM, slot=SLOT, nonce=nonce(cp)) for cp in SPANS}


async def test_a_bad_source_id_or_another_incarnation_launches_nothing():
    w, _, tickets, ticket, _ = await _launching()
    bad = msgspec.structs.replace(ticket, src_pages=[*ticket.src_pages[:-1], NUM_PAGES + 3])
    with pytest.raises(PageRangeError):
        tickets.launch(w.owners, bad, w.dst)
    pins = [msgspec.structs.replace(p, incarnation="restarted") for p in ticket.pins]
    assert tickets.launch(w.owners, msgspec.structs.replace(ticket, pins=pins), w.dst) is None
    short = msgspec.structs.replace(ticket, src_pages=ticket.src_pages[:-1])
    with pytest.raises(MetadataError):
        tickets.launch(w.owners, short, w.dst)
    assert not w.timeline.where("launch") and not w.timeline.where("read")
    w2, _, tickets2, ticket2, _ = await _launching(merged=(0, 2))  # not every owner on one batch: the usual path
    assert tickets2.launch(w2.owners, ticket2, w2.dst) is None and not w2.timeline.where("launch")


async def test_a_fetch_failing_between_launch_and_land_reports_only_once_its_read_ended_and_gives_the_room_up():
    w, ucx, tickets, ticket, gate = await _launching()
    express = tickets.launch(w.owners, ticket, w.dst)
    assert express is not None
    abandoned = asyncio.create_task(reported(w, tickets.abandon(express)))
    await settle(5)
    assert not abandoned.done() and not ucx.notified  # the read is still copying
    gate.set()
    await abandoned
    assert_nothing_after(w, w.timeline.first("outcome"))
    assert ucx.releases() == {cp: TicketRelease(room=ROOM, slot=SLOT, nonce=nonce(cp)) for cp in SPANS}  # given up
    await tickets.abandon(express)  # once only
    assert len(ucx.notified) == len(SPANS)


async def test_a_launch_whose_fetch_was_refused_for_its_own_pages_ends_before_the_refusal_and_keeps_the_room():
    """`abandon(give_up=False)`: the fetch's destination ids repeat (found once the read was
    out): it raises only after the copy, and the room stays pinned for a fetch with good pages."""
    w, ucx, tickets, ticket, gate = await _launching()
    express = tickets.launch(w.owners, ticket, w.dst)
    assert express is not None
    withdrawn = asyncio.create_task(reported(w, tickets.abandon(express, give_up=False)))
    await settle(5)
    assert not withdrawn.done()  # the read is still copying
    gate.set()
    await withdrawn
    assert_nothing_after(w, w.timeline.first("outcome"))
    await settle(5)
    assert not ucx.notified  # not given up: the ticket's pins still hold the room
    again = tickets.launch(w.owners, ticket, w.dst)
    assert again is not None
    result = await tickets.land(again, w.job())
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))
    assert result.nbytes == LAYERS * len(w.dst) * PAGE


async def test_a_fetch_cancelled_while_it_waits_for_an_abandoned_launch_still_waits_for_the_copy():
    """`abandon` outlasts its caller's cancels (two of them here): a cancelled fetch's outcome
    must not come before the copy it launched has ended."""
    w, _, tickets, ticket, gate = await _launching()
    express = tickets.launch(w.owners, ticket, w.dst)
    assert express is not None
    await _cancelled_twice_after_the_copy(w, tickets.abandon(express, give_up=False), gate)


async def test_a_launched_read_whose_pin_word_was_cleared_fails_and_a_cancel_waits_for_the_copy():
    w, ucx, tickets, ticket, gate = await _launching()
    w.owners[1].pins.words[SLOT] = 0  # type: ignore[union-attr]
    express = tickets.launch(w.owners, ticket, w.dst)
    assert express is not None
    gate.set()
    with pytest.raises(ClaimLostError, match="cp rank 1 "):
        await reported(w, tickets.land(express, w.job()))
    assert_nothing_after(w, w.timeline.first("outcome"))
    assert len(ucx.releases()) == len(SPANS)  # given up at once

    w, ucx, tickets, ticket, gate = await _launching()
    express = tickets.launch(w.owners, ticket, w.dst)
    assert express is not None
    read = asyncio.create_task(reported(w, tickets.land(express, w.job())))
    await settle(5)
    read.cancel()
    await settle(5)
    assert not read.done()  # the copy is still running: the cancel waits for it
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert_nothing_after(w, w.timeline.first("outcome"))


async def test_a_prepared_read_launched_before_its_checks_is_read_by_its_launch_and_proved_after_its_data():
    """A room claimed whole (SGLang's receiver, `RoomLease.read_once`) launches once its
    destination ids are bounded; `read` then takes that launch over rather than launching again."""
    w, ucx, tickets, ticket, gate = await _launching()
    prepared = tickets.prepare(w.owners, ticket)
    early = tickets.launch_prepared(prepared, w.dst, skip=0)
    assert early is not None and w.timeline.where("launch")  # out before the caller first awaits
    read = asyncio.create_task(reported(w, tickets.read(prepared, w.job(), early=early)))
    await settle(5)
    assert not read.done()
    gate.set()
    result = await read
    t = w.timeline
    assert len(t.where("launch")) == 1
    assert all(t.last("landed", cp) < t.first("pin_word", cp) < t.first("outcome") for cp in SPANS)
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))
    assert result.nbytes == LAYERS * len(w.dst) * PAGE
    await tickets.settle(prepared, early)  # taken over by `read`: nothing left to wait for
    assert len(t.where("launch")) == 1


async def test_a_prepared_read_refused_after_its_launch_outlasts_cancels_and_a_bad_source_id_launches_nothing():
    w, _, tickets, ticket, gate = await _launching()
    prepared = tickets.prepare(w.owners, ticket)
    bad = tickets.prepare(w.owners, msgspec.structs.replace(ticket, src_pages=[*ticket.src_pages[:-1], NUM_PAGES]))
    with pytest.raises(PageRangeError):
        tickets.launch_prepared(bad, w.dst, skip=0)
    assert tickets.launch_prepared(prepared, w.dst[1:], skip=0) is None  # too few: the read's check says so
    assert not w.timeline.where("launch")
    early = tickets.launch_prepared(prepared, w.dst, skip=0)
    assert early is not None
    await _cancelled_twice_after_the_copy(w, tickets.settle(prepared, early), gate)
    w2, _, tickets2, ticket2, _ = await _launching(merged=(0, 2))  # not every owner on one batch
    assert tickets2.launch_prepared(tickets2.prepare(w2.owners, ticket2), w2.dst, skip=0) is None


class _Held:
    """A launch whose kernel runs until `release` is set (from any thread); `fail`: its end
    event then raises, as a sticky CUDA error does."""

    ended_at = launched = 0.0

    def __init__(self, release: threading.Event, fail: bool = False) -> None:
        self.release, self.fail, self.ended = release, fail, False

    def wait(self) -> None:
        self.release.wait(10)
        self.ended = True
        if self.fail:
            raise RuntimeError("sticky CUDA error")

    def passed(self) -> bool:
        return self.ended

    def seconds(self) -> float:
        return 0.1


def _gatherer_of(waiter: _Waiter) -> Gatherer:
    gatherer = object.__new__(Gatherer)
    gatherer.poll, gatherer._waiter, gatherer._spare = False, waiter, []
    return gatherer


async def test_a_launch_awaited_by_the_lanes_thread_ends_before_a_cancelled_caller_hears_even_cancelled_twice():
    """`Gatherer.landed` (its waiting thread's path) and `settle`: a caller cancelled while the
    kernel runs, and again while it waits for its end, hears the cancel only after the end."""
    release = threading.Event()
    gatherer = _gatherer_of(_Waiter(type("K", (), {"make_current": lambda self: None})()))
    try:
        for wait in (gatherer.landed, gatherer.settle):
            release.clear()
            task = asyncio.create_task(wait(_Held(release)))  # type: ignore[arg-type]
            for _ in range(2):
                await asyncio.sleep(0.01)
                task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done(), wait  # the kernel has not ended
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        release.set()
        gatherer._waiter.close()


@pytest.mark.parametrize("wait", ["landed", "settle"])
async def test_a_waiting_thread_that_cannot_wait_leaves_the_wait_to_the_callers_thread(wait: str):
    """The waiting thread could not make the GPU's context current, so it fails every wait at
    once: the caller still hears its outcome only after the kernel's end (waited for on its own
    thread, which launched it), not as soon as the waiting thread gave up."""

    def no_context(self: object) -> None:
        raise RuntimeError("cuCtxSetCurrent failed")

    release = threading.Event()
    launch = _Held(release)
    gatherer = _gatherer_of(_Waiter(type("K", (), {"make_current": no_context})()))
    threading.Timer(0.2, release.set).start()
    try:
        if wait == "landed":
            with pytest.raises(RuntimeError, match="cuCtxSetCurrent"):
                await gatherer.landed(launch)  # type: ignore[arg-type]
        else:
            await gatherer.settle(launch)  # type: ignore[arg-type]
        assert launch.ended
    finally:
        release.set()
        gatherer._waiter.close()


async def test_a_closed_lanes_wait_raises_nothing_of_the_kernels_and_a_cancel_stays_a_cancel():
    """Where the waiting thread is gone the end is waited for on the caller's thread; a sticky
    CUDA error then is the read's failure already: `settle` raises nothing, and a cancelled
    read raises its cancel (a timeout around it turns that into its own error)."""
    release = threading.Event()
    release.set()
    gatherer = _gatherer_of(_Waiter(type("K", (), {"make_current": lambda self: None})()))
    gatherer._waiter.close()
    launch = _Held(release, fail=True)
    await gatherer.settle(launch)  # type: ignore[arg-type]
    assert launch.ended
    held = threading.Event()
    threading.Timer(0.2, held.set).start()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(_polled(_Held(held, fail=True), gatherer._waiter), 0.05)  # type: ignore[arg-type]
    assert held.is_set()  # the timeout was heard once the kernel had ended
