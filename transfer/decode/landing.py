"""A read's end told to a synchronous caller without waiting for the decode's loop.

A read on the GPU lane has landed once its kernel has passed. The lane's waiting thread
sees that first; the decode's loop hears it from there, then proves the pin words, builds
the result and settles the caller's handle: the wake-up and that Python are a large part
of a GPU lane read (docs/benchmarks.md#sglang-through-its-receiver), all of it holding
the interpreter lock that a polling scheduler needs to see the outcome. Given a
`Landing`, such a read has the waiting thread prove the pin words (loads from the owners'
mapped tables) and keep the result as the kernel ends; the caller's `poll()` reads it
from there, and the loop's continuation (its releases) comes a moment later
(`transfer.timeouts.CALLER_YIELD_SECONDS`).

The proof is made once, by whichever thread comes first (the waiting thread, or the loop
where the lane had nothing to tell), and both follow that verdict: the loop's read ends as
the result its caller may already have been given, and a refused read is never offered.
A `Landing` decides nothing about the caller's handle: it only keeps the proved result.
Which outcome the handle reports (this result, the task's end, or a cancel first) is
decided in one place, `transfer.sync.LoopTask`, whose docstring states the order.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NoReturn

from transfer.results import FetchResult

logger = logging.getLogger(__name__)


class Landing:
    """Where a read's result waits for a polling caller (`transfer.sync`) once a lane has
    told it, on the lane's own thread, that the bytes are in place (a `Watch`). Made by the
    caller, armed by the read on the decode's loop before it launches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the proof is made once, whichever thread comes first
        self._prove: Callable[[], None] = _unarmed
        self._result: Callable[[], FetchResult] = _unarmed
        self._verdict: Exception | None | bool = None  # None: not proved yet; True: proved; an error: refused
        self._proved_result: FetchResult | None = None  # the result the lane's thread made, for the caller

    def arm(self, prove: Callable[[], None], result: Callable[[], FetchResult]) -> None:
        """The read is about to launch (on the decode's loop): `prove`, asked once its bytes
        are in place and never awaiting, checks every owner's pin word and raises (a
        `PdkvError`) if one is not the room's; `result` is what the read then reports."""
        self._prove, self._result = prove, result

    def landed(self) -> bool:
        """The bytes are in place (the lane's thread): prove them and keep the result for
        `proved_result`. True if the read was proved here; never raises (whatever fails here, the
        loop reports)."""
        try:
            if self._proved(self._prove) is not True:
                return False
            self._proved_result = self._result()
            return True
        except Exception:
            logger.debug("a landing's result could not be made: the decode's loop reports the read", exc_info=True)
            return False

    def proved_result(self) -> FetchResult | None:
        """The read's result once the lane's thread proved it; None before, or if it did not
        (any thread)."""
        return self._proved_result

    def check(self, prove: Callable[[], None]) -> None:
        """On the loop, once the bytes are in place: prove them with `prove` unless the lane's
        thread did already; raises the proof's failure, whichever thread made it."""
        verdict = self._proved(prove)
        if isinstance(verdict, Exception):
            raise verdict

    def _proved(self, prove: Callable[[], None]) -> Exception | bool:
        with self._lock:
            verdict = self._verdict
            if verdict is None:
                try:
                    prove()
                    verdict = True
                except Exception as exc:  # any failure is final: both threads report it
                    verdict = exc
                self._verdict = verdict
            return verdict


def _unarmed() -> NoReturn:
    raise AssertionError("a landing told before its read armed it")
