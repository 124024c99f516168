"""One deadline type, from a request's start down to the innermost wait.

A `Deadline` is an instant on this process's monotonic clock. It does not change form on
the way down: a caller makes one where its bound starts (`Deadline.after(timeout)`), hands
it on, and each wait takes its bound from it (`left(cap)`, capped by the `Timeouts` field
for that one wait). Across processes it travels as the milliseconds that remain (gRPC does
the same: clocks of two processes do not agree, durations do), and becomes a local
`Deadline` again on arrival (`Deadline.from_wire`).

It lives in `pdkv`, the lower layer, because `pdkv` (its NCCL watchdog) bounds waits too and
never imports `transfer`; `transfer.deadline` re-exports it beside its async helpers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdkv.errors import DeadlineExceeded


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
