"""The bootstrap registry: where prefill ranks announce themselves and decodes look.

    PUT    /v1/engines/{engine}/ranks/{rank}   a RankDescriptor (register or renew)
    DELETE /v1/engines/{engine}/ranks/{rank}   leave
    GET    /v1/engines/{engine}                EngineDescriptor once all CP ranks are in
    GET    /v1/engines                         engine ids and how many ranks are in (JSON)
    GET    /health                             liveness, no secret needed
    GET    /ready                              readiness (200 once listening), no secret needed

An entry lives `Timeouts.lease` seconds unless renewed, so a rank that dies drops out
by itself. Run it as a process with `python -m transfer.app.bootstrap_registry`.

A lookup of an engine without a rank in answers `NotReadyError` (wait) for an engine seen
since the registry started (restarting, or its lease lapsed) and, during the registry's first
`grace` seconds, for any engine (a registry just restarted has not heard the renewals yet,
and a deployment's decodes may ask before its prefills registered); after that an engine
never seen is `UnknownEngineError` at once (a mistyped id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from pdkv.errors import MetadataError, NotReadyError, UnknownEngineError
from transfer.addresses import is_local_only, is_wildcard
from transfer.control import HttpService, make_app, path_int, read_body, reply
from transfer.metadata import EngineDescriptor, RankDescriptor
from transfer.timeouts import Timeouts

__all__ = ["Registry", "RegistryServer"]

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    descriptor: RankDescriptor
    expires: float


class Registry:
    """The registry's state: pure bookkeeping, clocked by the caller."""

    def __init__(self, lease: float, grace: float | None = None, now: float | None = None) -> None:
        """`grace`: seconds from `now` (the start) during which an engine never seen is
        waited for rather than unknown; by default one `lease`, within which every live rank
        renews (re-registers with a registry that restarted)."""
        self.lease = lease
        self.grace = lease if grace is None else grace
        self.started = time.monotonic() if now is None else now
        self._engines: dict[str, dict[int, _Entry]] = {}
        self._seen: set[str] = set()  # every engine that registered a rank since the start

    def put(self, d: RankDescriptor, now: float) -> None:
        self._seen.add(d.engine_id)
        ranks = self._engines.setdefault(d.engine_id, {})
        old = ranks.get(d.cp_rank)
        if old is not None and old.descriptor.incarnation != d.incarnation:
            logger.info("engine %s rank %d re-registered (%s)", d.engine_id, d.cp_rank, d.incarnation)
        # A rank of another CP size means the engine was restarted with a new shape.
        for rank, entry in list(ranks.items()):
            if entry.descriptor.cp_size != d.cp_size:
                del ranks[rank]
        ranks[d.cp_rank] = _Entry(d, now + self.lease)

    def remove(self, engine_id: str, cp_rank: int) -> None:
        ranks = self._engines.get(engine_id, {})
        ranks.pop(cp_rank, None)
        if not ranks:
            self._engines.pop(engine_id, None)

    def expire(self, now: float) -> list[tuple[str, int]]:
        gone = []
        for engine_id, ranks in list(self._engines.items()):
            for rank, entry in list(ranks.items()):
                if entry.expires <= now:
                    del ranks[rank]
                    gone.append((engine_id, rank))
            if not ranks:
                del self._engines[engine_id]
        for engine_id, rank in gone:
            logger.warning("engine %s rank %d lease expired", engine_id, rank)
        return gone

    def lookup(self, engine_id: str, now: float) -> EngineDescriptor:
        self.expire(now)
        ranks = self._engines.get(engine_id)
        if not ranks:
            up = now - self.started
            if engine_id in self._seen:
                raise NotReadyError(f"engine {engine_id!r}: no rank registered now (it was before)")
            if up < self.grace:
                raise NotReadyError(f"engine {engine_id!r} is not registered yet (the registry is {up:.1f}s up)")
            raise UnknownEngineError(f"engine {engine_id!r} was never registered here (the registry is {up:.0f}s up)")
        size = next(iter(ranks.values())).descriptor.cp_size
        missing = sorted(set(range(size)) - set(ranks))
        if missing:
            raise NotReadyError(f"engine {engine_id!r}: ranks {missing} of {size} not registered")
        return EngineDescriptor(engine_id, size, [ranks[r].descriptor for r in range(size)])

    def summary(self) -> dict[str, dict[str, int]]:
        return {
            e: {"registered": len(r), "cp_size": next(iter(r.values())).descriptor.cp_size}
            for e, r in self._engines.items()
        }


class RegistryServer:
    """The registry over HTTP, with a sweeper that expires lapsed leases."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        timeouts: Timeouts = Timeouts(),
        secret: str | None = None,
        advertise: str | None = None,
        grace: float | None = None,
    ) -> None:
        """Listens on `host` (the wildcard for every interface); `url` names `advertise`, by
        default the bound address (loopback for the wildcard: what clients on this host use).
        `grace`: as `Registry`'s (by default `timeouts.lease`)."""
        self.registry = Registry(timeouts.lease, grace)
        app = make_app(secret)
        app.router.add_put(r"/v1/engines/{engine}/ranks/{rank:\d+}", self._put)
        app.router.add_delete(r"/v1/engines/{engine}/ranks/{rank:\d+}", self._delete)
        app.router.add_get("/v1/engines/{engine}", self._get)
        app.router.add_get("/v1/engines", self._list)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        self._http = HttpService(app, host, port, advertise=advertise, timeouts=timeouts)
        self._sweeper: asyncio.Task[None] | None = None
        self._interval = timeouts.lease / 4

    @property
    def url(self) -> str:
        return self._http.url

    async def start(self) -> str:
        url = await self._http.start()
        self._sweeper = asyncio.create_task(self._sweep())
        where = self._http.host
        logger.info("registry on %s (listening on %s)", url, where)
        if is_local_only(where) and not is_wildcard(where):
            logger.info("the registry listens on loopback: only this host's prefills and decodes reach it")
        return url

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await self._http.aclose()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self.registry.expire(time.monotonic())

    async def _put(self, request: web.Request) -> web.Response:
        d = await read_body(request, RankDescriptor)
        if d.engine_id != request.match_info["engine"] or d.cp_rank != path_int(request, "rank"):
            raise MetadataError(f"body names {d.engine_id}/{d.cp_rank}, path names another rank")
        self.registry.put(d, time.monotonic())
        return web.Response(status=200)

    async def _delete(self, request: web.Request) -> web.Response:
        self.registry.remove(request.match_info["engine"], path_int(request, "rank"))
        return web.Response(status=200)

    async def _get(self, request: web.Request) -> web.Response:
        engine = self.registry.lookup(request.match_info["engine"], time.monotonic())
        return reply(engine)

    async def _list(self, request: web.Request) -> web.Response:
        self.registry.expire(time.monotonic())
        return web.json_response(self.registry.summary())

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "engines": len(self.registry.summary())})

    async def _ready(self, request: web.Request) -> web.Response:
        """Ready once listening (what answers this): lookups are served from now on."""
        up = time.monotonic() - self.registry.started
        in_grace = up < self.registry.grace  # unknown engines are still waited for
        return web.json_response({"status": "ready", "up_s": round(up, 3), "in_grace": in_grace})
