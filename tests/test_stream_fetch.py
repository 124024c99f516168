"""Stream-ordered completion (`DecodeFetcher.fetch(stream=...)`) on the CPU: its arguments
refused before anything is asked, and the hand-over's every ordering over a fake read that
drives a real `StreamLanding` as the GPU lane does (queued on the loop, landed on the
waiting thread, checked on the loop). On a GPU: tests/test_gpu.py."""

import asyncio
import threading

import pytest
import torch

from pdkv import DSAKVPool, tiny
from pdkv.errors import ClaimLostError, PeerLostError
from transfer.decode import DecodeFetcher
from transfer.decode.landing import Landing, StreamLanding, consumer_stream
from transfer.results import FetchResult

RESULT = FetchResult("eng", 7, 64, 0.001, (), False, 0)


class _Landing(StreamLanding):
    """Events and streams stand in for CUDA's (a CPU torch has none)."""

    def __init__(self, fail_order: bool = False) -> None:
        super().__init__(consumer="consumer")  # type: ignore[arg-type]
        self.fail_order, self.ordered_on = fail_order, []

    def _order(self, stream):  # type: ignore[no-untyped-def]
        if self.fail_order:
            raise RuntimeError("no CUDA here")
        self.ordered_on.append(stream)
        return ("event behind", stream)

    def _after(self):  # type: ignore[no-untyped-def]
        return ("event on", self.consumer)


async def _read(landing: StreamLanding, kernel: asyncio.Event, proof_ok: bool, launch: bool = True) -> FetchResult:
    """A read as `TicketProtocol` and the GPU lane make it: arm, queue, land on another
    thread as the kernel ends, check on the loop."""

    def prove() -> None:
        if not proof_ok:
            raise ClaimLostError("room 7: its pages on cp rank 1 were freed")

    landing.arm(prove, lambda: RESULT)
    if launch:
        landing.queued("lane stream")
        await kernel.wait()
        told = await asyncio.to_thread(landing.landed)
        assert told is False  # the caller hears it on the loop: nothing waits there
    landing.check(prove)
    return landing.proved_result() or RESULT


async def test_a_stream_is_refused_for_a_cpu_pool_and_beside_a_landing():
    fetcher = DecodeFetcher(DSAKVPool(tiny(size=256)), "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="on a GPU"):
        await fetcher.fetch("eng", 1, [0], stream=123)
    with pytest.raises(ValueError, match="not both"):
        await fetcher.fetch("eng", 1, [0], landing=Landing(), stream=123)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="torch.cuda.Stream"):
        consumer_stream("stream", torch.device("cuda"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.cuda.Stream"):
        consumer_stream(True, torch.device("cuda"))


async def test_the_handle_comes_once_the_read_is_queued_and_completes_after_the_proof():
    landing, kernel = _Landing(), asyncio.Event()
    handle = await landing.hand_over(asyncio.ensure_future(_read(landing, kernel, True)))
    assert handle.ordered and handle.event == ("event behind", "lane stream") and handle.stream == "consumer"
    assert not handle.done()  # handed over while the kernel still runs
    kernel.set()
    assert await handle is RESULT and handle.result() is RESULT


async def test_a_failed_proof_fails_the_completion_and_never_reports_success():
    landing, kernel = _Landing(), asyncio.Event()
    handle = await landing.hand_over(asyncio.ensure_future(_read(landing, kernel, False)))
    assert handle.ordered and not handle.done()
    kernel.set()
    with pytest.raises(ClaimLostError, match="cp rank 1"):
        await handle
    assert landing.proved_result() is None
    with pytest.raises(ClaimLostError):
        handle.result()


async def test_a_fetch_failing_before_its_launch_hands_no_event():
    landing = _Landing()

    async def refused() -> FetchResult:
        raise PeerLostError("cp rank 0: gone", "prefill0")

    with pytest.raises(PeerLostError):
        await landing.hand_over(asyncio.ensure_future(refused()))
    assert landing.ordered_on == []


@pytest.mark.parametrize("fail_order", [False, True])
async def test_a_read_not_ordered_on_the_lane_is_handed_over_once_proved_on_the_host(fail_order):
    """No launch told (owners over UCX, or one at a time), or the ordering failed: the fetch
    completes on the host first, and the event is the consumer's own."""
    landing, kernel = _Landing(fail_order), asyncio.Event()
    kernel.set()
    handle = await landing.hand_over(asyncio.ensure_future(_read(landing, kernel, True, launch=fail_order)))
    assert not handle.ordered and handle.done() and handle.event == ("event on", "consumer")
    assert await handle is RESULT


async def test_a_failure_after_the_queue_but_before_the_hand_over_raises_from_the_fetch():
    landing = _Landing()

    async def fails_at_once() -> FetchResult:
        landing.queued("lane stream")
        raise ClaimLostError("room 7: aborted")

    with pytest.raises(ClaimLostError):
        await landing.hand_over(asyncio.ensure_future(fails_at_once()))


async def test_a_cancelled_hand_over_returns_only_once_the_read_has_ended():
    landing, kernel, ended = _Landing(), asyncio.Event(), threading.Event()

    async def read() -> FetchResult:
        try:
            await kernel.wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # as the lane: the kernel is waited for before raising
            ended.set()
            raise
        return RESULT

    waiting = asyncio.ensure_future(landing.hand_over(asyncio.ensure_future(read())))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert ended.is_set()


async def test_giving_up_the_wait_for_the_completion_leaves_the_read_to_end():
    landing, kernel = _Landing(), asyncio.Event()
    handle = await landing.hand_over(asyncio.ensure_future(_read(landing, kernel, True)))
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(handle, 0.01)
    kernel.set()
    assert await handle is RESULT
