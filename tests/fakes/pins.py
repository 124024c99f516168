"""The ticket's pins: an owner's pin table mapped here, and signals for pin words and notifications."""

from __future__ import annotations

import asyncio
from typing import Any

from pdkv.errors import PeerLostError
from tests.fakes.memory import FP
from tests.fakes.timeline import Timeline
from transfer.deadline import Deadline
from transfer.lanes.base import Signals
from transfer.metadata import RankDescriptor, TicketRelease, decode


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


class FakeTransport:
    """What `FakeSignals.transport` reports."""

    workers = 1

    def __init__(self, signals: FakeSignals) -> None:
        self._signals = signals

    @property
    def peer_count(self) -> int:
        return len(self._signals.cp_of)


class FakeSignals:
    """`transfer.lanes.base.Signals` for tickets and releases: remote pin words by address,
    notifications recorded; an agent is connected while `cp_of` names it."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.words: dict[int, int] = {}  # address -> int64 word
        self.cp_of: dict[str, int] = {}  # agent name -> cp rank
        self.notified: list[tuple[str, bytes]] = []
        self.registered: list[Any] = []
        self.closed = False
        self.transport = FakeTransport(self)

    async def connect(self, rank: RankDescriptor) -> None:
        self.cp_of[rank.agent_name] = rank.cp_rank

    async def disconnect(self, rank: RankDescriptor) -> None:
        self.cp_of.pop(rank.agent_name, None)

    def register(self, windows: Any) -> None:
        self.registered.append(windows)

    async def read_word(self, agent: str, addr: int, window: Any, deadline: Deadline) -> None:
        if agent not in self.cp_of:
            raise PeerLostError(f"no connection to {agent}", agent)
        self.timeline.add("pin_read", self.cp_of[agent])
        await asyncio.sleep(0)
        for i in range(len(window)):
            window[i] = self.words.get(addr + 8 * i, 0)

    def notify(self, messages: list[tuple[str, bytes]]) -> list[str]:
        sent = [(agent, body) for agent, body in messages if agent in self.cp_of]
        if sent:
            self.timeline.add("notify", tuple(self.cp_of[agent] for agent, _ in sent))
            self.notified.extend(sent)
        return [agent for agent, _ in messages if agent not in self.cp_of]

    async def drain(self) -> None:
        pass

    async def aclose(self) -> None:
        self.closed = True

    def releases(self) -> dict[int, TicketRelease]:
        return {self.cp_of[agent]: decode(body, TicketRelease, FP) for agent, body in self.notified}


def _typed(timeline: Timeline) -> Signals:  # mypy checks the fake against the protocol here
    return FakeSignals(timeline)
