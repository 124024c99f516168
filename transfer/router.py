"""The PD router: launches a local deployment and drives requests through it.

A request gets a room; the router sends it to a prefill engine and a decode worker at
the same time and returns the decode's answer. When either leg fails, it cancels the
other and aborts the room on every rank, so nothing stays pinned.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from pdkv.errors import CapacityError, PdkvError, PeerLostError
from transfer.api import DecodeReply, DecodeRequest, PrefillReply, PrefillRequest
from transfer.http import ControlClient
from transfer.launcher import Child, Launcher
from transfer.timeouts import Timeouts

__all__ = ["DeploymentSpec", "Deployment", "RequestOutcome"]

logger = logging.getLogger(__name__)

_PAGE_SLACK = 64  # tokens: a request may use part of one more page than it fills


@dataclass(frozen=True)
class DeploymentSpec:
    engines: tuple[int, ...] = (4,)  # CP size of each prefill engine
    decoders: int = 1
    preset: str = "dsa_v32"
    prefill_pool_tokens: int = 128 * 1024
    decode_pool_tokens: int = 128 * 1024
    device: str = "cpu"
    layer_delay: float = 0.0
    pin: float = Timeouts().pin
    lease: float = Timeouts().lease
    decode_lanes: int = 0  # 0: one a core, up to 8 (4 on a GPU)
    secret: str | None = None
    start_timeout: float = 120.0
    log_level: str = "WARNING"


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


@dataclass
class _Engine:
    engine_id: str
    intake: str
    controls: list[str]
    budget: TokenBudget


@dataclass
class _Decoder:
    name: str
    url: str
    budget: TokenBudget


@dataclass
class Deployment:
    """A registry, prefill engines and decode workers as child processes, plus the router."""

    spec: DeploymentSpec
    workdir: Path | None = None
    launcher: Launcher = field(init=False)
    registry_url: str = ""
    engines: list[_Engine] = field(default_factory=list)
    decoders: list[_Decoder] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="pdkv-"))
        env = {"PDKV_SECRET": self.spec.secret} if self.spec.secret else {}
        self.launcher = Launcher(self.workdir, env)
        self.timeouts = Timeouts()
        # A decode leg answers once its fetch ends, so a request may take a whole fetch.
        self.client = ControlClient(self.timeouts.replace(request=self.timeouts.fetch), self.spec.secret)
        self._rooms = (random.getrandbits(62) + i for i in itertools.count())
        self._generation = 0

    def _common(self) -> list[str]:
        return ["--log-level", self.spec.log_level]

    async def _start_registry(self, port: int = 0) -> None:
        registry = self.launcher.spawn(
            "registry", "transfer.bootstrap", ["--lease", str(self.spec.lease), "--port", str(port), *self._common()]
        )
        self.registry_url = await self.launcher.wait_ready(registry, self.spec.start_timeout)

    def _spawn_engine(self, engine_id: str, cp: int) -> list[tuple[str, Child]]:
        s = self.spec
        self._generation += 1  # a fresh rendezvous file for every (re)start
        init = f"file://{self.workdir}/{engine_id}.{self._generation}.dist"
        out = []
        for r in range(cp):
            args = ["--engine-id", engine_id, "--cp-rank", str(r), "--cp-size", str(cp), "--dist-init", init,
                    "--registry", self.registry_url, "--preset", s.preset, "--pool-tokens", str(s.prefill_pool_tokens),
                    "--device", s.device, "--layer-delay", str(s.layer_delay), "--pin", str(s.pin),
                    "--lease", str(s.lease), *self._common()]
            out.append((engine_id, self.launcher.spawn(f"{engine_id}-cp{r}", "transfer.prefill_worker", args)))
        return out

    async def start(self) -> None:
        s, launch = self.spec, self.launcher
        await self._start_registry()
        pending = []
        for e, cp in enumerate(s.engines):
            pending += self._spawn_engine(f"prefill{e}", cp)
        for d in range(s.decoders):
            args = ["--registry", self.registry_url, "--consumer-id", f"decode{d}", "--preset", s.preset,
                    "--pool-tokens", str(s.decode_pool_tokens), "--device", s.device, "--lanes", str(s.decode_lanes),
                    "--seed", str(d + 1), *self._common()]
            pending.append((f"decode{d}", launch.spawn(f"decode{d}", "transfer.decode_worker", args)))
        ready = await asyncio.gather(*(launch.wait_ready(c, s.start_timeout) for _, c in pending))
        by_engine: dict[str, list[dict[str, str]]] = {}
        for (engine_id, _), text in zip(pending, ready):
            if engine_id.startswith("decode"):
                self.decoders.append(_Decoder(engine_id, text, TokenBudget(self._usable(s.decode_pool_tokens))))
            else:
                by_engine.setdefault(engine_id, []).append(json.loads(text))
        for engine_id, ranks in by_engine.items():
            budget = TokenBudget(self._usable(s.prefill_pool_tokens))
            self.engines.append(_Engine(engine_id, ranks[0]["intake"], [r["control"] for r in ranks], budget))

    @staticmethod
    def _usable(pool_tokens: int) -> int:
        # Headroom for page rounding, shared-prefix caches and frees still in flight.
        return int(pool_tokens * 0.8)

    async def restart_engine(self, engine_id: str) -> None:
        """Stop whatever is left of a prefill engine and start all its ranks afresh.

        A CP group cannot take one rank back, so the engine restarts as a whole; its
        ranks come back with new memory and new keys under the same engine id.
        """
        engine = next(e for e in self.engines if e.engine_id == engine_id)
        old = [c for c in self.launcher.children if c.name.startswith(f"{engine_id}-")]
        await asyncio.gather(*(self.launcher.stop(c, grace=5.0) for c in old))
        self.launcher.children = [c for c in self.launcher.children if c not in old]
        pending = self._spawn_engine(engine_id, len(old))
        ranks = [json.loads(await self.launcher.wait_ready(c, self.spec.start_timeout)) for _, c in pending]
        engine.intake, engine.controls = ranks[0]["intake"], [r["control"] for r in ranks]

    async def restart_registry(self) -> None:
        """Stop the registry and start a new, empty one on the same address."""
        old = next(c for c in self.launcher.children if c.name == "registry")
        await self.launcher.stop(old, grace=5.0)
        self.launcher.children.remove(old)
        await self._start_registry(port=int(self.registry_url.rsplit(":", 1)[1]))

    def dead_children(self) -> list[str]:
        """Services that exited although nobody stopped them (with their exit codes)."""
        return [f"{c.name} (exit {c.popen.returncode})" for c in self.launcher.children if not c.alive()]

    def _check_alive(self, engine: _Engine, decoder: _Decoder) -> None:
        dead = {c.name for c in self.launcher.children if not c.alive()}
        gone = [n for n in dead if n.startswith(f"{engine.engine_id}-") or n == decoder.name or n == "registry"]
        if gone:
            raise PeerLostError(f"cannot route: {', '.join(sorted(gone))} exited", ",".join(sorted(gone)))

    async def aclose(self) -> dict[str, int]:
        await self.client.aclose()
        dead = self.dead_children()
        if dead:
            logger.error("services that exited on their own: %s", ", ".join(dead))
        return await self.launcher.stop_all()

    async def __aenter__(self) -> Deployment:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---- routing ---------------------------------------------------------------------------
    async def submit(self, num_tokens: int, prefix_id: int = -1, prefix_tokens: int = 0, *,
                     engine_id: str | None = None, decoder: int | None = None) -> RequestOutcome:
        """Run one request through a prefill engine and a decode worker (least busy by default)."""
        engines = [e for e in self.engines if engine_id in (None, e.engine_id)]
        engine = max(engines, key=lambda e: e.budget.free)
        dec = self.decoders[decoder] if decoder is not None else max(self.decoders, key=lambda d: d.budget.free)
        return await self._submit(engine, dec, num_tokens, prefix_id, prefix_tokens)

    async def _submit(self, engine: _Engine, decoder: _Decoder, num_tokens: int, prefix_id: int,
                      prefix_tokens: int) -> RequestOutcome:
        room = next(self._rooms)
        need = num_tokens + _PAGE_SLACK
        t0 = time.perf_counter()
        try:
            self._check_alive(engine, decoder)  # fail fast rather than wait on a dead service
            wait = self.timeouts.ready
            async with engine.budget.hold(need, wait), decoder.budget.hold(need, wait):
                reply = await self._both_legs(engine, decoder, room, num_tokens, prefix_id, prefix_tokens)
            return RequestOutcome(room, engine.engine_id, num_tokens, True, time.perf_counter() - t0, reply)
        except PdkvError as exc:
            error = f"{type(exc).__name__}: {exc}"
            return RequestOutcome(room, engine.engine_id, num_tokens, False, time.perf_counter() - t0, error=error)

    async def _both_legs(self, engine: _Engine, decoder: _Decoder, room: int, num_tokens: int,
                         prefix_id: int, prefix_tokens: int) -> DecodeReply:
        pre = PrefillRequest(room=room, num_tokens=num_tokens, prefix_id=prefix_id, prefix_tokens=prefix_tokens)
        dec = DecodeRequest(engine_id=engine.engine_id, room=room, num_tokens=num_tokens,
                            prefix_id=prefix_id, prefix_tokens=prefix_tokens)
        prefill = asyncio.create_task(self.client.request("POST", f"{engine.intake}/v1/prefill", PrefillReply, pre))
        decode = asyncio.create_task(self.client.request("POST", f"{decoder.url}/v1/decode", DecodeReply, dec))
        try:
            await asyncio.wait([prefill, decode], return_when=asyncio.FIRST_EXCEPTION)
            for leg in (prefill, decode):
                if leg.done() and leg.exception() is not None:
                    raise leg.exception()  # type: ignore[misc]
            out = await decode
            assert out is not None
            return out
        except BaseException:
            await self.abort(engine, decoder, room)
            raise
        finally:
            for leg in (prefill, decode):
                leg.cancel()
            await asyncio.gather(prefill, decode, return_exceptions=True)

    async def abort(self, engine: _Engine, decoder: _Decoder, room: int) -> None:
        """Cancel `room` everywhere: the decode's fetch, the queued prefill, every rank's pins."""
        urls = [f"{decoder.url}/v1/rooms/{room}/abort", f"{engine.intake}/v1/rooms/{room}/abort"]
        urls += [f"{c}/v1/rooms/{room}/abort" for c in engine.controls]
        results = await asyncio.gather(*(self.client.request("POST", u, timeout=self.timeouts.request) for u in urls),
                                       return_exceptions=True)
        for url, r in zip(urls, results):
            if isinstance(r, BaseException):
                logger.warning("abort %s: %s", url, r)

    async def stats(self) -> dict[str, list[dict[str, object]]]:
        """Each prefill rank's and decode worker's /v1/stats."""
        prefill = [self.client.get_json(f"{c}/v1/stats") for e in self.engines for c in e.controls]
        decode = [self.client.get_json(f"{d.url}/v1/stats") for d in self.decoders]
        return {"prefill": list(await asyncio.gather(*prefill)), "decode": list(await asyncio.gather(*decode))}
