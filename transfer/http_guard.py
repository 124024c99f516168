"""The HTTP services' connection guard: timers for stalled connections, and room at the limit.

Used by `transfer.control.HttpService` beneath aiohttp's protocol; `request_started` and
`request_finished` are called by its middleware around each request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
from collections import OrderedDict
from collections.abc import Callable
from itertools import islice
from typing import Any

from aiohttp import StreamReader, web

from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 1024  # a site's; fewer if the process's open-files limit runs out first
FD_RESERVE = 256  # open files kept for what else a service holds (UCX, logs, its own clients)


def _fd_budget() -> float:
    """Connections this process can hold before accept() fails for everyone (EMFILE)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return math.inf if soft == resource.RLIM_INFINITY else max(16, soft - FD_RESERVE)


class ConnectionGuard:
    """Counts a site's connections, closes those that stall, and at its limit makes room.

    aiohttp has no bound on the time to receive a request head, and keeps every
    connection it accepts: a slow client (slow-loris) holds a socket and its buffers for
    as long as it likes. Each connection gets a timer, armed when it opens and after each
    reply, disarmed when a request reaches the handlers; when it fires the connection is
    closed. Beyond `limit` a new connection evicts an idle one (no request in progress):
    one that has sent nothing since it opened or was last answered, oldest first, else one
    part way through a request head, oldest first. Only when every other connection is
    serving a request is the new one closed, so idle sockets cannot lock others out.
    A new connection gets `timeouts.header` to send a request head; an answered one
    `timeouts.idle` to send the next.
    """

    _by_transport: dict[Any, _Tracked] = {}
    total = 0  # connections open in this process, over every site: they share its open-files limit

    def __init__(self, factory: Callable[[], asyncio.Protocol], limit: int, timeouts: Timeouts) -> None:
        self.factory, self.limit = factory, limit
        self.header_timeout, self.idle_timeout = timeouts.header, timeouts.idle
        self.budget = _fd_budget()
        self.live = self.evicted = 0
        self.quiet: OrderedDict[_Tracked, None] = OrderedDict()  # idle, nothing received since opened or answered
        self.heads: OrderedDict[_Tracked, None] = OrderedDict()  # idle, a request head on its way

    def __call__(self) -> asyncio.Protocol:
        return _Tracked(self)

    def close_idle(self) -> None:
        """Close every idle connection (at shutdown: aiohttp never saw those that sent nothing)."""
        for conn in [*self.quiet, *self.heads]:
            conn.close()

    def admit(self, newcomer: _Tracked) -> None:
        """Make room for `newcomer` if this site or the process is over its limit."""
        if self.live <= self.limit and ConnectionGuard.total <= self.budget:
            return
        victim = self._victim(newcomer)
        if victim is newcomer:
            logger.warning("connection refused: %d open, limit %d, all serving requests", self.live - 1, self.limit)
        else:
            self.evicted += 1
            if self.evicted % 1000 == 1:  # one line a thousand: a flood must not flood the log as well
                logger.warning("at the limit of %d connections: %d idle ones evicted so far", self.limit, self.evicted)
        victim.close()

    def _victim(self, newcomer: _Tracked) -> _Tracked:
        """The oldest quiet connection, else the oldest with a head on its way, else the newcomer."""
        for tier in (self.quiet, self.heads):
            for conn in islice(tier, 2):  # the newcomer, last in, is among the first two only if alone
                if conn is not newcomer:
                    return conn
        return newcomer

    @classmethod
    def request_started(cls, request: web.Request) -> None:
        tracked = cls._by_transport.get(request.transport)
        if tracked is not None:
            tracked.busy += 1
            tracked.not_idle()
            tracked.disarm()

    @classmethod
    def request_finished(cls, request: web.Request) -> None:
        tracked = cls._by_transport.get(request.transport)
        if tracked is not None:
            tracked.busy -= 1
            if not request.content.is_eof():  # aiohttp now reads on and drops the rest ("lingering")
                tracked.unread = request.content
            if tracked.busy == 0:
                tracked.guard.quiet[tracked] = None
                tracked.arm(tracked.guard.idle_timeout)


class _Tracked(asyncio.Protocol):
    """A protocol wrapper: owns the head timer and forwards everything to aiohttp's protocol,
    made at the first byte: a flood of silent connections, evicted unheard, costs aiohttp nothing."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.inner: Any = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = 0
        self.unread: StreamReader | None = None  # a body its handler left unread

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.guard.live += 1
        ConnectionGuard.total += 1
        ConnectionGuard._by_transport[transport] = self
        self.guard.quiet[self] = None
        self.arm()
        self.guard.admit(self)

    def arm(self, seconds: float | None = None) -> None:
        self.disarm()
        wait = self.guard.header_timeout if seconds is None else seconds
        self.timer = asyncio.get_running_loop().call_later(wait, self._expire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def not_idle(self) -> None:
        self.guard.quiet.pop(self, None)
        self.guard.heads.pop(self, None)

    def close(self) -> None:
        """Closed at once: an idle connection has no reply to finish (a slow reader's is dropped)."""
        self.not_idle()
        if self.transport is None:
            return
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

    def _expire(self) -> None:
        if self.busy == 0 and self.transport is not None:
            logger.info("closing a connection that sent no complete request in time")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.not_idle()
        self.guard.live -= 1
        ConnectionGuard.total -= 1
        ConnectionGuard._by_transport.pop(self.transport, None)
        if self.inner is not None:
            self.inner.connection_lost(exc)
        if self.unread is not None:  # aiohttp's lingering read would wait out its 10 s for bytes that never come
            self.unread.feed_eof()

    def data_received(self, data: bytes) -> None:
        if self in self.guard.quiet:  # its first bytes since it opened or was answered: a head on its way
            del self.guard.quiet[self]
            self.guard.heads[self] = None
        if self.inner is None:
            self.inner = self.guard.factory()
            self.inner.connection_made(self.transport)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.inner is None else self.inner.eof_received()  # None: close it

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
