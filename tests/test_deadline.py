import asyncio
import time

import pytest

from pdkv import DeadlineExceeded
from transfer.deadline import Deadline


def test_a_deadline_bounds_each_wait_and_raises_once_passed():
    d = Deadline.after(10)
    assert 9 < d.left() <= 10 and d.left(cap=2) == 2 and not d.passed
    assert d.within(1) < d and d.within(100) == d
    gone = Deadline(time.monotonic() - 1)
    assert gone.passed and gone.to_wire() == 0
    with pytest.raises(DeadlineExceeded, match="lookup"):
        gone.left(what="lookup")


def test_on_the_wire_a_deadline_is_what_remains():
    d = Deadline.after(2.5)
    wire = d.to_wire()
    assert 2400 <= wire <= 2500
    back = Deadline.from_wire(wire)
    assert abs(back.at - d.at) < 0.1


async def test_wait_until_wakes_on_a_change_and_gives_up_at_its_timeout():
    import asyncio

    from transfer.deadline import wait_until

    state = {"n": 0, "event": asyncio.Event()}

    def bump() -> None:
        state["n"] += 1
        state["event"].set()
        state["event"] = asyncio.Event()

    asyncio.get_running_loop().call_later(0.01, bump)
    asyncio.get_running_loop().call_later(0.02, bump)
    assert await wait_until(lambda: state["n"] >= 2, lambda: state["event"], 5.0)
    assert not await wait_until(lambda: state["n"] >= 3, lambda: state["event"], 0.05)


async def test_a_retry_loop_ends_on_a_cancel_that_wait_for_swallowed():
    """The awaited exchange fails (a refused connection) in the same turn as its task is
    cancelled: 3.11's wait_for raises the refusal, not the cancel; retry_until still ends
    cancelled rather than retrying on (an exporter's renewal once outlived its close so)."""
    from transfer.deadline import retry_until

    loop = asyncio.get_running_loop()
    inners: list[asyncio.Future[None]] = []

    async def attempt() -> None:
        inners.append(loop.create_future())
        await asyncio.wait_for(inners[-1], 10)

    caller = asyncio.ensure_future(retry_until(attempt, Deadline.after(60), ConnectionRefusedError, "test"))
    await asyncio.sleep(0)  # the caller now waits on its first attempt
    inners[0].set_exception(ConnectionRefusedError())
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 5)
    assert len(inners) == 1


async def test_bounded_returns_the_result_times_out_a_slow_wait_and_starts_nothing_without_time():
    from transfer.deadline import bounded

    started: list[str] = []

    async def work(name: str, seconds: float) -> str:
        started.append(name)
        await asyncio.sleep(seconds)
        return name

    assert await bounded(work("quick", 0), 5) == "quick"
    with pytest.raises(TimeoutError):
        await bounded(work("slow", 10), 0.05)
    with pytest.raises(TimeoutError):
        await bounded(work("none left", 0), 0)
    assert started == ["quick", "slow"]  # a spent budget sends no call
    task = asyncio.ensure_future(bounded(work("cancelled", 10), 5))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):  # the caller's cancel is not a timeout
        await task
