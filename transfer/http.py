"""The HTTP control plane: msgpack bodies over aiohttp, a shared secret, typed errors.

Plain HTTP keeps the control plane probeable with curl. Errors travel as `ErrorReply`
with the error class name as the code, and come back out of the client as the same
class of the pdkv error tree; aiohttp's own errors are translated here and nowhere else.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import msgspec
from aiohttp import web

import pdkv.errors as errors
from pdkv.errors import AuthError, DeadlineExceeded, MetadataError, PdkvError, PeerLostError
from transfer.metadata import ErrorReply, decode, encode
from transfer.timeouts import Timeouts

__all__ = ["SECRET_HEADER", "ControlClient", "HttpService", "health", "make_app", "reply", "read_body"]

logger = logging.getLogger(__name__)

SECRET_HEADER = "X-Pdkv-Secret"
CONTENT_TYPE = "application/x-msgpack"
MAX_BODY = 32 << 20

T = TypeVar("T", bound=msgspec.Struct)
R = TypeVar("R")

_STATUS = {
    "AuthError": 401,
    "MetadataError": 400,
    "PageRangeError": 400,
    "LayoutError": 400,
    "IncompatibleLayoutError": 409,
    "UnknownRoomError": 404,
    "UnknownEngineError": 404,
    "NotReadyError": 503,
    "CapacityError": 503,
    "DeadlineExceeded": 504,
}


def reply(msg: msgspec.Struct, fingerprint: str = "", status: int = 200) -> web.Response:
    return web.Response(body=encode(msg, fingerprint), status=status, content_type=CONTENT_TYPE)


async def read_body(request: web.Request, kind: type[T], fingerprint: str | None = None) -> T:
    return decode(await request.read(), kind, fingerprint)


async def health(request: web.Request) -> web.Response:
    """GET /health: liveness for probes (no secret needed)."""
    return web.json_response({"status": "ok"})


def _error_response(exc: PdkvError) -> web.Response:
    name = type(exc).__name__
    return reply(ErrorReply(code=name, message=str(exc)[:4000]), status=_STATUS.get(name, 500))


def make_app(secret: str | None) -> web.Application:
    """An aiohttp app that checks the shared secret and turns pdkv errors into replies."""

    @web.middleware
    async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            if secret is not None and request.path != "/health":
                given = request.headers.get(SECRET_HEADER, "")
                if not hmac.compare_digest(given.encode(), secret.encode()):
                    raise AuthError("missing or wrong shared secret")
            return await handler(request)
        except PdkvError as exc:
            if not isinstance(exc, (AuthError, errors.UnknownRoomError)):
                logger.info("%s %s refused: %s", request.method, request.path, exc)
            return _error_response(exc)

    return web.Application(middlewares=[guard], client_max_size=MAX_BODY)


def _error_from_reply(status: int, body: bytes, url: str) -> PdkvError:
    try:
        err = decode(body, ErrorReply)
    except MetadataError:
        return PdkvError(f"{url}: HTTP {status}")
    cls = getattr(errors, err.code, None)
    if not (isinstance(cls, type) and issubclass(cls, PdkvError)):
        cls = PdkvError
    return cls(f"{url}: {err.message}")


class ControlClient:
    """An HTTP client for control messages with the secret, deadlines and typed errors."""

    def __init__(self, timeouts: Timeouts, secret: str | None = None) -> None:
        self.timeouts = timeouts
        self._headers = {SECRET_HEADER: secret} if secret is not None else {}
        self._session: aiohttp.ClientSession | None = None

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
            async with self._sess().request(
                method, url, data=data, headers={"Content-Type": CONTENT_TYPE}
            ) as resp:
                return resp.status, await resp.read()

        status, payload = await _bounded(exchange(), f"{method} {url}", url, limit)
        if status != 200:
            raise _error_from_reply(status, payload, url)
        if reply_kind is None:
            return None
        return decode(payload, reply_kind, expect_fingerprint)

    async def get_json(self, url: str) -> dict[str, object]:
        """GET a JSON status page (stats, health), bounded by `Timeouts.request`."""

        async def exchange() -> dict[str, object]:
            async with self._sess().get(url) as resp:
                resp.raise_for_status()
                return await resp.json()

        return await _bounded(exchange(), f"GET {url}", url, self.timeouts.request)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _bounded(exchange: Awaitable[R], what: str, url: str, limit: float) -> R:
    """One HTTP exchange under `limit` seconds, its failures as pdkv errors."""
    try:
        return await asyncio.wait_for(exchange, limit)
    except asyncio.TimeoutError as exc:
        raise DeadlineExceeded(f"{what}: no answer within {limit:.1f}s") from exc
    except aiohttp.ClientError as exc:
        raise PeerLostError(f"{what}: {exc}", url) from exc


class HttpService:
    """An aiohttp app bound to host:port (port 0 picks a free one); `url` once started."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        # Handlers still running at shutdown get this long; a long-poll must not hold it.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        self._host, self._port = host, port
        self.url = ""

    async def start(self) -> str:
        await self._runner.setup()
        await web.TCPSite(self._runner, self._host, self._port).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def aclose(self) -> None:
        await self._runner.cleanup()
