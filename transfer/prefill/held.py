"""Claims the engine's other ranks hold for the arbiter to hand out (`HeldClaim`).

A rank other than the arbiter holds one claim of each whole room it could grant and tells
the arbiter (`RoomTable.hold`, sent by `Peers.hold`). A claimant the arbiter grants the
room's first claim to, with every other rank's held claim here for the incarnation the
claimant names and for the same pages, gets those claims in the arbiter's answer: it reads
with no relay, one round trip to one process. Every other claimant is relayed as before, and
each rank lets a relayed claim take its held one over (the arbiter, having granted others,
never hands it out). What a held claim's answer tells the claimant is what that rank would
answer; the pin words after the data prove the room stayed pinned there, as for any read.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence

from transfer.metadata import HeldClaim, OwnerClaim, OwnerRef, RoomStatus

_MAX_ROOMS = 1 << 14  # rooms whose held claims are kept; the oldest go first


class HeldClaims:
    """The held claims the arbiter was told of, by room then rank, each kept `keep_s` at most
    (a room's pin: it has ended by then)."""

    def __init__(self, keep_s: float) -> None:
        self._keep_s = keep_s
        self._rooms: OrderedDict[int, dict[int, tuple[float, HeldClaim]]] = OrderedDict()
        self.handed_out = 0  # claimants answered from held claims, with no relay

    def keep(self, held: HeldClaim) -> bool:
        """Keep `held` to hand out; False for one that says nothing it could be read by."""
        s = held.state
        if s.status is not RoomStatus.READY or s.pin is None or s.pin.cp_rank != held.cp_rank:
            return False
        if s.pin.incarnation != held.incarnation or s.ready_pages is not None:
            return False
        now = time.monotonic()
        self._rooms.setdefault(s.room, {})[held.cp_rank] = (now + self._keep_s, held)
        self._rooms.move_to_end(s.room)
        while len(self._rooms) > _MAX_ROOMS or (self._rooms and self._oldest_gone(now)):
            self._rooms.popitem(last=False)
        return True

    def hand_out(self, room: int, others: Sequence[OwnerRef], src_pages: list[int]) -> list[OwnerClaim] | None:
        """Every one of `others`' held claims of `room`, as each would answer the claim, taken
        out; None (nothing taken) unless each holds one, for the incarnation named and for
        `src_pages` (the arbiter's), and none has lapsed."""
        by_rank = self._rooms.get(room)
        if by_rank is None:
            return None
        now = time.monotonic()
        answers: list[OwnerClaim] = []
        for o in others:
            until, held = by_rank.get(o.cp_rank, (0.0, None))
            if held is None or until <= now or held.incarnation != o.incarnation or held.state.src_pages != src_pages:
                return None
            answers.append(OwnerClaim(cp_rank=o.cp_rank, state=held.state, claim=held.claim))
        del self._rooms[room]
        self.handed_out += 1
        return answers

    def _oldest_gone(self, now: float) -> bool:
        oldest = next(iter(self._rooms.values()))
        return all(until <= now for until, _ in oldest.values())

    @property
    def kept(self) -> int:
        """The held claims kept, not handed out (a lapsed one stays counted until it is dropped)."""
        return sum(len(by_rank) for by_rank in self._rooms.values())
