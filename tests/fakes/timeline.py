"""The one clock of the fakes: events in order, and the awaits a test may cancel at."""

from __future__ import annotations

import asyncio
from typing import Any


class Timeline:
    """Events in the order they happened; an event's index is its time."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def add(self, *event: Any) -> int:
        self.events.append(event)
        return len(self.events) - 1

    def where(self, *prefix: Any) -> list[int]:
        """Indices of the events starting with `prefix`."""
        return [i for i, e in enumerate(self.events) if e[: len(prefix)] == prefix]

    def first(self, *prefix: Any) -> int:
        found = self.where(*prefix)
        assert found, f"no event {prefix} in {self.events}"
        return found[0]

    def last(self, *prefix: Any) -> int:
        found = self.where(*prefix)
        assert found, f"no event {prefix} in {self.events}"
        return found[-1]


class Awaits:
    """The protocol's awaits on the fakes, in order; at the `cancel_at`-th, cancel `target`
    and hand that await a gate that never opens (so the cancellation lands right there)."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.labels: list[tuple[Any, ...]] = []
        self.cancel_at: int | None = None
        self.target: asyncio.Future[Any] | None = None
        self.fired = False
        self.never = asyncio.Event()

    def reach(self, *label: Any) -> asyncio.Event | None:
        if self.fired:
            return None  # what runs after the cancellation (give-ups) is not counted
        n = len(self.labels)
        self.labels.append(label)
        if n == self.cancel_at:
            assert self.target is not None
            self.fired = True
            self.timeline.add("cancel", *label)
            self.target.cancel()
            return self.never
        return None
