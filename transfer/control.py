"""The HTTP control plane: msgpack bodies over aiohttp, a shared secret, typed errors.

Plain HTTP keeps the control plane probeable with curl. Errors travel as `ErrorReply`
with the error's class name and its ancestors' names, and come back out of the client as
the most specific class of the pdkv error tree that the receiver knows; HTTP statuses
follow the class with `isinstance`, so a subclass answers its parent's status. aiohttp's
own errors are translated here and nowhere else.

Every service refuses what would cost it memory or sockets before paying it: a body over
`MAX_BODY` by its Content-Length before reading (and a body without one as soon as the
limit is passed), a body not received within `Timeouts.body`, a connection that does not
finish a request head within `Timeouts.header` (or, once answered, send the next within
`Timeouts.idle`), and, beyond `MAX_CONNECTIONS`, the connection idle longest. The bounds
are those of the `Timeouts` given to the `HttpService` that serves the app.

Calls on a hot path (a decode's claims) go over a *channel* instead: one websocket a peer
kept open to the endpoint, upgraded from a request that passed the same checks, carrying
pipelined calls (a call id, then an envelope each way). A call costs a frame each way
rather than an HTTP exchange (its parsing, routing and middleware): several times less on a
loaded host. Every call still has its own deadline; a channel that breaks fails the calls
on it with `PeerLostError`, and the next call opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import mmap
import re
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from itertools import count
from typing import TypeVar

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_TYPE
from prometheus_client import REGISTRY, generate_latest

from pdkv import errors
from pdkv.errors import AuthError, CapacityError, DeadlineExceeded, MetadataError, PdkvError, PeerLostError
from transfer.addresses import http_url, is_wildcard
from transfer.deadline import Deadline, bounded
from transfer.http_guard import MAX_CONNECTIONS, ConnectionGuard
from transfer.logctx import request_context
from transfer.metadata import ErrorReply, decode, encode, error_from, error_reply
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

SECRET_HEADER = "X-Pdkv-Secret"
CONTENT_TYPE = "application/x-msgpack"
MAX_BODY = 4 << 20  # the largest message, a RankDescriptor, is kilobytes
_HEAP_BODY = 64 << 10  # a body announced this small is read in one piece; others go through a map
_OPEN_PATHS = ("/health", "/ready", "/metrics")  # for probes and scrapers: no secret asked
BACKLOG = 4096  # handshaken connections queued for accept (the kernel caps it at net.core.somaxconn)
ACCEPT_BATCH = 32  # connections asyncio accepts per wake-up: a flood must not make one loop turn long

T = TypeVar("T", bound=msgspec.Struct)
R = TypeVar("R")
_TIMEOUTS = web.AppKey("pdkv.timeouts", Timeouts)  # the serving HttpService's, for its handlers


class BodyTooLargeError(MetadataError):
    """A request body over `MAX_BODY` (answered 413, the connection closed unread)."""


# Most specific first: the first class an error is an instance of gives its status.
_STATUS: tuple[tuple[type[PdkvError], int], ...] = (
    (errors.AuthError, 401),
    (errors.UnknownRoomError, 404),
    (errors.UnknownEngineError, 404),
    (errors.IncompatibleLayoutError, 409),
    (errors.ConflictError, 409),
    (errors.ClaimLostError, 410),
    (BodyTooLargeError, 413),
    (errors.MetadataError, 400),
    (errors.InvalidPagesError, 400),
    (errors.PageRangeError, 400),
    (errors.LayoutError, 400),
    (errors.NotReadyError, 503),
    (errors.CapacityError, 503),
    (errors.ClosedError, 503),
    (errors.DeadlineExceeded, 504),
)
_INT = re.compile(r"-?[0-9]{1,20}")


def status_of(exc: PdkvError) -> int:
    """The HTTP status for a pdkv error: its nearest listed ancestor's, else 500."""
    return next((status for cls, status in _STATUS if isinstance(exc, cls)), 500)


