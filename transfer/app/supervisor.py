"""Process supervision for a local deployment: a registry, prefill engines, decode workers.

Starts each service as a child process (port 0; its URL through a ready file, and started
once each URL there answers `GET /ready`: a prefill rank registered with UCX up), knows
their endpoints, watches the prefill engines and restarts a dead one whole (with backoff,
a bounded number of times, when the spec allows), restarts the registry on demand, and
stops everything. It routes no request: that is `transfer.app.router`, which asks it which
engines are up.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path

from pdkv.errors import NotReadyError, PeerLostError
from transfer.app.launcher import Child, Launcher, ServiceStartError
from transfer.app.launcher import Host as Host
from transfer.deadline import Deadline, retry_until
from transfer.registry import registry_client
from transfer.timeouts import Timeouts

# SMs a prefill's NCCL owner broadcast may take: 8 were as fast as NCCL's own 24 channels and
# leave compute the rest, so a prefetch hides behind it (docs/benchmarks.md, "NCCL SM cap").
BROADCAST_CTAS = 8

logger = logging.getLogger(__name__)

_WATCH_S = 0.05  # how often the supervisor looks for dead engine ranks between requests
_MAX_BACKOFF_S = 30.0
_STOP_GRACE_S = 5.0  # a healthy engine leaves the registry and frees its pins on SIGTERM
_STOP_DEAD_GRACE_S = 1.0  # what is left of a dead one may hang in a collective: kill it soon


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
    # How often an owner drives its UCX worker while a room of its is read; None: by
    # transport (`Timeouts.ticket_progress_interval`).
    owner_progress: float | None = None
    # SMs the prefill's NCCL owner broadcast may take beside the model's compute; 0: NCCL's choice.
    broadcast_ctas: int = BROADCAST_CTAS
    decode_ucx_workers: int = 0  # 0: one a core, up to 8 (4 on a GPU)
    # False: the decode starts once the prefill replied, with the room's ticket (no control
    # request during the fetch). True: both start at once and the decode reads layers as
    # they are written (claims and readiness polls over HTTP).
    overlap: bool = False
    # False (and no overlap): the decode starts once the prefill replied, but without the
    # room's ticket, and claims it (a router that carries none; held claims answer it).
    tickets: bool = True
    # The prefill ranks hold a claim of each whole room for their arbiter to hand out, so a
    # claim needs no relay (`transfer.prefill.held`); False: every claim is relayed.
    hold_claims: bool = True
    secret: str | None = None
    start_timeout: float = 120.0
    log_level: str = "WARNING"
    registry_host: Host = Host()
    # An existing registry to use (`http://...` or `etcd://HOST:PORT/PREFIX`) instead of
    # starting the built-in one.
    registry: str | None = None
    prefill_host: Host = Host()
    decode_host: Host = Host()
    # Restarts of each prefill engine after a rank died, over the deployment's life; 0 leaves a
    # dead engine down (callers that restart by hand, as the fault tests do, want that).
    max_restarts: int = 0
    restart_backoff: float = 1.0  # seconds before the first restart; doubled for each next


class EngineState(enum.Enum):
    UP = "up"  # routable
    RECOVERING = "recovering"  # a rank died; the whole engine's restart is pending or running
    DOWN = "down"  # dead, and no restart will come (restarts off or used up)


@dataclass
class EngineEndpoints:
    """A prefill engine's rank 0 intake and every rank's control URL, and its health."""

    engine_id: str
    intake: str
    controls: list[str]
    pool_tokens: int
    state: EngineState = EngineState.UP
    # Bumped whenever the engine stops being the process group requests were sent to (a
    # death, a restart): a request in flight on an older generation has lost its engine.
    generation: int = 0
    restarts: int = 0
    incarnations: tuple[str, ...] = ()  # its ranks' in the registry, as of its last restart

    @property
    def cp_size(self) -> int:
        return len(self.controls)


@dataclass
class DecoderEndpoint:
    name: str
    url: str
    pool_tokens: int


@dataclass
class EngineDeath:
    """One death of an engine and what the supervisor did about it."""

    engine_id: str
    ranks: tuple[str, ...]  # the rank processes found dead
    codes: tuple[int | None, ...]
    at: float  # time.monotonic()
    back_after: float | None = None  # seconds from the death to the engine's new ranks registered
    attempts: int = 0  # restarts tried for it

    @property
    def dead(self) -> str:
        return ", ".join(f"{n} (exit {c})" for n, c in zip(self.ranks, self.codes))

    def describe(self) -> str:
        if self.back_after is not None:
            after = f"{self.attempts} restart(s)" if self.attempts > 1 else "restart"
            return f"{self.engine_id}: {self.dead}; serving again {self.back_after:.1f} s later (after {after})"
        tried = f" after {self.attempts} failed restart(s)" if self.attempts else ""
        return f"{self.engine_id}: {self.dead}; down{tried}"


@dataclass
class Supervisor:
    """The deployment's services as child processes; a dead prefill engine restarts whole."""

    spec: DeploymentSpec
    workdir: Path | None = None
    launcher: Launcher = field(init=False)
    registry_url: str = ""
    engines: list[EngineEndpoints] = field(default_factory=list)
    decoders: list[DecoderEndpoint] = field(default_factory=list)
    deaths: list[EngineDeath] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="pdkv-"))
        env = {"PDKV_SECRET": self.spec.secret} if self.spec.secret else {}
        self.launcher = Launcher(self.workdir, env)
        self._generation = 0
        self._ranks: dict[str, list[Child]] = {}  # each engine's rank processes, by CP rank
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # the watcher and pending recoveries
        self._recoveries: set[asyncio.Task[None]] = set()
        self._started = False

    def _spawn(self, name: str, module: str, args: list[str], host: Host) -> Child:
        args = [*args, "--host", host.address, "--log-level", self.spec.log_level]
        return self.launcher.spawn(name, module, args, host.prefix())

    async def _start_registry(self, port: int = 0) -> None:
        if self.spec.registry is not None:
            self.registry_url = self.spec.registry
            return
        args = ["--lease", str(self.spec.lease), "--port", str(port)]
        registry = self._spawn("registry", "transfer.app.bootstrap_registry", args, self.spec.registry_host)
        self.registry_url = (await self.launcher.all_ready([registry], self.spec.start_timeout))[0]

    def _spawn_engine(self, engine_id: str, cp: int) -> list[Child]:
        s = self.spec
        self._generation += 1  # a fresh rendezvous file for every (re)start
        flags = {
            "--engine-id": engine_id,
            "--cp-size": cp,
            "--dist-init": f"file://{self.workdir}/{engine_id}.{self._generation}.dist",
            "--registry": self.registry_url,
            "--preset": s.preset,
            "--pool-tokens": s.prefill_pool_tokens,
            "--device": s.device,
            "--layer-delay": s.layer_delay,
            "--pin": s.pin,
            "--lease": s.lease,
            **({} if s.owner_progress is None else {"--owner-progress": s.owner_progress}),
            "--broadcast-ctas": s.broadcast_ctas,
        }
        args, module = _flatten(flags), "transfer.app.prefill_worker"
        if not s.hold_claims:
            args.append("--no-held-claims")
        return [
            self._spawn(f"{engine_id}-cp{r}", module, [*args, "--cp-rank", str(r)], s.prefill_host) for r in range(cp)
        ]

    def _spawn_decoder(self, d: int) -> Child:
        s = self.spec
        flags = {
            "--registry": self.registry_url,
            "--consumer-id": f"decode{d}",
            "--preset": s.preset,
            "--pool-tokens": s.decode_pool_tokens,
            "--device": s.device,
            "--ucx-workers": s.decode_ucx_workers,
            "--seed": d + 1,
        }
        return self._spawn(f"decode{d}", "transfer.app.decode_worker", _flatten(flags), s.decode_host)

    async def start(self) -> None:
        s = self.spec
        await self._start_registry()
        ranks = {f"prefill{e}": self._spawn_engine(f"prefill{e}", cp) for e, cp in enumerate(s.engines)}
        decoders = [self._spawn_decoder(d) for d in range(s.decoders)]
        children = [c for cs in ranks.values() for c in cs] + decoders
        ready = iter(await self.launcher.all_ready(children, s.start_timeout))
        for engine_id, children in ranks.items():
            texts = [json.loads(next(ready)) for _ in children]
            intake, controls = texts[0]["intake"], [t["control"] for t in texts]
            self.engines.append(EngineEndpoints(engine_id, intake, controls, s.prefill_pool_tokens))
        self.decoders += [DecoderEndpoint(c.name, next(ready), s.decode_pool_tokens) for c in decoders]
        self._ranks = ranks
        self._started = True
        self._keep(self._watch())

    def _keep(self, work: Coroutine[None, None, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(work)
        for tasks in (self._tasks, self._recoveries):
            task.add_done_callback(tasks.discard)
        self._tasks.add(task)
        return task

    async def recovered(self) -> None:
        """Returns once no restart is pending or running (each is bounded)."""
        while self._recoveries:
            await asyncio.gather(*self._recoveries, return_exceptions=True)

    # ---- health ------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Notice a dead engine even while no request asks about it."""
        while True:
            for engine in self.engines:
                self.engine_alive(engine)
            await asyncio.sleep(_WATCH_S)

    def engine_alive(self, engine: EngineEndpoints) -> bool:
        """Whether `engine` can take requests; its first dead rank seen starts its recovery."""
        if engine.state is not EngineState.UP:
            return False
        dead = [c for c in self._ranks.get(engine.engine_id, []) if not c.alive()]
        if dead:
            self._lost(engine, dead)
        return not dead

    def _lost(self, engine: EngineEndpoints, dead: list[Child]) -> None:
        engine.generation += 1
        death = EngineDeath(
            engine.engine_id, tuple(c.name for c in dead), tuple(c.popen.returncode for c in dead), time.monotonic()
        )
        self.deaths.append(death)
        if engine.restarts < self.spec.max_restarts:
            engine.state = EngineState.RECOVERING
            self._recoveries.add(self._keep(self._recover(engine, death)))
        else:
            engine.state = EngineState.DOWN
            used = f"{engine.restarts} of {self.spec.max_restarts} restarts used"
            logger.error("%s: %s exited; left down (%s)", engine.engine_id, death.dead, used)

    def routable(self) -> list[EngineEndpoints]:
        return [e for e in self.engines if self.engine_alive(e)]

    def recovering(self) -> bool:
        """Whether an engine not serving now is expected back."""
        return any(e.state is EngineState.RECOVERING for e in self.engines)

    def live_decoders(self) -> list[DecoderEndpoint]:
        alive = {c.name for c in self.launcher.children if c.alive()}
        return [d for d in self.decoders if d.name in alive]

    def last_death(self, engine_id: str) -> EngineDeath | None:
        return next((d for d in reversed(self.deaths) if d.engine_id == engine_id), None)

    # ---- restarts ----------------------------------------------------------------------------
    async def _recover(self, engine: EngineEndpoints, death: EngineDeath) -> None:
        """Restart `engine` whole, with a doubling pause, until it serves or its restarts run out."""
        while engine.restarts < self.spec.max_restarts:
            engine.restarts += 1
            pause = min(self.spec.restart_backoff * 2 ** (engine.restarts - 1), _MAX_BACKOFF_S)
            what = f"{engine.engine_id}: {death.dead} exited; restarting all {engine.cp_size} ranks"
            logger.warning("%s in %.1f s (restart %d of %d)", what, pause, engine.restarts, self.spec.max_restarts)
            await asyncio.sleep(pause)
            death.attempts += 1
            try:
                await self._restart(engine)
            except Exception as exc:  # whatever failed, the next attempt starts from nothing
                engine.state = EngineState.RECOVERING
                why = exc.line() if isinstance(exc, ServiceStartError) else str(exc).splitlines()[0]
                logger.warning("restarting %s failed: %s", engine.engine_id, why)
                continue
            death.back_after = time.monotonic() - death.at
            logger.warning("%s", death.describe())
            return
        engine.state = EngineState.DOWN
        logger.error("%s", death.describe())

    async def restart_engine(self, engine_id: str) -> None:
        """Stop whatever is left of a prefill engine and start all its ranks afresh.

        A CP group cannot take one rank back (its gloo group forms once, at start), so the
        engine restarts as a whole; its ranks come back with new memory and new keys under
        the same engine id.
        """
        engine = next(e for e in self.engines if e.engine_id == engine_id)
        try:
            await self._restart(engine)
        except BaseException:
            engine.state = EngineState.DOWN
            raise

    async def _restart(self, engine: EngineEndpoints) -> None:
        async with self._locks.setdefault(engine.engine_id, asyncio.Lock()):
            was_up = engine.state is EngineState.UP
            engine.state = EngineState.RECOVERING
            engine.generation += 1
            old = self._ranks.pop(engine.engine_id, [])
            await self._stop(old, dead=not was_up)
            children = self._ranks[engine.engine_id] = self._spawn_engine(engine.engine_id, engine.cp_size)
            try:
                ranks = [json.loads(text) for text in await self.launcher.all_ready(children, self.spec.start_timeout)]
            except BaseException:
                await self._stop(self._ranks.pop(engine.engine_id), dead=True)
                raise
            engine.intake, engine.controls = ranks[0]["intake"], [r["control"] for r in ranks]
            engine.incarnations = await self._registered(engine)
            engine.state = EngineState.UP

    async def _stop(self, children: list[Child], dead: bool = False) -> None:
        """`dead`: what is left of a group that lost a member may hang in a collective."""
        await self.launcher.stop_some(children, _STOP_DEAD_GRACE_S if dead else _STOP_GRACE_S, hang_expected=dead)

    async def _registered(self, engine: EngineEndpoints) -> tuple[str, ...]:
        """The incarnations of `engine`'s new ranks, once the registry hands them out: what a
        decode will look up must be these ranks, not the dead ones' leftover entries."""
        timeouts = Timeouts()
        registry = registry_client(self.registry_url, timeouts, self.spec.secret)
        deadline = Deadline.after(timeouts.lookup)

        async def new_ranks() -> tuple[str, ...]:
            found = await registry.lookup(engine.engine_id, deadline)
            incarnations = tuple(r.incarnation for r in found.ranks)
            if [r.control_url for r in found.ranks] != engine.controls or set(incarnations) & set(engine.incarnations):
                raise NotReadyError(f"the registry still lists {engine.engine_id}'s old ranks")
            return incarnations

        try:
            return await retry_until(new_ranks, deadline, NotReadyError, f"{engine.engine_id} registered")
        finally:
            await registry.aclose()

    async def restart_registry(self) -> None:
        """Stop the registry and start a new, empty one on the same address."""
        if self.spec.registry is not None:
            raise RuntimeError("the deployment uses an external registry: restart it where it runs")
        old = next(c for c in self.launcher.children if c.name == "registry")
        await self._stop([old])
        await self._start_registry(port=int(self.registry_url.rsplit(":", 1)[1]))

    def dead_children(self) -> list[str]:
        """Services that exited although nobody stopped them (with their exit codes)."""
        return [f"{c.name} (exit {c.popen.returncode})" for c in self.launcher.children if not c.alive()]

    def check_alive(self, engine: EngineEndpoints, decoder: DecoderEndpoint, generation: int | None = None) -> None:
        """Fail fast, rather than wait on a service that has exited (or an engine that has
        restarted since `generation`, when given)."""
        dead = {c.name for c in self.launcher.children if not c.alive()}
        gone = [n for n in dead if n.startswith(f"{engine.engine_id}-") or n == decoder.name or n == "registry"]
        self.engine_alive(engine)
        if not gone and (engine.state is not EngineState.UP or generation not in (None, engine.generation)):
            death = self.last_death(engine.engine_id)
            gone = list(death.ranks) if death is not None else [engine.engine_id]
        if gone:
            raise PeerLostError(f"cannot route: {', '.join(sorted(gone))} exited", ",".join(sorted(gone)))

    async def aclose(self) -> dict[str, int]:
        for task in list(self._tasks):  # no restart may start while everything stops
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        dead = self.dead_children()
        if dead and self._started:  # a failed start is reported by its own error
            logger.error("services that exited on their own: %s", ", ".join(dead))
        return await self.launcher.stop_all()

    async def __aenter__(self) -> Supervisor:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _flatten(flags: dict[str, object]) -> list[str]:
    return [str(x) for kv in flags.items() for x in kv]
