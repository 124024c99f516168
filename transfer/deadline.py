"""Deadlines on the asyncio side: retries and waits bounded by one.

`Deadline` itself lives in `pdkv.deadline` (pdkv bounds waits too and never imports
`transfer`) and is re-exported here, so `transfer` code imports it from one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from pdkv.deadline import Deadline

__all__ = ["Deadline", "bounded", "raise_if_cancelled", "retry_until", "wait_until"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def bounded(work: Awaitable[T], seconds: float) -> T:
    """`await work`, cancelled after `seconds` (`TimeoutError`; none left: not started), as
    `asyncio.wait_for`. From 3.11.3 (`asyncio.timeout` as fixed there) `work` runs in this task:
    3.11's `wait_for` runs it in a task of its own, two turns of the loop more a call."""
    if seconds <= 0:
        if asyncio.iscoroutine(work):
            work.close()
        raise TimeoutError
    timeout = getattr(asyncio, "timeout", None) if sys.version_info[:3] >= (3, 11, 3) else None
    if timeout is None:
        return await asyncio.wait_for(work, seconds)
    async with timeout(seconds):
        return await work


def raise_if_cancelled() -> None:
    """Raise `CancelledError` where this task was cancelled though what it awaited ended
    otherwise: 3.11's `wait_for` hands back the result or error of an awaitable that ends as
    its caller is cancelled, and a retry loop would then run on (an exporter's lease renewal,
    cancelled by its close as a PUT to a gone registry was refused, retried forever)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # 3.11+
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError


async def retry_until(
    attempt: Callable[[], Awaitable[T]],
    deadline: Deadline,
    retry_on: type[Exception] | tuple[type[Exception], ...],
    what: str,
    first: float = 0.05,
    cap: float = 1.0,
) -> T:
    """`attempt()` until it returns, retrying on `retry_on` with a doubling pause (from
    `first` up to `cap`) while the pause still fits before `deadline`; then the last error."""
    delay = first
    while True:
        try:
            return await attempt()
        except retry_on as exc:
            raise_if_cancelled()
            if deadline.remaining() < delay:
                raise
            logger.debug("%s: %s; retrying", what, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)


async def wait_until(ready: Callable[[], bool], changed: Callable[[], asyncio.Event], timeout: float) -> bool:
    """Wait until `ready()` holds, at most `timeout` seconds; True if it does. `changed()`:
    the event set whenever `ready()` may have become true (one a change, replaced after)."""
    deadline = Deadline.after(timeout)
    while not ready():
        left = deadline.remaining()
        if left <= 0:
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed().wait(), left)
    return True
