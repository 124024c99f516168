"""A read's end seen from a synchronous scheduler's thread, without the decode's loop.

A read on the GPU lane has landed once its kernel has passed. The decode's loop hears that
from the lane's waiting thread, then proves the pin words, builds the result and settles
the caller's handle: on an H200 host that wake-up and its Python took 0.25-0.3 ms of an
8k-token read, which a scheduler polling the handle waited out. Given a `Landing`, such a
read tells it, as it launches, how to ask the kernel: the scheduler's `poll()` then sees
the bytes in place itself, proves the pin words there (loads from the owners' mapped
tables) and has its result at once.

Both threads may get to the proof; it is made once, by whichever comes first, and both
follow that verdict: a read proved by the poll cannot fail on the loop afterwards, and one
the loop found unproved is never reported done by a poll.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import NoReturn

from transfer.results import FetchResult

__all__ = ["Landing"]

logger = logging.getLogger(__name__)


class Landing:
    """Where a read launched on a lane that can say so (`transfer.lanes.base.Watch`) can be
    seen to have landed, from any thread. Made by the caller (`transfer.sync`), armed by the
    read on the decode's loop, probed by the caller's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the proof is made once, whichever thread asks first
        self._passed: Callable[[], bool] | None = None
        self._prove: Callable[[], None] = _unarmed
        self._result: Callable[[], FetchResult] = _unarmed
        self._verdict: Exception | None | bool = None  # None: not proved yet; True: proved; an error: refused

    def arm(self, passed: Callable[[], bool], prove: Callable[[], None], result: Callable[[], FetchResult]) -> None:
        """The read has launched (on the decode's loop): `passed` asks, without blocking,
        whether its bytes are in place; `prove` (asked only once they are, and never
        awaiting) checks every owner's pin word, raising (a `PdkvError`) if one is not the
        room's; `result` is what the read then reports."""
        self._prove, self._result = prove, result
        self._passed = passed  # last: a thread that sees it armed sees the other two

    def probe(self) -> FetchResult | None:
        """The read's result if its bytes are in place and proved; None while they are not,
        or if the proof failed (the read then fails on the loop). Never blocks and never
        raises (a scheduler's poll asks it): whatever goes wrong here, the loop reports."""
        try:
            if self._verdict is None:
                passed = self._passed
                if passed is None or not passed():
                    return None
                self._decide(self._prove)
            return self._result() if self._verdict is True else None
        except Exception:
            logger.debug("a landing's probe failed: the decode's loop reports the read", exc_info=True)
            return None

    def decide(self, prove: Callable[[], None]) -> None:
        """On the loop, once the bytes are in place: prove them with `prove` unless a probe
        did already; raises the proof's failure, whichever thread made it."""
        verdict = self._decide(prove)
        if isinstance(verdict, Exception):
            raise verdict

    def _decide(self, prove: Callable[[], None]) -> Exception | bool:
        with self._lock:
            verdict = self._verdict
            if verdict is None:
                try:
                    prove()
                    verdict = True
                except Exception as exc:  # any failure is final: a probe never asks again
                    verdict = exc
                self._verdict = verdict
            return verdict


def _unarmed() -> NoReturn:
    raise AssertionError("a landing asked before its read armed it")
