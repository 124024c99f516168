"""The synchronous surface (transfer.sync): a scheduler-like loop drives an exporter and a
fetcher that run on pdkv's own threads, with real UCX between them."""

import threading
import time

import numpy as np
import pytest
import torch

from pdkv import ClosedError, ConflictError, DSAKVPool, RoomClaimedError, UnknownRoomError, tiny
from transfer.metadata import RoomTicket
from transfer.registry.server import RegistryServer
from transfer.sync import BackgroundLoop, HandleStatus, SyncExporter, SyncFetcher


def _until_done(handle, within: float = 30.0):
    """Poll as a scheduler would: one non-blocking look per iteration."""
    end = time.monotonic() + within
    while handle.poll() is HandleStatus.PENDING:
        assert time.monotonic() < end, "not done in time"
        time.sleep(0.001)  # the scheduler's other work
    return handle


@pytest.fixture
def registry_url():
    loop = BackgroundLoop("test-registry")
    server = RegistryServer()
    url = loop.run(server.start(), 10)
    yield url
    loop.run(server.aclose(), 10)
    loop.stop()


def test_a_scheduler_loop_exports_and_fetches_without_blocking(registry_url):
    layout = tiny(layer_num=5)
    src = DSAKVPool(layout)
    src.slab.view(-1).copy_(torch.arange(src.slab.nbytes) % 241)
    exporter = SyncExporter(src, "sync0", 0, 1, registry_url)
    fetcher = SyncFetcher(DSAKVPool(layout), registry_url, ucx_workers=1)
    try:
        pages = np.array([7, 3, 12, 5])
        assert _until_done(exporter.publish_room(1, pages)).poll() is HandleStatus.DONE
        done = fetcher.fetch("sync0", 1, [2, 9, 4, 30])  # by claims: starts before layers are ready
        for layer in range(layout.layer_num):
            exporter.mark_ready(1, layer + 1)
        result = _until_done(done).result()
        assert result.nbytes == 4 * layout.layer_num * (layout.kv_page_bytes + layout.index_page_bytes)
        dst = fetcher.fetcher.pool
        for layer in range(layout.layer_num):
            for a, b in (
                (dst.kv_buffer[layer], src.kv_buffer[layer]),
                (dst.index_buffer[layer], src.index_buffer[layer]),
            ):
                rows_a, rows_b = (
                    a.view(torch.uint8).reshape(layout.num_pages, -1),
                    b.view(torch.uint8).reshape(layout.num_pages, -1),
                )
                assert torch.equal(rows_a[[2, 9, 4, 30]], rows_b[[7, 3, 12, 5]])
        again = _until_done(fetcher.fetch("sync0", 1, [2, 9, 4, 30]))
        # Typed, through the handle: claimed (its release by notification still on its way) or released.
        assert isinstance(again.exception(), (RoomClaimedError, UnknownRoomError))

        assert _until_done(exporter.publish_room(2, pages)).poll() is HandleStatus.DONE
        for layer in range(layout.layer_num):
            exporter.mark_ready(2, layer + 1)
        pin = _until_done(exporter.pin(2)).result()
        ticket = RoomTicket(engine_id="sync0", room=2, src_pages=pages.tolist(), pins=[pin])
        assert _until_done(exporter.publish_chunked(3, 4)).poll() is HandleStatus.DONE
        chunked = fetcher.fetch("sync0", 3, [50, 51, 52, 53])
        for chunk in (pages[:3], pages[3:]):
            assert _until_done(exporter.add_chunk(3, chunk)).poll() is HandleStatus.DONE
        assert _until_done(chunked).result().nbytes == result.nbytes  # a chunked room, same pages

        called = threading.Event()
        handle = fetcher.fetch("sync0", 2, [40, 41, 42, 43], ticket=ticket)
        handle.on_done(lambda h: called.set())
        assert _until_done(handle).result().control_messages == 0
        assert called.wait(5)  # the callback ran (on pdkv's thread)
    finally:
        fetcher.close()
        exporter.close()
    with pytest.raises(ClosedError):
        fetcher.fetch("sync0", 3, [1])  # closed: refused at once


