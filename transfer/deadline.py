"""One deadline type, from a request's start down to the innermost network wait.

A `Deadline` is an instant on this process's monotonic clock. It does not change form on
the way down: `fetch()` takes one, hands it to every owner task, and each network await
takes its bound from it (`left(cap)`, capped by the `Timeouts` field for that one wait).
Across processes it travels as the milliseconds that remain (gRPC does the same: clocks
of two processes do not agree, durations do), and becomes a local `Deadline` again on
arrival (`Deadline.from_wire`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from pdkv.errors import DeadlineExceeded

__all__ = ["Deadline", "retry_until", "wait_until"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, order=True)
class Deadline:
    at: float  # time.monotonic() seconds

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    @classmethod
    def from_wire(cls, budget_ms: int) -> Deadline:
        return cls.after(budget_ms / 1e3)

    def to_wire(self) -> int:
        """What remains, in whole milliseconds (0 once passed)."""
        return max(0, int(self.remaining() * 1e3))

    def remaining(self) -> float:
        return self.at - time.monotonic()

    @property
    def passed(self) -> bool:
        return self.remaining() <= 0

    def within(self, seconds: float) -> Deadline:
        """The earlier of this deadline and `seconds` from now."""
        return min(self, Deadline.after(seconds))

    def left(self, cap: float | None = None, what: str = "deadline passed") -> float:
        """Seconds left (at most `cap`) for one wait; `DeadlineExceeded` if none are."""
        remaining = self.remaining()
        if remaining <= 0:
            raise DeadlineExceeded(what)
        return remaining if cap is None else min(remaining, cap)


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
            if deadline.remaining() < delay:
                raise
            logger.debug("%s: %s; retrying", what, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)


async def wait_until(ready: Callable[[], bool], changed: Callable[[], asyncio.Event], timeout: float) -> bool:
    """Wait until `ready()` holds, at most `timeout` seconds; True if it does. `changed()`:
    the event set whenever `ready()` may have become true (one a change, replaced after)."""
    end = time.monotonic() + timeout
    while not ready():
        left = end - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed().wait(), left)
    return True
