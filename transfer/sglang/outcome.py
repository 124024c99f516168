"""A sender's or receiver's poll state, with the failure behind it (both sides' `poll`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sglang.srt.disaggregation.base.conn import KVPoll

from pdkv.errors import TransferError
from transfer.logctx import failure_fields

__all__ = ["Outcome"]

logger = logging.getLogger(__name__)


class Outcome:
    """A poll state with the failure behind it, and the time the transfer ran."""

    def __init__(self, about: Callable[[], dict[str, object]] = dict) -> None:
        """`about`: the request's room, engine and CP rank as known when it fails, for its log line."""
        self.state = KVPoll.Bootstrapping
        self.error: BaseException | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self._about = about

    def fail(self, error: BaseException) -> int:
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self.state, self.error, self.ended = KVPoll.Failed, error, time.monotonic()
            fields = failure_fields(error, **self._about())  # separate record fields, for structured logs
            logger.warning("pdkv transfer of room %s failed: %s", fields["room"], error, extra=fields)
        return self.state

    def succeed(self) -> int:
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self.state, self.ended = KVPoll.Success, time.monotonic()
        return self.state

    def raise_failure(self, what: str) -> None:
        raise self.error if self.error is not None else TransferError(f"{what}: no failure recorded")

    def latency(self) -> float | None:
        return None if self.started is None or self.ended is None else self.ended - self.started