def test_misuse_gets_typed_errors_and_leaves_no_thread(registry_url):
    """Every call after close raises ClosedError; a failed construction stops its thread;
    a close from a handle's callback (pdkv's own thread) returns at once."""
    layout = tiny(layer_num=3)
    before = threading.active_count()
    for _ in range(5):
        with pytest.raises(ValueError, match="lane"):
            SyncFetcher(DSAKVPool(layout), registry_url, lane="bogus")
    assert threading.active_count() == before  # no loop thread outlived its failed start

    exporter = SyncExporter(DSAKVPool(layout), "misuse0", 0, 1, registry_url)
    exporter.close()
    for call in (
        lambda: exporter.mark_ready(1, 1),
        lambda: exporter.abort_room(1),
        lambda: exporter.publish_room(1, np.array([1])),
        lambda: exporter.pin(1),
    ):
        with pytest.raises(ClosedError):
            call()

    fetcher = SyncFetcher(DSAKVPool(layout), registry_url, ucx_workers=1)
    closed, returned = threading.Event(), []

    def close_inside(handle):
        t0 = time.monotonic()
        fetcher.close()
        returned.append(time.monotonic() - t0)
        closed.set()

    fetcher.fetch("nobody", 1, [1], timeout=0.2).on_done(close_inside)
    assert closed.wait(30) and returned[0] < 1.0  # not its 30 s join timeout
    end = time.monotonic() + 30
    while threading.active_count() > before and time.monotonic() < end:
        time.sleep(0.05)
    assert threading.active_count() == before  # the loop's thread ended behind the close
    with pytest.raises(ClosedError):
        fetcher.fetch("nobody", 1, [1])


def test_a_cancelled_handle_stays_pending_until_its_task_has_ended():
    """Cancelling asks the task; the handle settles only once the task has run its
    cleanup (a fetch: once its READs ended), never at the cancel itself."""
    import asyncio

    loop = BackgroundLoop("test-cancel")
    release = threading.Event()
    try:

        async def slow_to_stop():
            try:
                await asyncio.sleep(60)
            finally:
                await asyncio.to_thread(release.wait, 30)  # cleanup that outlives the cancel

        from transfer.sync import Handle

        handle = Handle(loop.submit(slow_to_stop()))
        time.sleep(0.05)
        handle.cancel()
        time.sleep(0.2)
        assert handle.poll() is HandleStatus.PENDING  # still cleaning up
        release.set()
        _until_done(handle)
        assert isinstance(handle.exception(), ClosedError)
    finally:
        loop.stop()


@pytest.mark.parametrize("when", ["before its task exists", "before its first step"])
def test_a_handle_cancelled_before_its_task_ran_still_runs_its_cleanup(when):
    """Cancelled at once, the task still starts: its cleanup runs (a read claimed ahead gives
    its claim up) and the handle settles, as `ClosedError`, only after it."""
    import asyncio

    loop = BackgroundLoop("test-cancel-early")
    started, cleaned = threading.Event(), threading.Event()
    try:

        async def cleans_up():
            started.set()
            try:
                await asyncio.sleep(60)
            finally:
                cleaned.set()

        from transfer.sync import Handle, LoopTask

        busy = threading.Event()
        loop.call(lambda: busy.wait(5))  # the loop is held: what follows queues behind it
        job = LoopTask(loop.loop, cleans_up())
        if when == "before its first step":
            loop.call(lambda: None)  # the task is made (its first step queued) before the cancel
        handle = Handle(job)
        handle.cancel()
        busy.set()
        _until_done(handle)
        assert started.is_set() and cleaned.is_set()
        assert isinstance(handle.exception(), ClosedError)
    finally:
        loop.stop()


