"""One room on a prefill rank as its room table keeps it (`transfer.prefill.rooms`), and
the table's counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from transfer.deadline import Deadline
from transfer.metadata import ErrorReply, RoomStatus

OnEnd = Callable[[RoomStatus, ErrorReply | None], None]
"""How a publication ended (RELEASED or ABORTED) and, where its prefill failed it, why."""


@dataclass
class Room:
    """A live publication of a room: its pages, claims, readiness, pin and readers' starts."""

    room: int
    src_pages: np.ndarray
    consumers: int
    pinned_until: Deadline
    ready_upto: int
    open_claims: dict[str, str] = field(default_factory=dict)  # token -> consumer id
    released: int = 0  # claims granted and released; granted = released + open
    given_up: int = 0  # of those, released unread (`give_up`)
    total_pages: int = -1  # published by chunks: the pages it will have; -1: all at once
    slot: int = -1  # its pin table slot; -1: none
    nonce: int = 0
    ticket: str = ""  # "", "issued" (holds one of the claims), "released"
    held: str = ""  # the open claim this rank holds for its arbiter to hand out, while no reader used it
    held_token: str = ""  # that claim's token, used or not: the arbiter may give it back (`drop_held`)
    holdable: bool = False  # published to hold a claim for the arbiter (then never a ticket)
    aux: bytes | None = None  # the engine's per-request bytes, given with the last chunk
    pub: int = 0  # this publication of the room id (`publish`'s answer)
    on_end: OnEnd | None = None
    starts: dict[str, int] = field(default_factory=dict)  # open claim token -> the page its reader reads from
    freed_upto: int = 0  # src_pages below this were freed ahead of the end (no reader reads them)

    @property
    def granted(self) -> int:
        return self.released + len(self.open_claims) + (self.ticket == "issued")

    def unread_below(self) -> int:
        """The pages (from the first) that no reader still to read will read: below the
        lowest start of the open claims, once each has said it (`starts`). 0 while a reader
        may start at page 0: a claim not granted yet, a ticket out, an open claim unsaid;
        and with no reader left (the room's end frees it all)."""
        unsaid = self.granted < self.consumers or self.ticket == "issued" or len(self.starts) < len(self.open_claims)
        if unsaid or not self.open_claims:
            return 0
        return min(min(self.starts.values()), len(self.src_pages))


@dataclass
class RoomCounters:
    published: int = 0
    released: int = 0
    aborted: int = 0
    expired: int = 0
    freed_ahead: int = 0  # pages freed before their room ended: below every reader's start
