"""The PD router: gives each request a room and drives it through both legs.

A request gets a room; the router sends it to a prefill engine and a decode worker at
the same time and returns the decode's answer. When either leg fails, it cancels the
other and aborts the room on every rank, so nothing stays pinned. `Deployment` is the
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
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from pdkv.errors import CapacityError, PdkvError
from transfer.app.api import DecodeReply, DecodeRequest, PrefillReply, PrefillRequest
from transfer.app.supervisor import DecoderEndpoint, DeploymentSpec, EngineEndpoints, Supervisor
from transfer.deadline import Deadline
from transfer.http import ControlClient
from transfer.timeouts import Timeouts

__all__ = ["Deployment", "DeploymentSpec", "RequestOutcome", "Router", "TokenBudget"]

logger = logging.getLogger(__name__)

_PAGE_SLACK = 64  # tokens: a request may use part of one more page than it fills
_LIVENESS_POLL_S = 0.01  # how often a waiting leg checks that its services still run

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


class Router:
    """Routes requests over a supervised deployment, with admission by pool capacity."""

    def __init__(self, services: Supervisor, timeouts: Timeouts = Timeouts()) -> None:
        self.services = services
        self.timeouts = timeouts
        self.client = ControlClient(timeouts, services.spec.secret)
        self._budgets: dict[str, TokenBudget] = {}
        self._rooms = (random.getrandbits(62) + i for i in itertools.count())

    def budget(self, endpoint: EngineEndpoints | DecoderEndpoint) -> TokenBudget:
        name = endpoint.engine_id if isinstance(endpoint, EngineEndpoints) else endpoint.name
        if name not in self._budgets:
            self._budgets[name] = TokenBudget(_usable(endpoint.pool_tokens))
        return self._budgets[name]

    async def aclose(self) -> None:
        await self.client.aclose()

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
        engines = [e for e in self.services.engines if engine_id in (None, e.engine_id)]
        engine = max(engines, key=lambda e: self.budget(e).free)
        decoders = self.services.decoders
        dec = decoders[decoder] if decoder is not None else max(decoders, key=lambda d: self.budget(d).free)
        return await self.submit_to(engine, dec, num_tokens, prefix_id, prefix_tokens)

    async def submit_to(
        self,
        engine: EngineEndpoints,
        decoder: DecoderEndpoint,
        num_tokens: int,
        prefix_id: int = -1,
        prefix_tokens: int = 0,
    ) -> RequestOutcome:
        """Run one request through these two services."""
        room = next(self._rooms)
        need = num_tokens + _PAGE_SLACK
        t0 = time.perf_counter()
        deadline = Deadline.after(self.timeouts.fetch)  # the request's end-to-end budget
        try:
            self.services.check_alive(engine, decoder)
            wait = deadline.left(self.timeouts.admission)
            async with self.budget(engine).hold(need, wait), self.budget(decoder).hold(need, wait):
                reply = await self._both_legs(engine, decoder, room, num_tokens, prefix_id, prefix_tokens, deadline)
            return RequestOutcome(room, engine.engine_id, num_tokens, True, time.perf_counter() - t0, reply)
        except PdkvError as exc:
            error = f"{type(exc).__name__}: {exc}"
            return RequestOutcome(room, engine.engine_id, num_tokens, False, time.perf_counter() - t0, error=error)

    async def _both_legs(
        self,
        engine: EngineEndpoints,
        decoder: DecoderEndpoint,
        room: int,
        num_tokens: int,
        prefix_id: int,
        prefix_tokens: int,
        deadline: Deadline,
    ) -> DecodeReply:
        """Both legs carry what remains of `deadline`; each worker bounds its work by it."""
        budget = deadline.to_wire()
        overlap = self.services.spec.overlap
        pre = PrefillRequest(
            room=room,
            num_tokens=num_tokens,
            prefix_id=prefix_id,
            prefix_tokens=prefix_tokens,
            budget_ms=budget,
            ticket=not overlap,
        )
        dec = DecodeRequest(
            engine_id=engine.engine_id,
            room=room,
            num_tokens=num_tokens,
            prefix_id=prefix_id,
            prefix_tokens=prefix_tokens,
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
            else:  # the prefill's reply carries the room's ticket to the decode
                done = await self._unless_lost(prefill, engine, decoder)
                assert done is not None
                dec = msgspec.structs.replace(dec, ticket=done.ticket, budget_ms=deadline.to_wire())
                decode = asyncio.create_task(self._decode(decoder, dec, deadline.left() + self.timeouts.request))
            out = await self._unless_lost(decode, engine, decoder)
            assert out is not None
            return out
        except BaseException:
            await self.abort(engine, decoder, room)
            raise
        finally:
            legs = [leg for leg in (prefill, decode) if leg is not None]
            for leg in legs:
                leg.cancel()
            await asyncio.gather(*legs, return_exceptions=True)

    async def _unless_lost(self, leg: asyncio.Task[T], engine: EngineEndpoints, decoder: DecoderEndpoint) -> T:
        """`leg`'s result, or `PeerLostError` as soon as a process it depends on exited.

        A prefill rank killed mid-request is otherwise noticed only when its CP group's
        collectives time out (seconds); the supervisor sees the exit at once.
        """
        while True:
            done, _ = await asyncio.wait([leg], timeout=_LIVENESS_POLL_S)
            if done:
                return leg.result()
            self.services.check_alive(engine, decoder)

    async def _decode(self, decoder: DecoderEndpoint, dec: DecodeRequest, wait: float) -> DecodeReply | None:
        return await self.client.request("POST", f"{decoder.url}/v1/decode", DecodeReply, dec, timeout=wait)

    async def abort(self, engine: EngineEndpoints, decoder: DecoderEndpoint, room: int) -> None:
        """Cancel `room` everywhere: the decode's fetch, the queued prefill, every rank's pins."""
        urls = [f"{decoder.url}/v1/rooms/{room}/abort", f"{engine.intake}/v1/rooms/{room}/abort"]
        urls += [f"{c}/v1/rooms/{room}/abort" for c in engine.controls]
        results = await asyncio.gather(
            *(self.client.request("POST", u, timeout=self.timeouts.request) for u in urls), return_exceptions=True
        )
        for url, r in zip(urls, results):
            if isinstance(r, BaseException):
                logger.warning("abort %s: %s", url, r)

    async def stats(self) -> dict[str, list[dict[str, object]]]:
        """Each prefill rank's and decode worker's /v1/stats."""
        prefill = [self.client.get_json(f"{c}/v1/stats") for e in self.services.engines for c in e.controls]
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
