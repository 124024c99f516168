"""The ticket's pins: an owner's pin table mapped here, and UCX for pin words and notifications."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.fakes.memory import FP
from tests.fakes.timeline import Timeline
from transfer.deadline import Deadline
from transfer.metadata import TicketRelease, decode


class FakePins:
    """An owner's pin table mapped here (`Owner.pins`)."""

    def __init__(self, timeline: Timeline, cp: int, words: dict[int, int]) -> None:
        self.timeline, self.cp, self.words = timeline, cp, words
        self.closed = False

    def word(self, slot: int) -> int:
        self.timeline.add("pin_word", self.cp)
        return self.words.get(slot, 0)

    def close(self) -> None:
        self.closed = True


class FakeUcx:
    """In place of `UcxLane` for tickets: remote pin words by address, notifications recorded."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.words: dict[int, int] = {}  # address -> int64 word
        self.cp_of: dict[str, int] = {}  # agent name -> cp rank
        self.notified: list[tuple[str, bytes]] = []
        self.closed = False

    async def read_word(self, agent: str, addr: int, window: Any, deadline: Deadline) -> None:
        self.timeline.add("pin_read", self.cp_of[agent])
        await asyncio.sleep(0)
        for i in range(len(window)):
            window[i] = self.words.get(addr + 8 * i, 0)

    def notify(self, messages: list[tuple[str, bytes]]) -> None:
        self.timeline.add("notify", tuple(self.cp_of[agent] for agent, _ in messages))
        self.notified.extend(messages)

    def connected(self, agent: str) -> bool:
        return agent in self.cp_of

    def releases(self) -> dict[int, TicketRelease]:
        return {self.cp_of[agent]: decode(body, TicketRelease, FP) for agent, body in self.notified}
