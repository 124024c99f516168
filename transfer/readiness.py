"""Readiness pushed, not polled: one event stream per (decode, owner).

A decode reading a room that is still being prefilled needs to learn when more of its
layers are written. Rather than a long-poll per owner per batch of layers, each decode
keeps one stream open to each owner it reads (`GET /v1/events?consumer=<id>`); the owner
writes a `RoomState` frame whenever a room that consumer holds a claim on moves (layers
ready, released, aborted), and a heartbeat when nothing moved for a while. A stream the
owner ended costs nothing but speed: the decode polls over HTTP as before. One that fell
silent for three heartbeats or broke means the owner is out of reach: the rooms read from
it fail at once (`ReadinessFeed.aborted`), and the owner, whose writes then go
unacknowledged, drops the stream and gives that consumer's claims up (`ReadinessHub`).

Frames: a 4-byte big-endian length, then an enveloped `RoomState`; length 0 is a heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Callable, Iterable

from pdkv.errors import DeadlineExceeded, PdkvError, PeerLostError, RoomAbortedError
from transfer.control import ControlClient
from transfer.deadline import wait_until
from transfer.metadata import RoomState, RoomStatus, decode, encode, error_from

logger = logging.getLogger(__name__)

HEARTBEAT = struct.pack(">I", 0)
STREAM_TYPE = "application/x-pdkv-frames"
_QUEUE_LIMIT = 4096  # states waiting for a slow consumer; beyond, its stream is dropped
_MAX_FRAME = 1 << 24


def frame(state: RoomState, fingerprint: str) -> bytes:
    body = encode(state, fingerprint)
    return struct.pack(">I", len(body)) + body


class Subscription:
    """One consumer's stream on an owner: the states to send, in order."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[RoomState] = asyncio.Queue(_QUEUE_LIMIT)
        self.closed = asyncio.Event()

    def push(self, state: RoomState) -> None:
        try:
            self._queue.put_nowait(state)
        except asyncio.QueueFull:  # the consumer falls back to polling when its stream ends
            logger.warning("readiness stream too far behind: closing it")
            self.closed.set()

    async def next(self, timeout: float) -> RoomState | None:
        """The next state to send; None after `timeout` (send a heartbeat) or once closed."""
        if self.closed.is_set():
            return None
        get = asyncio.ensure_future(self._queue.get())
        closed = asyncio.ensure_future(self.closed.wait())
        try:
            await asyncio.wait([get, closed], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            if not get.done():
                get.cancel()
        return get.result() if get.done() and not get.cancelled() and not self.closed.is_set() else None


def aborted_error(state: RoomState, rank: int) -> RoomAbortedError:
    """The error a decode raises for an aborted `state` from CP rank `rank`: where the
    prefill failed the room, it names that error and is caused by it (rebuilt by name)."""
    where = f"room {state.room} was aborted on cp rank {rank}"
    if state.reason is None:
        return RoomAbortedError(f"{where} (or its pin expired there)")
    error = RoomAbortedError(f"{where}: its prefill failed it: {state.reason.code}: {state.reason.message}")
    error.__cause__ = error_from(state.reason, f"room {state.room}, cp rank {rank}")
    return error


def _moved(state: RoomState, after: int, after_pages: int) -> bool:
    pages = state.ready_pages is not None and state.ready_pages > after_pages
    return pages or state.ready_upto > after or state.status is not RoomStatus.PENDING


class ReadinessHub:
    """The owner's side: who listens, and whom a room's change concerns. `on_lost(consumer)`:
    a consumer's stream ended from its side (it went away, or its link was cut), not
    replaced by a new one nor closed here, and no new one came within `grace` seconds (a
    release it sent before closing may still be on its way): the owner gives its claims up."""

    def __init__(self, on_lost: Callable[[str], object] = lambda consumer: None, grace: float = 0.0) -> None:
        self._subs: dict[str, Subscription] = {}
        self._on_lost, self._grace = on_lost, grace
        self._closed = False

    def subscribe(self, consumer: str) -> Subscription:
        old = self._subs.get(consumer)
        if old is not None:  # the consumer reconnected: its old stream ends
            old.closed.set()
        sub = self._subs[consumer] = Subscription()
        return sub

    def unsubscribe(self, consumer: str, sub: Subscription) -> None:
        if self._subs.get(consumer) is sub:
            del self._subs[consumer]
            if not sub.closed.is_set():
                asyncio.get_running_loop().call_later(self._grace, self._lost, consumer)

    def _lost(self, consumer: str) -> None:
        if consumer not in self._subs and not self._closed:  # not back meanwhile
            self._on_lost(consumer)

    @property
    def consumers(self) -> list[str]:
        """The consumers with a stream open."""
        return list(self._subs)

    def publish(self, state: RoomState, consumers: Iterable[str]) -> None:
        for consumer in consumers:
            sub = self._subs.get(consumer)
            if sub is not None:
                sub.push(state)

    def close(self) -> None:
        self._closed = True
        for sub in self._subs.values():
            sub.closed.set()
        self._subs.clear()


class ReadinessFeed:
    """The decode's side: a stream per owner, and the latest pushed state of each room a
    fetch is waiting on."""

    def __init__(self, client: ControlClient, consumer_id: str, fingerprint: str, heartbeat: float) -> None:
        self._client, self._consumer, self._fp = client, consumer_id, fingerprint
        self._heartbeat = heartbeat
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._live: set[str] = set()
        self._wanted: dict[tuple[str, int], RoomState | None] = {}
        self._moved: dict[str, asyncio.Event] = {}
        self._lost: dict[str, str] = {}  # owners whose stream fell silent or broke: why

    def want(self, url: str, room: int) -> None:
        """Keep `room`'s pushed states from the owner at `url`; open its stream if needed."""
        self._wanted.setdefault((url, room), None)
        task = self._streams.get(url)
        if task is None or task.done():
            self._lost.pop(url, None)
            self._streams[url] = asyncio.ensure_future(self._run(url))

    def take_lost(self, urls: Iterable[str]) -> bool:
        """Whether any owner of `urls` was lost since its last stream; those marks are cleared
        (the caller drops their connections and looks the owners up anew)."""
        return bool([url for url in urls if self._lost.pop(url, None) is not None])

    async def until_lost(self, url: str, timeout: float) -> bool:
        """Wait (at most `timeout`) until the owner at `url` is lost; True if it is."""
        moved = lambda: self._moved.setdefault(url, asyncio.Event())  # noqa: E731
        return await wait_until(lambda: url in self._lost, moved, timeout)

    def lost(self, url: str) -> bool:
        """Whether the owner at `url` is taken as unreachable: its stream fell silent (no
        heartbeat for three intervals) or broke, and no new one was opened since."""
        return url in self._lost

    def latest(self, url: str, room: int) -> RoomState | None:
        """The last state pushed of a wanted `room` by the owner at `url`, if any."""
        return self._wanted.get((url, room))

    def forget(self, url: str, room: int) -> None:
        self._wanted.pop((url, room), None)

    async def wait(self, url: str, room: int, after: int, timeout: float, after_pages: int = -1) -> RoomState | None:
        """`room`'s state once it has layers beyond `after`, chunks' pages beyond
        `after_pages`, or is all ready; None if the stream is down or nothing came within
        `timeout`: the caller then polls."""

        def arrived() -> bool:
            state = self._wanted.get((url, room))
            return state is not None and _moved(state, after, after_pages)

        def over() -> bool:  # arrived, or the stream went down
            return arrived() or url not in self._live

        await wait_until(over, lambda: self._moved.setdefault(url, asyncio.Event()), timeout)
        return self._wanted.get((url, room)) if arrived() else None

    async def aborted(self, urls: dict[str, int], room: int) -> None:
        """Raise `RoomAbortedError` as soon as an owner's stream (of `urls`: control URL ->
        CP rank) says `room` was aborted there, and `PeerLostError` once an owner's stream
        fell silent or broke (its link cut, its process gone: `lost`); until then wait (the
        caller cancels it). An owner whose stream the owner ended is not watched: its abort
        shows at its next poll or release instead."""
        while True:
            for url, rank in urls.items():
                if url in self._lost:
                    raise PeerLostError(f"room {room}: cp rank {rank} unreachable: {self._lost[url]}", url)
                state = self._wanted.get((url, room))
                if state is not None and state.status is RoomStatus.ABORTED:
                    raise aborted_error(state, rank)
            waits = [asyncio.ensure_future(self._moved.setdefault(url, asyncio.Event()).wait()) for url in urls]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def _run(self, url: str) -> None:
        target = f"{url}/v1/events?consumer={self._consumer}"
        try:
            async for state in self._frames(target):
                self._live.add(url)
                if state is not None and (url, state.room) in self._wanted:
                    self._wanted[(url, state.room)] = state
                self._wake(url)
        except (DeadlineExceeded, PeerLostError) as exc:  # silent or broken: the owner is out of reach
            self._lost[url] = f"its readiness stream ended: {exc}"
            logger.warning("readiness stream from %s ended (%s): its rooms fail", url, exc)
        except PdkvError as exc:
            logger.info("readiness stream from %s ended (%s): polling instead", url, exc)
        finally:
            self._live.discard(url)
            self._wake(url)

    def _wake(self, url: str) -> None:
        moved = self._moved.pop(url, None)
        if moved is not None:
            moved.set()

    async def _frames(self, url: str) -> AsyncIterator[RoomState | None]:
        async for body in self._client.stream(url, idle_timeout=3 * self._heartbeat, max_frame=_MAX_FRAME):
            yield None if not body else decode(body, RoomState, self._fp)

    async def aclose(self) -> None:
        for task in self._streams.values():
            task.cancel()
        await asyncio.gather(*self._streams.values(), return_exceptions=True)
        self._streams.clear()
