"""Process supervision for a local deployment: a registry, prefill engines, decode workers.

Starts each service as a child process (port 0, readiness through a ready file), knows
their endpoints, restarts an engine or the registry, and stops everything. It routes no
request: that is `transfer.app.router`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from pdkv.errors import PeerLostError
from transfer.app.launcher import Child, Launcher
from transfer.timeouts import Timeouts

# SMs a prefill's NCCL owner broadcast may take: on two H200s 8 broadcast a layer as fast as
# NCCL's own 24 channels, and let a prefetch hide behind compute that leaves them free
# (README, docs/benchmarks.md).
BROADCAST_CTAS = 8

__all__ = ["DeploymentSpec", "EngineEndpoints", "DecoderEndpoint", "Host", "Supervisor"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Host:
    """Where a service runs: a network namespace (None: this one) and the address it binds.

    Namespaces stand in for separate machines (tests and benchmarks of the path between
    hosts); entering one needs root.
    """

    netns: str | None = None
    address: str = "127.0.0.1"

    @classmethod
    def parse(cls, text: str) -> Host:
        """`ADDRESS` or `NETNS@ADDRESS`."""
        netns, _, address = text.rpartition("@")
        return cls(netns or None, address)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []


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
    # How often an owner drives its UCX worker while a ticket it issued is out. Over TCP
    # between hosts a READ waits for it; lower it there (see `Timeouts`).
    owner_progress: float = Timeouts().ticket_progress_interval
    # SMs the prefill's NCCL owner broadcast may take beside the model's compute; 0: NCCL's choice.
    broadcast_ctas: int = BROADCAST_CTAS
    decode_lanes: int = 0  # 0: one a core, up to 8 (4 on a GPU)
    # False: the decode starts once the prefill replied, with the room's ticket (no control
    # request during the fetch). True: both start at once and the decode reads layers as
    # they are written (claims and readiness polls over HTTP).
    overlap: bool = False
    secret: str | None = None
    start_timeout: float = 120.0
    log_level: str = "WARNING"
    registry_host: Host = Host()
    # An existing registry to use (`http://...` or `etcd://HOST:PORT/PREFIX`) instead of
    # starting the built-in one.
    registry: str | None = None
    prefill_host: Host = Host()
    decode_host: Host = Host()


@dataclass
class EngineEndpoints:
    """A prefill engine's rank 0 intake and every rank's control URL."""

    engine_id: str
    intake: str
    controls: list[str]
    pool_tokens: int


@dataclass
class DecoderEndpoint:
    name: str
    url: str
    pool_tokens: int


@dataclass
class Supervisor:
    """The deployment's services as child processes."""

    spec: DeploymentSpec
    workdir: Path | None = None
    launcher: Launcher = field(init=False)
    registry_url: str = ""
    engines: list[EngineEndpoints] = field(default_factory=list)
    decoders: list[DecoderEndpoint] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="pdkv-"))
        env = {"PDKV_SECRET": self.spec.secret} if self.spec.secret else {}
        self.launcher = Launcher(self.workdir, env)
        self._generation = 0

    def _common(self) -> list[str]:
        return ["--log-level", self.spec.log_level]

    def _spawn(self, name: str, module: str, args: list[str], host: Host) -> Child:
        return self.launcher.spawn(name, module, [*args, "--host", host.address, *self._common()], host.prefix())

    async def _start_registry(self, port: int = 0) -> None:
        if self.spec.registry is not None:
            self.registry_url = self.spec.registry
            return
        args = ["--lease", str(self.spec.lease), "--port", str(port)]
        registry = self._spawn("registry", "transfer.app.registry", args, self.spec.registry_host)
        self.registry_url = await self.launcher.wait_ready(registry, self.spec.start_timeout)

    def _spawn_engine(self, engine_id: str, cp: int) -> list[tuple[str, Child]]:
        s = self.spec
        self._generation += 1  # a fresh rendezvous file for every (re)start
        init = f"file://{self.workdir}/{engine_id}.{self._generation}.dist"
        out = []
        for r in range(cp):
            args = [
                "--engine-id",
                engine_id,
                "--cp-rank",
                str(r),
                "--cp-size",
                str(cp),
                "--dist-init",
                init,
                "--registry",
                self.registry_url,
                "--preset",
                s.preset,
                "--pool-tokens",
                str(s.prefill_pool_tokens),
                "--device",
                s.device,
                "--layer-delay",
                str(s.layer_delay),
                "--pin",
                str(s.pin),
                "--lease",
                str(s.lease),
                "--owner-progress",
                str(s.owner_progress),
                "--broadcast-ctas",
                str(s.broadcast_ctas),
            ]
            worker = self._spawn(f"{engine_id}-cp{r}", "transfer.app.prefill_worker", args, s.prefill_host)
            out.append((engine_id, worker))
        return out

    async def start(self) -> None:
        s, launch = self.spec, self.launcher
        await self._start_registry()
        pending = []
        for e, cp in enumerate(s.engines):
            pending += self._spawn_engine(f"prefill{e}", cp)
        for d in range(s.decoders):
            args = [
                "--registry",
                self.registry_url,
                "--consumer-id",
                f"decode{d}",
                "--preset",
                s.preset,
                "--pool-tokens",
                str(s.decode_pool_tokens),
                "--device",
                s.device,
                "--lanes",
                str(s.decode_lanes),
                "--seed",
                str(d + 1),
            ]
            pending.append((f"decode{d}", self._spawn(f"decode{d}", "transfer.app.decode_worker", args, s.decode_host)))
        ready = await asyncio.gather(*(launch.wait_ready(c, s.start_timeout) for _, c in pending))
        by_engine: dict[str, list[dict[str, str]]] = {}
        for (engine_id, _), text in zip(pending, ready):
            if engine_id.startswith("decode"):
                self.decoders.append(DecoderEndpoint(engine_id, text, s.decode_pool_tokens))
            else:
                by_engine.setdefault(engine_id, []).append(json.loads(text))
        for engine_id, ranks in by_engine.items():
            self.engines.append(
                EngineEndpoints(engine_id, ranks[0]["intake"], [r["control"] for r in ranks], s.prefill_pool_tokens)
            )

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
        if self.spec.registry is not None:
            raise RuntimeError("the deployment uses an external registry: restart it where it runs")
        old = next(c for c in self.launcher.children if c.name == "registry")
        await self.launcher.stop(old, grace=5.0)
        self.launcher.children.remove(old)
        await self._start_registry(port=int(self.registry_url.rsplit(":", 1)[1]))

    def dead_children(self) -> list[str]:
        """Services that exited although nobody stopped them (with their exit codes)."""
        return [f"{c.name} (exit {c.popen.returncode})" for c in self.launcher.children if not c.alive()]

    def check_alive(self, engine: EngineEndpoints, decoder: DecoderEndpoint) -> None:
        """Fail fast, rather than wait on a service that has exited."""
        dead = {c.name for c in self.launcher.children if not c.alive()}
        gone = [n for n in dead if n.startswith(f"{engine.engine_id}-") or n == decoder.name or n == "registry"]
        if gone:
            raise PeerLostError(f"cannot route: {', '.join(sorted(gone))} exited", ",".join(sorted(gone)))

    async def aclose(self) -> dict[str, int]:
        dead = self.dead_children()
        if dead:
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
