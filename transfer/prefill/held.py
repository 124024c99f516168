"""Claims the engine's other ranks hold for the arbiter to hand out (`HeldClaim`).

A rank other than the arbiter holds one claim of each whole room it could grant and tells
the arbiter (`RoomTable.hold`, sent by `Peers.hold`). A claimant the arbiter grants the
room's first claim to (one reader, not a group), with every other rank's held claim here for
the incarnation the claimant names and for the same pages, gets those claims in the arbiter's
answer: it reads with no relay, one round trip to one process. Every other claimant is relayed
as before, and each rank lets a relayed claim take its held one over (the arbiter, having
granted another, never hands it out). A held claim the arbiter does not hand out goes back:
refused as it comes where the room was claimed or ended here first (the rank drops it), else
returned as the arbiter's room ends (`ReturnHeld`: ended unread where nothing took it over).
What a held claim's answer tells the claimant is what that rank would answer; the pin words
after the data prove the room stayed pinned there, as for any read. A give-up never takes a
held claim over (it may come from anyone), and the claim held is a capability: only a peer
that passed the control secret can offer one, as only such a peer can relay a claim.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import numpy as np

from transfer.metadata import HeldClaim, OwnerClaim, OwnerRef, RoomStatus

_MAX_ROOMS = 1 << 14  # rooms whose held claims are kept; the oldest go first


def pages_digest(pages: Sequence[int] | np.ndarray) -> bytes:
    """What a held claim names a room's pages by: a long room's list would cost the arbiter
    its size for every room, for the pin's time."""
    return hashlib.blake2b(np.asarray(pages, dtype=np.int64).tobytes(), digest_size=16).digest()


class HeldClaims:
    """The held claims the arbiter was told of, by room then rank, each kept `keep_s` at most
    (a room's pin: it has ended by then)."""

    def __init__(self, keep_s: float) -> None:
        self._keep_s = keep_s
        self._rooms: OrderedDict[int, dict[int, tuple[float, HeldClaim]]] = OrderedDict()
        # Rooms whose held claims went to a claimant (its token here), until the room ends
        # here: given back if that claim ends unread (its answer lost, the claimant gone).
        self._handed: OrderedDict[int, tuple[str, list[HeldClaim]]] = OrderedDict()
        self.handed_out = 0  # claimants answered from held claims, with no relay

    def keep(self, held: HeldClaim) -> tuple[bool, HeldClaim | None]:
        """Keep `held` to hand out: whether it was kept (not one that says nothing it could be
        read by), and the claim that rank held for the room before, which it replaces (to give
        back: a rank holds one a room, so that one was not its own)."""
        s = held.state
        if s.status is not RoomStatus.READY or s.pin is None or s.pin.cp_rank != held.cp_rank or s.src_pages:
            return False, None
        if s.pin.incarnation != held.incarnation or s.ready_pages is not None:
            return False, None
        now = time.monotonic()
        by_rank = self._rooms.setdefault(s.room, {})
        before = by_rank.get(held.cp_rank)
        by_rank[held.cp_rank] = (now + self._keep_s, held)
        self._rooms.move_to_end(s.room)
        while len(self._rooms) > _MAX_ROOMS or (self._rooms and self._oldest_gone(now)):
            self._rooms.popitem(last=False)
        return True, None if before is None or before[1].claim == held.claim else before[1]

    def hand_out(
        self, room: int, others: Sequence[OwnerRef], src_pages: list[int], claimant: str
    ) -> list[OwnerClaim] | None:
        """Every one of `others`' held claims of `room`, as each would answer the claim, taken
        out for `claimant` (its claim's token here); None (nothing taken) unless each holds
        one, for the incarnation named and for `src_pages` (the arbiter's), none lapsed."""
        by_rank = self._rooms.get(room)
        if by_rank is None:
            return None
        now, digest = time.monotonic(), pages_digest(src_pages)
        answers: list[OwnerClaim] = []
        for o in others:
            until, held = by_rank.get(o.cp_rank, (0.0, None))
            if held is None or until <= now or held.incarnation != o.incarnation or held.pages != digest:
                return None
            state = msgspec.structs.replace(held.state, src_pages=src_pages)
            answers.append(OwnerClaim(cp_rank=o.cp_rank, state=state, claim=held.claim))
        self._handed[room] = (claimant, [held for _, held in self._rooms.pop(room).values()])
        while len(self._handed) > _MAX_ROOMS:
            self._handed.popitem(last=False)
        self.handed_out += 1
        return answers

    def pop(self, room: int, unread: bool) -> list[HeldClaim]:
        """`room` ended here: the held claims to give back to their ranks, which end each unread
        where it is still open. Those not handed out; with `unread` (the room ended with no
        reader) those handed out too."""
        by_rank = self._rooms.pop(room, None)
        back = [] if by_rank is None else [held for _, held in by_rank.values()]
        _, handed = self._handed.pop(room, ("", []))
        return back + handed if unread else back

    def given_up(self, room: int, claimant: str) -> list[HeldClaim]:
        """`claimant`'s claim of `room` ended unread here (it gave up, or vanished): the held
        claims handed to it, to give back (its claims elsewhere end with it)."""
        got = self._handed.get(room)
        if got is None or got[0] != claimant:
            return []
        del self._handed[room]
        return got[1]

    def _oldest_gone(self, now: float) -> bool:
        oldest = next(iter(self._rooms.values()))
        return all(until <= now for until, _ in oldest.values())

    @property
    def kept(self) -> int:
        """The held claims kept, not handed out (a lapsed one stays counted until it is dropped)."""
        return sum(len(by_rank) for by_rank in self._rooms.values())
