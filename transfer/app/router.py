"""The PD router: gives each request a room and drives it through both legs.

A request gets a room; the router sends it to a prefill engine and a decode worker at
the same time and returns the decode's answer. When either leg fails, it cancels the
other and aborts the room on every rank, so nothing stays pinned. Only engines the
supervisor reports up take requests: a dead engine fails just the requests in flight on
it, and is taken back once its restart has registered. `Deployment` is the
local deployment the main job and the tests use: the supervised processes with a router
in front of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from pdkv.errors import CapacityError, PdkvError, PeerLostError, UnknownEngineError
from transfer.app.api import DecodeReply, DecodeRequest, PrefillReply, PrefillRequest
from transfer.app.supervisor import DecoderEndpoint, EngineEndpoints, Supervisor
from transfer.app.supervisor import DeploymentSpec as DeploymentSpec
from transfer.control import ControlClient
from transfer.deadline import Deadline
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

_PAGE_SLACK = 64  # tokens: a request may use part of one more page than it fills
_LIVENESS_POLL_S = 0.01  # how often a waiting leg checks that its services still run
_PICK_POLL_S = 0.05  # how often a request that found no engine up looks again
_EXIT_SHOWS_S = 0.5  # how long a lost peer may take to show as an exited process

T = TypeVar("T")


@dataclass(frozen=True)
class RequestOutcome:
    room: int
    engine_id: str
    num_tokens: int
    ok: bool
    seconds: float  # request to KV in decode, verified
    decode: DecodeReply | None = None
    error: str = ""
    cause: str = ""  # the error's class: PeerLostError for any failure on an engine that died
    engine_lost: bool = False  # failed because its engine died while it was in flight


class TokenBudget:
    """Admission control: a request waits until its pool has room for its tokens."""

    def __init__(self, tokens: int) -> None:
        self.capacity = self.free = tokens
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, tokens: int, timeout: float) -> AsyncIterator[None]:
        if tokens > self.capacity:
            raise CapacityError(f"{tokens} tokens exceed a pool of {self.capacity}")
        if self.free < tokens:  # no await on the fast path: wait_for may swallow a cancel
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait_for(lambda: self.free >= tokens), timeout)
                except asyncio.TimeoutError as exc:
                    raise CapacityError(f"no room for {tokens} tokens within {timeout:.0f}s") from exc
        self.free -= tokens
        try:
            yield
        finally:
            async with self._changed:
                self.free += tokens
                self._changed.notify_all()


def _usable(pool_tokens: int) -> int:
    # Headroom for page rounding, shared-prefix caches and frees still in flight.
    return int(pool_tokens * 0.8)


@dataclass(frozen=True)
class _Request:
    """What the router knows of one request, from its arrival."""

    room: int
    num_tokens: int
    prefix_id: int
    prefix_tokens: int
    deadline: Deadline  # the request's end-to-end budget
    t0: float  # time.perf_counter() at arrival


class _EngineLost(PeerLostError):
    """A request in flight on an engine that died."""


class _NotSent(PeerLostError):
    """The chosen engine went down before the request was sent to it: another may take it."""


class Router:
    """Routes requests over a supervised deployment, with admission by pool capacity.

    A request goes to an engine that is up. One that dies takes down only the requests in
    flight on it (`PeerLostError`); the rest go elsewhere, or wait, within their admission
    bound, for an engine the supervisor is restarting.
    """

    def __init__(self, services: Supervisor, timeouts: Timeouts = Timeouts()) -> None:
        self.services = services
        self.timeouts = timeouts
        self.client = ControlClient(timeouts, services.spec.secret)
        self._budgets: dict[str, TokenBudget] = {}
        self._rooms = (random.getrandbits(62) + i for i in itertools.count())
        self.in_flight: Counter[str] = Counter()  # requests sent to each engine and not yet ended

    def budget(self, endpoint: EngineEndpoints | DecoderEndpoint) -> TokenBudget:
        name = endpoint.engine_id if isinstance(endpoint, EngineEndpoints) else endpoint.name
        if name not in self._budgets:
            self._budgets[name] = TokenBudget(_usable(endpoint.pool_tokens))
        return self._budgets[name]

    async def aclose(self) -> None:
        await self.client.aclose()

    def _request(self, num_tokens: int, prefix_id: int, prefix_tokens: int) -> _Request:
        deadline = Deadline.after(self.timeouts.fetch)
        return _Request(next(self._rooms), num_tokens, prefix_id, prefix_tokens, deadline, time.perf_counter())

    async def submit(
        self,
        num_tokens: int,
        prefix_id: int = -1,
        prefix_tokens: int = 0,
        *,
        engine_id: str | None = None,
        decoder: int | None = None,
    ) -> RequestOutcome:
        """Run one request through a prefill engine and a decode worker (least busy by default)."""
        req = self._request(num_tokens, prefix_id, prefix_tokens)
        engine_name = engine_id or ""
        while True:
            try:
                engine = await self._pick_engine(engine_id, req.deadline)
                engine_name = engine.engine_id
                return await self._attempt(engine, self._pick_decoder(decoder), req)
            except PdkvError as exc:
                if isinstance(exc, _NotSent) and engine_id is None:
                    continue  # nothing was sent: the next pick passes the dead engine over
                return self._failed(req, engine_name, exc)

    async def submit_to(
        self,
        engine: EngineEndpoints,
        decoder: DecoderEndpoint,
        num_tokens: int,
        prefix_id: int = -1,
        prefix_tokens: int = 0,
    ) -> RequestOutcome:
        """Run one request through these two services."""
        req = self._request(num_tokens, prefix_id, prefix_tokens)
        try:
            return await self._attempt(engine, decoder, req)
        except PdkvError as exc:
            return self._failed(req, engine.engine_id, exc)

    def _failed(self, req: _Request, engine_id: str, exc: PdkvError) -> RequestOutcome:
        cause = next(c.__name__ for c in type(exc).__mro__ if not c.__name__.startswith("_"))
        seconds = time.perf_counter() - req.t0
        lost = isinstance(exc, _EngineLost)
        return RequestOutcome(
            req.room, engine_id, req.num_tokens, False, seconds, error=f"{cause}: {exc}", cause=cause, engine_lost=lost
        )

    async def _pick_engine(self, engine_id: str | None, deadline: Deadline) -> EngineEndpoints:
        """The named engine, or the least busy one up; with none up, one that comes back."""
        if engine_id is not None:
            named = [e for e in self.services.engines if e.engine_id == engine_id]
            if not named:
                raise UnknownEngineError(f"no prefill engine {engine_id!r} in this deployment")
            return named[0]
        until = deadline.within(self.timeouts.admission)
        while True:
            up = self.services.routable()
            if up:
                return max(up, key=lambda e: self.budget(e).free)
            if not self.services.recovering():
                deaths = "; ".join(d.describe() for d in self.services.deaths) or "none started"
                raise PeerLostError(f"no prefill engine to route to: {deaths}")
            await asyncio.sleep(until.left(_PICK_POLL_S, "no prefill engine came back in time"))

    def _pick_decoder(self, decoder: int | None) -> DecoderEndpoint:
        if decoder is not None:
            return self.services.decoders[decoder]
        live = self.services.live_decoders() or self.services.decoders  # none live: the check names them
        return max(live, key=lambda d: self.budget(d).free)

    async def _attempt(self, engine: EngineEndpoints, decoder: DecoderEndpoint, req: _Request) -> RequestOutcome:
        generation = engine.generation
        self._unless_gone(engine, decoder, generation)
        need = req.num_tokens + _PAGE_SLACK
        wait = req.deadline.left(self.timeouts.admission)
        async with self.budget(engine).hold(need, wait), self.budget(decoder).hold(need, wait):
            self._unless_gone(engine, decoder, generation)  # it may have died while this waited
            self.in_flight[engine.engine_id] += 1
            try:
                reply = await self._both_legs(engine, decoder, req, generation)
            except PdkvError as exc:
                raise await self._blame(engine, generation, req, exc) from exc
            finally:
                self.in_flight[engine.engine_id] -= 1
        return RequestOutcome(req.room, engine.engine_id, req.num_tokens, True, time.perf_counter() - req.t0, reply)

    def _unless_gone(self, engine: EngineEndpoints, decoder: DecoderEndpoint, generation: int) -> None:
        """Before anything is sent: `_NotSent` if the engine is down, `PeerLostError` for the rest."""
        if not self._same(engine, generation):
            death = self.services.last_death(engine.engine_id)
            gone = ", ".join(death.ranks) if death else engine.engine_id
            raise _NotSent(f"cannot route: {gone} exited", gone)
        self.services.check_alive(engine, decoder, generation)

    async def _blame(self, engine: EngineEndpoints, generation: int, req: _Request, exc: PdkvError) -> PdkvError:
        """A failure on an engine that died meanwhile is that death's, whatever it looked like
        from here (a lost owner, a collective error on a surviving rank, a reset connection)."""
        if isinstance(exc, PeerLostError):  # a killed rank's sockets close before its exit can be reaped
            end = time.monotonic() + _EXIT_SHOWS_S
            while self._same(engine, generation) and time.monotonic() < end:
                await asyncio.sleep(_LIVENESS_POLL_S)
        if self._same(engine, generation):
            return exc
        if isinstance(exc, PeerLostError):
            return _EngineLost(str(exc), exc.peer, exc.owner)
        return _EngineLost(
            f"{engine.engine_id} died under room {req.room}: {type(exc).__name__}: {exc}", engine.engine_id
        )

    def _same(self, engine: EngineEndpoints, generation: int) -> bool:
        """Whether `engine` is still the live process group of `generation`."""
        return self.services.engine_alive(engine) and engine.generation == generation

    async def _both_legs(
        self, engine: EngineEndpoints, decoder: DecoderEndpoint, req: _Request, generation: int
    ) -> DecodeReply:
        """Both legs carry what remains of the deadline; each worker bounds its work by it."""
        deadline = req.deadline
        budget = deadline.to_wire()
        overlap, tickets = self.services.spec.overlap, self.services.spec.tickets
        pre = PrefillRequest(
            room=req.room,
            num_tokens=req.num_tokens,
            prefix_id=req.prefix_id,
            prefix_tokens=req.prefix_tokens,
            budget_ms=budget,
            ticket=tickets and not overlap,
        )
        dec = DecodeRequest(
            engine_id=engine.engine_id,
            room=req.room,
            num_tokens=req.num_tokens,
            prefix_id=req.prefix_id,
            prefix_tokens=req.prefix_tokens,
            budget_ms=budget,
        )
        # The client waits a little past the budget, so that a worker's own DeadlineExceeded arrives.
        wait = deadline.left() + self.timeouts.request
        prefill = asyncio.create_task(
            self.client.request("POST", f"{engine.intake}/v1/prefill", PrefillReply, pre, timeout=wait)
        )
        decode: asyncio.Task[DecodeReply | None] | None = None
        try:
            if overlap:
                decode = asyncio.create_task(self._decode(decoder, dec, wait))
                await asyncio.wait([prefill, decode], return_when=asyncio.FIRST_EXCEPTION)
                for leg in (prefill, decode):
                    if leg.done() and leg.exception() is not None:
                        raise leg.exception()  # type: ignore[misc]
            else:  # the prefill's reply carries the room's ticket (where asked) to the decode
                done = await self._unless_lost(prefill, engine, decoder, generation)
                assert done is not None
                dec = msgspec.structs.replace(dec, ticket=done.ticket, budget_ms=deadline.to_wire())
                decode = asyncio.create_task(self._decode(decoder, dec, deadline.left() + self.timeouts.request))
            out = await self._unless_lost(decode, engine, decoder, generation)
            assert out is not None
            return out
        except BaseException:
            await self.abort(engine, decoder, req.room)
            raise
        finally:
            legs = [leg for leg in (prefill, decode) if leg is not None]
            for leg in legs:
                leg.cancel()
            await asyncio.gather(*legs, return_exceptions=True)

    async def _unless_lost(
        self, leg: asyncio.Task[T], engine: EngineEndpoints, decoder: DecoderEndpoint, generation: int
    ) -> T:
        """`leg`'s result, or `PeerLostError` as soon as a process it depends on exited.

        A prefill rank killed mid-request is otherwise noticed only when its CP group's
        collectives time out (seconds); the supervisor sees the exit at once.
        """
        while True:
            done, _ = await asyncio.wait([leg], timeout=_LIVENESS_POLL_S)
            if done:
                return leg.result()
            self.services.check_alive(engine, decoder, generation)

    async def _decode(self, decoder: DecoderEndpoint, dec: DecodeRequest, wait: float) -> DecodeReply | None:
        return await self.client.request("POST", f"{decoder.url}/v1/decode", DecodeReply, dec, timeout=wait)

    async def abort(self, engine: EngineEndpoints, decoder: DecoderEndpoint, room: int) -> None:
        """Cancel `room` everywhere: the decode's fetch, the queued prefill, every rank's pins."""
        urls = [f"{decoder.url}/v1/rooms/{room}/abort", f"{engine.intake}/v1/rooms/{room}/abort"]
        urls += [f"{c}/v1/rooms/{room}/abort" for c in engine.controls]
        results = await asyncio.gather(
            *(self.client.request("POST", u, timeout=self.timeouts.request) for u in urls), return_exceptions=True
        )
        # A dead engine's ranks cannot answer, and its restart frees everything anyway.
        level = logging.WARNING if self.services.engine_alive(engine) else logging.INFO
        for url, r in zip(urls, results):
            if isinstance(r, BaseException):
                logger.log(level, "abort %s: %s", url, r)

    async def stats(self) -> dict[str, list[dict[str, object]]]:
        """Each prefill rank's and decode worker's /v1/stats."""
        prefill = [self.client.get_json(f"{c}/v1/stats") for e in self.services.routable() for c in e.controls]
        decode = [self.client.get_json(f"{d.url}/v1/stats") for d in self.services.decoders]
        return {"prefill": list(await asyncio.gather(*prefill)), "decode": list(await asyncio.gather(*decode))}


class Deployment(Supervisor):
    """A local deployment: the supervised services, and a router in front of them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.router = Router(self)

    @property
    def client(self) -> ControlClient:
        return self.router.client

    async def submit(
        self,
        num_tokens: int,
        prefix_id: int = -1,
        prefix_tokens: int = 0,
        *,
        engine_id: str | None = None,
        decoder: int | None = None,
    ) -> RequestOutcome:
        return await self.router.submit(num_tokens, prefix_id, prefix_tokens, engine_id=engine_id, decoder=decoder)

    async def abort(self, engine: EngineEndpoints, decoder: DecoderEndpoint, room: int) -> None:
        await self.router.abort(engine, decoder, room)

    async def stats(self) -> dict[str, list[dict[str, object]]]:
        return await self.router.stats()

    async def aclose(self) -> dict[str, int]:
        await self.router.aclose()
        return await super().aclose()

    async def __aenter__(self) -> Deployment:
        await super().__aenter__()
        return self