def test_a_handle_settles_before_what_its_operation_queued_on_its_way_out():
    """A fetch queues its releases as it returns; its handle must not wait behind them (their
    sends hold the interpreter lock): it settles in the step that returns the result."""
    import asyncio

    loop = BackgroundLoop("test-settle")
    order: list[str] = []
    try:

        async def returns_and_queues():
            asyncio.get_running_loop().call_soon(order.append, "queued on the way out")
            return 7

        from transfer.sync import Handle

        busy = threading.Event()
        loop.call(lambda: busy.wait(5))  # nothing runs before the callback is in place
        handle = Handle(loop.submit(returns_and_queues()))
        handle.on_done(lambda h: order.append("settled"))
        busy.set()
        _until_done(handle)
        time.sleep(0.05)
        assert handle.result() == 7
        assert order == ["settled", "queued on the way out"]
    finally:
        loop.stop()


@pytest.mark.parametrize("then", ["returns", "raises"])
def test_a_fetch_handle_reports_what_its_lane_proved_and_the_task_cannot_change_it(then):
    """A read whose landing was told by its lane (on the GPU lane: its waiting thread, as the
    kernel ends) is reported by the next poll while pdkv's loop is still busy with it;
    whatever the task ends with afterwards, and a cancel after the report, changes nothing."""
    import asyncio

    from pdkv.errors import RoomAbortedError
    from transfer.decode.landing import Landing
    from transfer.results import FetchResult
    from transfer.sync import FetchHandle

    loop = BackgroundLoop("test-landing")
    finish, ended = threading.Event(), []
    seen, later = FetchResult("e0", 1, 10, 0.1, ()), FetchResult("e0", 1, 10, 0.2, ())
    landing = Landing()
    try:

        async def read():
            landing.arm(lambda: None, lambda: seen)
            try:
                await asyncio.to_thread(finish.wait, 30)  # the loop has yet to hear of the landing
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise
            ended.append(then)
            if then == "raises":
                raise RoomAbortedError("freed on its owner after the proof")
            return later

        handle = FetchHandle(loop.submit(read()), landing)
        time.sleep(0.05)
        assert handle.poll() is HandleStatus.PENDING  # launched, not landed
        assert landing.landed()  # the lane's thread
        assert handle.poll() is HandleStatus.DONE and handle.result() is seen
        handle.cancel()  # reported: nothing to stop
        finish.set()
        end = time.monotonic() + 10
        while not ended and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.05)
        assert ended == [then]
        assert handle.poll() is HandleStatus.DONE and handle.result() is seen
    finally:
        finish.set()
        loop.stop()


def test_a_landings_proof_is_made_once_whichever_threads_come_at_once():
    from transfer.decode.landing import Landing
    from transfer.results import FetchResult

    result, proofs = FetchResult("e0", 1, 10, 0.1, ()), []
    landing = Landing()

    def prove() -> None:
        proofs.append(threading.get_ident())
        time.sleep(0.01)  # long enough for every other thread to arrive meanwhile

    landing.arm(prove, lambda: result)
    start, told = threading.Barrier(9), []

    def lane() -> None:
        start.wait()
        told.append(landing.landed())

    threads = [threading.Thread(target=lane) for _ in range(8)]
    for t in threads:
        t.start()
    start.wait()
    landing.check(prove)  # the loop, as its kernel's end reaches it
    for t in threads:
        t.join(10)
    assert len(proofs) == 1 and told == [True] * 8 and landing.proved_result() is result


def test_what_fails_on_the_lanes_thread_is_left_to_the_loop():
    """A proof that fails in a way that is not a verdict, or a result that cannot be made,
    never raises on the lane's thread: nothing is held for the caller, and the loop reports."""
    from transfer.decode.landing import Landing
    from transfer.results import FetchResult

    def buggy() -> None:
        raise AssertionError("not a verdict")

    def no_result() -> FetchResult:
        raise MemoryError("out of memory building a result")

    landing = Landing()
    landing.arm(buggy, lambda: FetchResult("e0", 1, 10, 0.1, ()))
    assert not landing.landed() and landing.proved_result() is None
    with pytest.raises(AssertionError):
        landing.check(buggy)  # the loop's read raises it
    landing = Landing()
    landing.arm(lambda: None, no_result)
    assert not landing.landed() and landing.proved_result() is None
    landing.check(lambda: None)  # proved: the loop builds its own result


