"""What the decode's protocols share: its context, one fetch's state, and its tasks.

Every owner's work runs in a task the fetcher can cancel at close (`TaskSet`); a group of
them ends together, at the first failure (`all_or_cancel`), and only once every one of
them has ended, so that no READ is still landing when the caller hears the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from pdkv.errors import ClosedError, MetadataError
from transfer.control import ControlClient
from transfer.deadline import Deadline
from transfer.decode.landing import Landing
from transfer.engine_kv import KVBuffers
from transfer.readiness import ReadinessFeed
from transfer.timeouts import Timeouts

T = TypeVar("T")


@dataclass(slots=True)
class Fetch:
    """One fetch (or one read under a lease) as it travels down: its room, its checked
    destination pages, its budget and its clock; and, for a caller that polls from another
    thread, where a read on the GPU lane tells it it has landed."""

    engine_id: str
    room: int
    dst: np.ndarray
    deadline: Deadline
    started: float
    landing: Landing | None = None
    skip: int = 0  # the room's first pages the decode holds already (its prefix): not read

    def wanted(self, src: np.ndarray, room: int) -> np.ndarray:
        """The room's source pages `src` this read fills, checked against its destination."""
        if src.size != self.skip + self.dst.size:
            raise MetadataError(
                f"room {room}: {src.size} source pages, {self.skip} held and {self.dst.size} destination pages"
            )
        return src[self.skip :]


def eager_task(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task[T]:
    """A task whose first step runs in this call (Python >= 3.12), not at the loop's next
    turn, after whatever else is ready: a read handed over from another thread launches, a
    claim's call is sent, before the loop looks for other work."""
    loop = loop or asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return loop.create_task(coro)


class TaskSet:
    """Tasks of owners' work in flight; `cancel_all` ends them when the fetcher closes."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    async def run(self, work: Awaitable[T]) -> T:
        """`work` in a task that `cancel_all` may cancel (the caller then gets `ClosedError`)."""
        return (await self.each([work]))[0]

    async def each(self, works: Sequence[Awaitable[T]], abort: Awaitable[None] | None = None) -> list[T]:
        """Run `works` as tasks (a coroutine's begun in this call, `eager_task`); all their
        results, or the first error (`abort` raising counts as one), once every task has ended."""
        tasks = [eager_task(w) if asyncio.iscoroutine(w) else asyncio.ensure_future(w) for w in works]
        return await self.gather(tasks, abort)

    async def gather(self, tasks: Sequence[asyncio.Future[T]], abort: Awaitable[None] | None = None) -> list[T]:
        """As `each`, for tasks already started."""
        self._tasks.update(tasks)
        try:
            return await all_or_cancel(tasks, abort)
        finally:
            self._tasks.difference_update(tasks)

    def cancel_all(self) -> None:
        for t in self._tasks:
            t.cancel()


class Activity:
    """Counts the fetcher's calls in flight, so that close waits for them; refuses new ones
    once closed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.open = False
        self.closing = False
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def check(self) -> None:
        if not self.open or self.closing:
            state = "closed" if self.closing else "not started"
            raise ClosedError(f"DecodeFetcher {self.name} is {state}: use `async with` or start()")

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        self.check()
        self.active += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0:
                self.idle.set()


@dataclass
class DecodeContext:
    """What the fetcher's parts share: its pool, bounds, identity, control client, pushed
    readiness, tasks and activity."""

    pool: KVBuffers
    timeouts: Timeouts
    consumer_id: str
    client: ControlClient
    feed: ReadinessFeed
    tasks: TaskSet = field(default_factory=TaskSet)

    @property
    def fingerprint(self) -> str:
        return self.pool.layout.fingerprint


def budget(default: float, deadline: Deadline | None, timeout: float | None) -> Deadline:
    """A call's deadline: the one given, or `timeout` (else `default`) seconds from now."""
    if deadline is not None and timeout is not None:
        raise ValueError("give a deadline or a timeout, not both")
    if deadline is not None:
        return deadline
    return Deadline.after(default if timeout is None else timeout)


async def to_the_end(aw: Awaitable[T]) -> T:
    """`aw` awaited until it has ended, through any cancellation meanwhile, which is raised
    once it has: for a wait that must outlast its caller's cancel (a copy still landing in
    pages that may be handed out again once the caller hears its outcome)."""
    task = asyncio.ensure_future(aw)
    cancel: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            if task.cancelled():  # `aw` itself was cancelled: that is its end
                raise
            cancel = cancel or exc
    if cancel is not None:
        raise cancel
    return task.result()


async def all_or_cancel(tasks: Sequence[asyncio.Future[T]], abort: Awaitable[None] | None = None) -> list[T]:
    """Await every task; on the first failure (or cancellation) cancel the rest and wait.
    `abort`: raises when the work must stop (the room was aborted), as a failure would.

    A task cancelled while this caller was not means the fetcher was closed under it.
    """
    watch = asyncio.ensure_future(abort) if abort is not None else None
    try:
        await _first_failure(tasks, watch)
    finally:
        if watch is not None and not watch.done():
            watch.cancel()
        if not all(t.done() for t in tasks):
            for t in tasks:
                t.cancel()
            # Collects every outcome; a cancel of our own arriving meanwhile propagates.
            await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:  # every outcome read, so none is logged as "never retrieved" after an abort
        if t.done() and not t.cancelled():
            t.exception()
    if watch is not None and watch.done() and not watch.cancelled() and (exc := watch.exception()) is not None:
        raise exc
    for t in tasks:
        if not t.cancelled() and (exc := t.exception()) is not None:
            raise exc
    if any(t.cancelled() for t in tasks):
        raise ClosedError("the DecodeFetcher was closed while this fetch was in flight")
    return [t.result() for t in tasks]


async def _first_failure(tasks: Sequence[asyncio.Future[T]], watch: asyncio.Future[None] | None) -> None:
    """Return once every task is done, one has failed, or `watch` has raised."""
    if watch is None:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        return
    pending: set[asyncio.Future[Any]] = {*tasks, watch}
    while True:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if any(not t.cancelled() and t.exception() is not None for t in done) or watch in done:
            return
        if pending == {watch}:
            return