def _parse_int(text: str, what: str, lo: int, hi: int) -> int:
    if not _INT.fullmatch(text):
        raise MetadataError(f"{what} must be a decimal integer, got {text[:32]!r}")
    value = int(text)
    if not lo <= value <= hi:
        raise MetadataError(f"{what} {value} outside [{lo}, {hi}]")
    return value


def path_int(request: web.Request, name: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """An integer path segment (a room, a rank), checked; a `MetadataError` (400) otherwise."""
    return _parse_int(request.match_info[name], name, lo, hi)


def query_int(request: web.Request, name: str, default: int, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """An optional integer query parameter, checked like `path_int`."""
    text = request.query.get(name)
    return default if text is None else _parse_int(text, name, lo, hi)


def reply(msg: msgspec.Struct, fingerprint: str = "", status: int = 200) -> web.Response:
    return web.Response(body=encode(msg, fingerprint), status=status, content_type=CONTENT_TYPE)


async def read_body(request: web.Request, kind: type[T], fingerprint: str | None = None) -> T:
    """The body, at most `MAX_BODY` bytes however it is framed, decoded as a `kind`.

    A declared length over the limit never gets here: `make_app`'s guard refuses it unread.
    It must arrive within the serving `HttpService`'s `Timeouts.body`.
    """

    async def receive() -> bytes:
        if request.content_length is not None and request.content_length <= _HEAP_BODY:
            return await request.read()
        # A map of its own, unmapped after: big bodies held in chunks, body after body, fragmented the heap.
        with mmap.mmap(-1, MAX_BODY) as buf:
            size = 0
            async for chunk in request.content.iter_any():
                if size + len(chunk) > MAX_BODY:
                    raise _too_large(size + len(chunk))
                buf[size : size + len(chunk)] = chunk
                size += len(chunk)
            return buf[:size]

    limit = request.config_dict[_TIMEOUTS].body
    try:
        data = await asyncio.wait_for(receive(), limit)
    except asyncio.TimeoutError as exc:
        raise DeadlineExceeded(f"request body not received within {limit:g}s") from exc
    return decode(data, kind, fingerprint)


def _too_large(size: int) -> BodyTooLargeError:
    return BodyTooLargeError(f"body of {size} bytes exceeds {MAX_BODY}")


async def health(request: web.Request) -> web.Response:
    """GET /health: liveness for probes (no secret needed)."""
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: this process's Prometheus metrics (no secret needed, like /health)."""
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": PROMETHEUS_TYPE})


def _error_response(exc: PdkvError) -> web.Response:
    return reply(error_reply(exc), status=status_of(exc))


def _refuse_early(request: web.Request, secret: str | None) -> None:
    """Checks that cost nothing and must come before a body is read."""
    if secret is not None and request.path not in _OPEN_PATHS:
        given = request.headers.get(SECRET_HEADER, "")
        if not hmac.compare_digest(given.encode(), secret.encode()):
            raise AuthError("missing or wrong shared secret")
    if request.content_length is not None and request.content_length > MAX_BODY:
        raise _too_large(request.content_length)


def make_app(secret: str | None, **identity: object) -> web.Application:
    """An aiohttp app that checks the shared secret and turns pdkv errors into replies.

    `identity` (engine, rank, consumer...) and the path's room, if any, are bound for every
    log line a request causes (`transfer.logctx`).
    """

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        ConnectionGuard.request_started(request)
        with request_context(**identity, room=request.match_info.get("room")):
            return await _guarded(request, handler)

    async def _guarded(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            _refuse_early(request, secret)
            return await handler(request)
        except PdkvError as exc:
            if not isinstance(exc, (AuthError, errors.UnknownRoomError, errors.UnknownEngineError)):
                logger.info("%s %s refused: %s", request.method, request.path, exc)
            resp = _error_response(exc)
            if isinstance(exc, (AuthError, BodyTooLargeError)):
                resp.force_close()  # never read (or drain) an unwanted body
            return resp
        finally:
            ConnectionGuard.request_finished(request)

    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY)
    app.router.add_get("/metrics", metrics)
    return app


def _error_from_reply(status: int, body: bytes, url: str) -> PdkvError:
    try:
        err = decode(body, ErrorReply)
    except MetadataError:
        return PdkvError(f"{url}: HTTP {status}")
    return error_from(err, url)


class ControlClient:
    """An HTTP client for control messages with the secret, deadlines and typed errors."""

    def __init__(self, timeouts: Timeouts, secret: str | None = None) -> None:
        self.timeouts = timeouts
        self._headers = {SECRET_HEADER: secret} if secret is not None else {}
        self._session: aiohttp.ClientSession | None = None
        self._channels: dict[str, _Channel] = {}  # URL -> the channel kept open to it

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(connect=self.timeouts.connect),
            )
        return self._session

    async def request(
        self,
        method: str,
        url: str,
        reply_kind: type[T] | None = None,
        body: msgspec.Struct | None = None,
        *,
        fingerprint: str = "",
        expect_fingerprint: str | None = None,
        timeout: float | None = None,
    ) -> T | None:
        """One request; every wait is bounded by `timeout` (default `Timeouts.request`)."""
        limit = self.timeouts.request if timeout is None else timeout
        data = encode(body, fingerprint) if body is not None else None

        async def exchange() -> tuple[int, bytes]:
            async with self._sess().request(method, url, data=data, headers={"Content-Type": CONTENT_TYPE}) as resp:
                return resp.status, await resp.read()

        status, payload = await _bounded(exchange(), f"{method} {url}", url, limit)
        if status != 200:
            raise _error_from_reply(status, payload, url)
        if reply_kind is None:
            return None
        return decode(payload, reply_kind, expect_fingerprint)

    async def call(
        self,
        url: str,
        body: msgspec.Struct,
        reply_kind: type[T],
        *,
        fingerprint: str,
        expect_fingerprint: str | None = None,
        timeout: float,
    ) -> T:
        """One call on the channel kept open to `url` (opened now if none is): `body` there,
        a `reply_kind` or the typed error back, within `timeout` (the opening included).

        Calls must be idempotent: a kept channel can have died unseen (its link cut and back,
        the peer dropping it meanwhile), and a call it loses is made once more on a new one."""
        limit, data = Deadline.after(timeout), encode(body, fingerprint)
        channel = self._channels.get(url)
        if channel is not None and not channel.closed:
            try:
                return decode(await channel.call(data, self._sess, limit), reply_kind, expect_fingerprint)
            except PeerLostError as exc:
                if not channel.closed:  # the peer's own answer, not a broken channel
                    raise
                logger.info("%s; calling again on a new channel", exc)
        fresh = self._channels.get(url)
        if fresh is None or fresh.closed:  # calls that lost one channel together share its successor
            fresh = self._channels[url] = _Channel(url, self.timeouts.shutdown)
        return decode(await fresh.call(data, self._sess, limit), reply_kind, expect_fingerprint)

    async def stream(self, url: str, *, idle_timeout: float, max_frame: int) -> AsyncIterator[bytes]:
        """The length-prefixed frames of a long-lived GET (b"" for a heartbeat), until the
        server ends it; a stall of `idle_timeout` between bytes raises `DeadlineExceeded`."""
        timeout = aiohttp.ClientTimeout(connect=self.timeouts.connect, sock_read=idle_timeout)
        try:
            async with self._sess().get(url, timeout=timeout) as resp:
                if resp.status != 200:
                    raise _error_from_reply(resp.status, await resp.read(), url)
                while True:
                    try:
                        (size,) = struct.unpack(">I", await resp.content.readexactly(4))
                    except asyncio.IncompleteReadError:
                        return  # the server ended the stream
                    if size > max_frame:
                        raise MetadataError(f"{url}: a frame of {size} bytes (limit {max_frame})")
                    yield await resp.content.readexactly(size) if size else b""
        except asyncio.TimeoutError as exc:
            raise DeadlineExceeded(f"GET {url}: nothing for {idle_timeout:.1f}s") from exc
        except (aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
            raise PeerLostError(f"GET {url}: {exc}", url) from exc

    async def get_text(self, url: str) -> str:
        """GET a text page (metrics), bounded by `Timeouts.request`."""
        return await self._get(url, lambda resp: resp.text())

    async def get_json(self, url: str) -> dict[str, object]:
        """GET a JSON status page (stats, health), bounded by `Timeouts.request`."""
        return await self._get(url, lambda resp: resp.json())

    async def _get(self, url: str, read: Callable[[aiohttp.ClientResponse], Awaitable[R]]) -> R:
        async def exchange() -> R:
            async with self._sess().get(url) as resp:
                resp.raise_for_status()
                return await read(resp)

        return await _bounded(exchange(), f"GET {url}", url, self.timeouts.request)

    async def aclose(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None


_CALL = struct.Struct(">Q")  # a call's id, before its envelope
_OK, _ERROR = b"\x00", b"\x01"  # an answer's mark, after the id: a reply, or an `ErrorReply`
MAX_CALLS = 1024  # calls one channel may have in flight on the serving side
_BEHIND: set[asyncio.Future[bool]] = set()  # channels closing in the background (a task needs a reference)


class _Channel:
    """One websocket to `url` carrying pipelined calls, answered by call id."""

    def __init__(self, url: str, close_timeout: float) -> None:
        self.url, self._close_timeout = url, close_timeout
        self._ws: aiohttp.ClientWebSocketResponse[bool] | None = None
        self._opening: asyncio.Future[aiohttp.ClientWebSocketResponse[bool]] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._ids = count(1)
        self.closed = False

    async def call(self, data: bytes, session: Callable[[], aiohttp.ClientSession], deadline: Deadline) -> bytes:
        ws = await self._open(session, deadline)
        call = next(self._ids)
        answer: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[call] = answer

        async def exchange() -> bytes | PdkvError:
            try:
                await ws.send_bytes(_CALL.pack(call) + data)
            except ConnectionError as exc:  # the channel broke, maybe before its reader heard of it
                self._fail(PeerLostError(f"channel to {self.url}: {exc}", self.url))
                raise PeerLostError(f"call {self.url}: {exc}", self.url) from exc
            try:
                return await answer
            except PdkvError as exc:  # the peer's refusal (a `DeadlineExceeded` too), or the channel's loss
                return exc

        try:
            out = await _bounded(exchange(), f"call {self.url}", self.url, deadline.left())
        except DeadlineExceeded:
            # The peer answers within the budget a call names: one that did not may be gone
            # without a word (a cut link). Later calls open a new channel, which fails fast
            # then; this one ends once its calls have.
            self.closed = True
            raise
        finally:
            self._pending.pop(call, None)
            if self.closed and not self._pending and self._ws is not None and not self._ws.closed:
                _BEHIND.add(closing := asyncio.ensure_future(self._ws.close()))
                closing.add_done_callback(_BEHIND.discard)
        if isinstance(out, PdkvError):
            raise out
        return out

    async def _open(
        self, session: Callable[[], aiohttp.ClientSession], deadline: Deadline
    ) -> aiohttp.ClientWebSocketResponse[bool]:
        if self._ws is not None:
            return self._ws
        if self._opening is None:  # concurrent first calls share one opening
            timeout = aiohttp.ClientWSTimeout(ws_close=self._close_timeout)
            opening = session().ws_connect(self.url, max_msg_size=MAX_BODY, timeout=timeout)
            self._opening = asyncio.ensure_future(_awaited(opening))
            self._opening.add_done_callback(self._opened)
        what = f"open {self.url}"
        try:
            return await asyncio.wait_for(asyncio.shield(self._opening), deadline.left(what=what))
        except asyncio.TimeoutError as exc:
            self.closed = True  # an opening that hangs (a peer stopped, a cut link) is not waited on again
            raise DeadlineExceeded(f"{what}: not open in time") from exc
        except aiohttp.WSServerHandshakeError as exc:  # refused (a wrong secret), or not served there
            why = f"{what}: HTTP {exc.status} {exc.message}"
            raise (AuthError(why) if exc.status == 401 else PeerLostError(why, self.url)) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise PeerLostError(f"{what}: {exc}", self.url) from exc

    def _opened(self, opening: asyncio.Future[aiohttp.ClientWebSocketResponse[bool]]) -> None:
        if opening.cancelled() or opening.exception() is not None:
            self.closed = True  # the next call opens another
            return
        if self.closed:  # given up on while it opened (replaced, or closed here): nobody will use it
            _BEHIND.add(closing := asyncio.ensure_future(opening.result().close()))
            closing.add_done_callback(_BEHIND.discard)
            return
        self._ws = opening.result()
        self._reader = asyncio.ensure_future(self._read(self._ws))

    async def _read(self, ws: aiohttp.ClientWebSocketResponse[bool]) -> None:
        why = "closed by the peer"
        try:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.BINARY or len(msg.data) < _CALL.size + 1:
                    why = f"an unexpected frame ({msg.type.name})"
                    break
                (call,) = _CALL.unpack_from(msg.data)
                answer = self._pending.get(call)
                if answer is None or answer.done():  # its caller gave up on it
                    continue
                mark, body = msg.data[_CALL.size : _CALL.size + 1], msg.data[_CALL.size + 1 :]
                if mark == _OK:
                    answer.set_result(body)
                else:
                    answer.set_exception(_error_from_frame(body, self.url))
        except (aiohttp.ClientError, OSError) as exc:
            why = str(exc)
        finally:
            self._fail(PeerLostError(f"channel to {self.url}: {why}", self.url))
            await ws.close()

    def _fail(self, error: PdkvError) -> None:
        self.closed = True
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(error)
                answer.exception()  # retrieved: a caller that gave up never reads it
        self._pending.clear()

    async def aclose(self) -> None:
        self._fail(PeerLostError(f"channel to {self.url}: closed here", self.url))
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


async def _awaited(opening: Awaitable[R]) -> R:
    return await opening


def _error_from_frame(body: bytes, url: str) -> PdkvError:
    try:
        return error_from(decode(body, ErrorReply), url)
    except MetadataError as exc:
        return exc


Answer = Callable[[bytes], bytes | Awaitable[bytes]]
"""A channel's serving side: a call's envelope in, its reply's out (a pdkv error: refused);
an awaitable where the answer must wait (a claim on a room not published yet, or relayed)."""


async def serve_channel(
    request: web.Request, answer: Answer, closing: set[web.WebSocketResponse]
) -> web.StreamResponse:
    """Serve a channel on `request` (its upgrade passed the app's checks). A call answered
    at once is sent from here, as a task for every call would cost a claim a turn of the
    loop; one that must wait is awaited in a task of its own, so that it holds up no other.
    `closing`: the open channels, for the service's close."""
    # A peer that does not answer the close frame is not waited for beyond the service's shutdown bound.
    ws = web.WebSocketResponse(max_msg_size=MAX_BODY, timeout=request.config_dict[_TIMEOUTS].shutdown)
    await ws.prepare(request)
    closing.add(ws)
    calls: set[asyncio.Task[None]] = set()

    async def send(call: bytes, out: bytes) -> None:
        if not ws.closed:
            with contextlib.suppress(ConnectionError):
                await ws.send_bytes(call + out)

    async def later(call: bytes, pending: Awaitable[bytes]) -> None:
        await send(call, await pending)

    try:
        async for msg in ws:
            if msg.type is not aiohttp.WSMsgType.BINARY or len(msg.data) < _CALL.size:
                break
            call, data = msg.data[: _CALL.size], msg.data[_CALL.size :]
            if len(calls) >= MAX_CALLS:
                refused = CapacityError(f"{MAX_CALLS} calls in flight on one channel")
                await ws.send_bytes(call + _ERROR + encode(error_reply(refused)))
                continue
            out = _frame(answer, data, request.path)
            if isinstance(out, bytes):
                await send(call, out)
                continue
            task = asyncio.ensure_future(later(call, out))
            calls.add(task)
            task.add_done_callback(calls.discard)
    finally:
        closing.discard(ws)
        for task in list(calls):
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)
        await ws.close()
    return ws


def _frame(answer: Answer, data: bytes, path: str) -> bytes | Awaitable[bytes]:
    """The body of the frame that answers `data`: the reply or the refusal, or an awaitable of it."""
    try:
        out = answer(data)
    except Exception as exc:
        return _refusal(exc, path)
    return _OK + out if isinstance(out, bytes) else _frame_later(out, path)


async def _frame_later(pending: Awaitable[bytes], path: str) -> bytes:
    try:
        return _OK + await pending
    except Exception as exc:
        return _refusal(exc, path)


def _refusal(exc: Exception, path: str) -> bytes:
    if not isinstance(exc, PdkvError):  # a bug: the caller hears of it now, not at its deadline
        logger.error("a call on %s failed", path, exc_info=exc)
        exc = PdkvError("the call failed on the serving side (see its log)")
    return _ERROR + encode(error_reply(exc))


async def _bounded(exchange: Awaitable[R], what: str, url: str, limit: float) -> R:
    """One HTTP exchange under `limit` seconds, its failures as pdkv errors."""
    try:
        return await bounded(exchange, limit)
    except asyncio.TimeoutError as exc:
        raise DeadlineExceeded(f"{what}: no answer within {limit:.1f}s") from exc
    except aiohttp.ClientError as exc:
        raise PeerLostError(f"{what}: {exc}", url) from exc


class HttpService:
    """An aiohttp app bound to host:port (port 0 picks a free one); `url` once started.

    `host` is where it listens (an address of this host, or the wildcard `0.0.0.0` / `::`);
    `advertise` is the host its `url` names, for peers (`transfer.addresses`): by default the
    bound address, or loopback of its family for a wildcard bind. `unacked_timeout`: a
    connection whose sent bytes stay unacknowledged this long is dropped (TCP_USER_TIMEOUT),
    so a stream to a peer behind a cut link ends rather than filling its buffer unheard.
    `timeouts`: its `header`, `idle` and `body` bound each connection and request (they are
    set on `app` for its handlers), its `shutdown` the handlers still running at close."""

    def __init__(
        self,
        app: web.Application,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        advertise: str | None = None,
        unacked_timeout: float | None = None,
        max_connections: int = MAX_CONNECTIONS,
        timeouts: Timeouts = Timeouts(),
    ) -> None:
        app[_TIMEOUTS] = timeouts
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=timeouts.shutdown)
        self._host, self._port = host.strip("[]"), port
        self._advertise, self._unacked = advertise, unacked_timeout
        self._limits = (max_connections, timeouts)
        self._server: asyncio.AbstractServer | None = None
        self._guard: ConnectionGuard | None = None
        self.url = ""

    async def start(self) -> str:
        await self._runner.setup()
        assert self._runner.server is not None
        self._guard = guard = ConnectionGuard(self._runner.server, *self._limits)
        loop = asyncio.get_running_loop()
        # asyncio's backlog is also its accept batch: a small one, then listen() deeper (an overflow drops SYNs).
        self._server = await loop.create_server(guard, self._host, self._port, reuse_address=True, backlog=ACCEPT_BATCH)
        for sock in self._server.sockets:
            if self._unacked is not None and hasattr(socket, "TCP_USER_TIMEOUT"):  # accepted sockets inherit it
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, round(self._unacked * 1000)))
            with sock.dup() as same:
                same.listen(BACKLOG)
        host, port = self._server.sockets[0].getsockname()[:2]
        if self._advertise is None and is_wildcard(host):  # what a client on this host connects to
            host = "::1" if ":" in host else "127.0.0.1"
        self.url = http_url(self._advertise or host, port)
        return self.url

    @property
    def host(self) -> str:
        """Where it listens (not what it advertises: `url`)."""
        return self._host

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner.server is not None:  # set up (a failed start may not have got there)
            await self._runner.cleanup()
        if self._guard is not None:
            self._guard.close_idle()