def test_a_fetch_handle_cancelled_before_its_read_landed_reports_the_tasks_end():
    """A cancel asked before the lane told the landing wins: polls stop taking its result,
    and the handle reports the cancelled task's end (its claims given up), not a success."""
    import asyncio

    from transfer.decode.landing import Landing
    from transfer.results import FetchResult
    from transfer.sync import FetchHandle

    loop = BackgroundLoop("test-landing-cancel")
    landing = Landing()
    try:

        async def read():
            landing.arm(lambda: None, lambda: FetchResult("e0", 1, 10, 0.1, ()))
            try:
                await asyncio.sleep(60)
            finally:
                landing.landed()  # the kernel ends during the cancelled task's cleanup
                await asyncio.to_thread(time.sleep, 0.2)

        handle = FetchHandle(loop.submit(read()), landing)
        time.sleep(0.05)
        handle.cancel()
        assert landing.landed() and handle.poll() is HandleStatus.PENDING
        _until_done(handle)
        assert isinstance(handle.exception(), ClosedError)
    finally:
        loop.stop()


def test_a_report_and_a_cancel_raced_from_two_threads_decide_once():
    """A poll's report of a proved read and a cancel from another thread, let go at once: the
    first decides. Either the report is the outcome and the task runs on uncancelled, or the
    cancel is and the handle reports the cancelled task's end; never a mix of the two."""
    import asyncio

    from transfer.sync import Handle, LoopTask

    loop = BackgroundLoop("test-race")
    seen, outcomes = object(), set()
    try:
        for _ in range(40):
            cancelled = threading.Event()

            async def read(cancelled=cancelled):
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
                return "the task's result"

            job = LoopTask(loop.loop, read())
            handle = Handle(job)
            time.sleep(0.002)  # the task started: a cancel reaches its code
            start = threading.Barrier(2)
            canceller = threading.Thread(target=lambda job=job, start=start: (start.wait(), job.cancel()))
            canceller.start()
            start.wait()
            job.report(seen)
            canceller.join(10)
            _until_done(handle)
            time.sleep(0.06)  # the task, uncancelled, has ended meanwhile
            if handle.exception() is None:
                assert handle.result() is seen and not cancelled.is_set()
                outcomes.add("report")
            else:
                assert isinstance(handle.exception(), ClosedError) and cancelled.is_set()
                outcomes.add("cancel")
    finally:
        loop.stop()
    assert outcomes  # which wins depends on the threads' timing; each run is one or the other


def test_a_room_revoked_on_the_model_thread_names_only_its_own_publication(registry_url):
    """`SyncExporter.unpin_word`: a publication granted is revoked (its word cleared on the
    caller's thread); a refused one reaches nothing, the live room of that id keeps its word;
    one still pending when revoked is refused once it runs."""
    exporter = SyncExporter(DSAKVPool(tiny(layer_num=3)), "revoke0", 0, 1, registry_url)
    rooms = exporter.exporter.rooms
    try:
        first = exporter.publish_room(1, np.array([4]))
        assert first.result(timeout=10) and rooms.proves(1)
        again = exporter.publish_room(1, np.array([5]))  # the id is live: refused
        with pytest.raises(ConflictError):
            again.result(timeout=10)
        assert not exporter.unpin_word(1, again) and rooms.proves(1)
        assert exporter.unpin_word(1, first) and not rooms.proves(1)

        held = threading.Event()
        exporter._bg.call(lambda: held.wait(10))  # pdkv's loop busy: the next publication waits
        pending = exporter.publish_room(2, np.array([6]))
        assert pending.poll() is HandleStatus.PENDING
        assert not exporter.unpin_word(2, pending)  # nothing live to clear, the id revoked
        held.set()
        with pytest.raises(ConflictError, match="aborted"):
            pending.result(timeout=10)
    finally:
        exporter.close()
