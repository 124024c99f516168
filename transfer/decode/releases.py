"""Releases by notification that reach their owner whatever the network drops.

A room read by its ticket, or by a claim proved by the pin words, is released by a
notification (`TicketRelease`, `ClaimRelease`, through `Signals.notify`): no answer, no
round trip after the read. A notification can be lost, and one lost held the room's pages
until its pin expired. The owner clears the room's pin word before it frees the pages, so
the decode can see, without asking, whether its release took: while the word still holds
the room's nonce, the release is sent again (`Timeouts.release_resend`, for
`release_resend_slow` seconds, then every `release_resend_slow` seconds), until the word
changes or the pin would have expired.

Sending again is safe: an owner acts on a release only while it names the live room's pin
(slot and nonce) or an open claim's random token, so a copy that comes late, after the room
was freed and its slot, its id or its owner (a new incarnation) serves another room, frees
nothing. A room that other readers still hold keeps its word until their releases too; its
early readers keep sending theirs (each a no-op once it took) at the slow pace.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from pdkv.errors import PdkvError, PeerLostError
from transfer.deadline import Deadline
from transfer.decode.owners import Owner
from transfer.lanes.base import Signals
from transfer.metadata import OwnerPin
from transfer.metrics import observe_notification_failure, observe_retransmission
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Pending:
    """One owner's release of one room, sent and not yet seen to take."""

    owner: Owner
    pin: OwnerPin
    room: int
    message: bytes
    first: float  # when it was first sent (monotonic)
    due: float  # when its pin word is looked at next
    kind: str  # release | give_up (a failed read's), as the metrics name it
    sends: int = 1


class Releases:
    """Sends release notifications and makes sure of each by its owner's pin word.

    `window`: a registered host tensor of at least one pin window, this object's own, that
    the words of owners whose tables are not mapped here are READ into."""

    def __init__(self, signals: Signals, timeouts: Timeouts, window: torch.Tensor) -> None:
        self.signals, self.timeouts, self._window = signals, timeouts, window
        self._pending: list[_Pending] = []
        self._watcher: asyncio.Task[None] | None = None
        self.resent = 0  # notifications sent again (each a release its owner had not acted on yet)
        self.given_up = 0  # releases never seen to take by their pin's expiry

    @property
    def pending(self) -> int:
        """Releases sent and not yet seen to take."""
        return len(self._pending)

    def send(self, releases: list[tuple[Owner, OwnerPin, bytes]], room: int, kind: str = "release") -> None:
        """Send each (owner, pin, message) now, and watch each pin until it shows the release
        took. An owner with no connection left (forgotten, lost) is skipped: its room
        table went with it, or its pin expires there. `kind`: release, or give_up."""
        if self.signals.closed:  # closed meanwhile
            logger.info("release of room %d: the fetcher is closed (its pins expire instead)", room)
            return
        try:
            unsent = set(self.signals.notify([(o.rank.agent_name, m) for o, _, m in releases]))
        except PdkvError as exc:
            logger.info("release of room %d: %s (its pins expire instead)", room, exc)
            for _ in releases:
                observe_notification_failure(kind)
            return
        reachable = [(o, pin, m) for o, pin, m in releases if o.rank.agent_name not in unsent]
        for agent in unsent:
            logger.info("release of room %d: no connection to %s (its pin expires there)", room, agent)
            observe_notification_failure(kind)
        now = time.monotonic()
        due = now + self.timeouts.release_resend
        self._pending += [_Pending(o, pin, room, m, now, due, kind) for o, pin, m in reachable]
        if self._pending and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def close(self) -> None:
        """Stop watching (the fetcher is closing: its connections go)."""
        if self._pending:
            logger.info("closing with %d releases not yet seen to take (their pins expire there)", len(self._pending))
        self._pending = []
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def _watch(self) -> None:
        try:
            while self._pending and not self.signals.closed:
                # At least every `release_resend`: a release sent meanwhile is looked at in time.
                wake = min(p.due for p in self._pending) - time.monotonic()
                await asyncio.sleep(min(max(0.0, wake), self.timeouts.release_resend))
                try:
                    await self._round()
                except Exception:  # never end silently: the releases left would wait for their pins
                    logger.exception("checking %d releases by their pin words", len(self._pending))
        finally:
            if self._watcher is asyncio.current_task():  # not one started after a close cancelled this
                self._watcher = None

    async def _round(self) -> None:
        """Look at the releases due, and send again those whose pin word still holds."""
        now = time.monotonic()
        due = [p for p in self._pending if p.due <= now]
        read: dict[tuple[str, int], torch.Tensor] = {}  # READ windows of this round, by owner and start
        again = [p for p in due if await self._still_pinned(p, read)]
        done = {id(p) for p in due} - {id(p) for p in self._resend(again, time.monotonic())}
        self._pending = [p for p in self._pending if id(p) not in done]  # send() may have added some

    async def _still_pinned(self, p: _Pending, read: dict[tuple[str, int], torch.Tensor]) -> bool:
        """Whether `p`'s room still holds its pin word on its owner (the release has not taken
        yet); False where the word cannot be read any more (the owner was forgotten or lost).
        `read`: the windows of words READ so far this round, reused."""
        if time.monotonic() - p.first >= self.timeouts.pin:
            logger.warning("room %d: its release to %s never took by its pin's expiry", p.room, p.owner.rank.agent_name)
            self.given_up += 1
            observe_notification_failure(p.kind)
            return False
        try:
            return await self._word(p, read) == p.pin.nonce
        except PdkvError as exc:
            logger.info("room %d: pin word on %s unreadable (%s): release left", p.room, p.owner.rank.agent_name, exc)
            observe_notification_failure(p.kind)
            return False

    async def _word(self, p: _Pending, read: dict[tuple[str, int], torch.Tensor]) -> int:
        """`p`'s pin word: a load where the owner's table is mapped here, else from a window of
        words READ through the signals (one READ a round for every release to that owner in the
        window: one each, one after another, took seconds a round on a loaded host)."""
        mapped, agent = p.owner.pins, p.owner.rank.agent_name
        if mapped is not None:
            return mapped.word(p.pin.slot)
        table = p.owner.rank.pins
        if table is None:
            raise PeerLostError("no pin table to read its word from", agent)
        first = p.pin.slot - p.pin.slot % len(self._window)
        words = read.get((agent, first))
        if words is None:
            window = self._window[: min(len(self._window), table.slots - first)]
            deadline = Deadline.after(self.timeouts.request)
            await self.signals.read_word(agent, table.addr + 8 * first, window, deadline)
            words = read[(agent, first)] = window.clone()
        return int(words[p.pin.slot - first])

    def _resend(self, again: list[_Pending], now: float) -> list[_Pending]:
        """Send `again`'s releases once more and set when each is looked at next; returns
        those sent (an owner with no connection left is dropped)."""
        if not again:
            return []
        t = self.timeouts
        unsent: set[str] = set()
        try:
            unsent.update(self.signals.notify([(p.owner.rank.agent_name, p.message) for p in again]))
        except PdkvError as exc:
            logger.info("resending releases: %s", exc)
        sendable = [p for p in again if p.owner.rank.agent_name not in unsent]
        for p in sendable:
            p.sends += 1
            observe_retransmission(p.kind)
            # Slow once a second has passed *and* as many copies went as the fast pace sends in
            # one: on a loaded host a round comes late, and what beats loss is the copies' count.
            slow = now - p.first >= t.release_resend_slow and p.sends * t.release_resend >= t.release_resend_slow
            p.due = now + (t.release_resend_slow if slow else t.release_resend)
            logger.debug("room %d: release to %s sent again (%d sends)", p.room, p.owner.rank.agent_name, p.sends)
        self.resent += len(sendable)
        return sendable
