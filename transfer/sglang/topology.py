"""Where an SGLang rank sits, as pdkv needs it: what SGLang does not put in `KVArgs`.

SGLang keeps its parallel layout in a process-wide runtime context; pdkv reads it there
when SGLang has set it, and environment variables override it (they are how a test, or
a deployment SGLang does not describe, says it):

    PDKV_SGLANG_REGISTRY   a prefill's bootstrap server URL (default: SGLang's host and
                           disaggregation bootstrap port); or an etcd cluster's URL
                           (etcd://HOST:PORT[,...]/PREFIX), set on prefills and decodes alike:
                           a prefill registers under PREFIX/<its advertised address>:<its
                           bootstrap port>, which is how SGLang's router names it to a decode
                           (bootstrap host and port), and a decode looks it up there
    PDKV_SGLANG_CP_RANK, PDKV_SGLANG_CP_SIZE
                           a layer-split prefill's CP rank and size (default: SGLang's
                           attention CP rank and size)
    PDKV_SGLANG_LAYERS     the model's layer count (default: a decode's own layers; a
                           layer-split prefill reads `num_hidden_layers` from the model's
                           config.json, by SGLang's `--model-path`)
    PDKV_SGLANG_PP_RANK, PDKV_SGLANG_PP_SIZE
                           a prefill's pipeline stage and PP size (default: SGLang's PP rank
                           in KVArgs and PP size); each stage's ranks own its layers
    PDKV_SGLANG_TP_RANK, PDKV_SGLANG_TP_SIZE
                           this rank's attention TP rank and size (default: SGLang's)
    PDKV_SGLANG_DEVICE     "cpu" or "cuda" (default: cuda where there is a GPU)
    PDKV_SGLANG_UCX_WORKERS
                           a decode's UCX workers, the threads that post its READs
                           (default: one a core, up to 8; 4 for a GPU pool)
    PDKV_SGLANG_LANE       how a decode reads its owners: "auto" (the same-host GPU lane
                           where it reaches them, else UCX), "ucx" or "cuda_ipc" (default auto)
    PDKV_SGLANG_OWNER_PROGRESS_MS
                           how often a prefill rank drives its UCX worker, in ms (default 10);
                           over TCP between hosts a READ waits for it: 1 there
    PDKV_SGLANG_HOST       the address a prefill rank advertises for its control endpoint
                           (default: SGLANG_HOST_IP / HOST_IP, else what SGLang's
                           get_local_ip_auto() finds where it is this host's, else the
                           address that routes to the bootstrap server); never loopback or
                           the wildcard unless the bootstrap server itself is on loopback
    PDKV_SGLANG_BIND       where that endpoint listens (default: the advertised address where
                           it is this host's, else the wildcard of its family)
    PDKV_SECRET            the deployment's shared secret (as the demo app's): every pdkv
                           service it starts asks for it, every request carries it
    PDKV_REQUIRE_SECRET    "1": refuse to start without PDKV_SECRET (else a warning, once)
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from pdkv.errors import AuthError, LayoutError
from transfer.addresses import (
    AddressError,
    bind_for,
    http_url,
    is_local_only,
    is_own_address,
    is_wildcard,
    registry_is_local,
    route_source,
    url_host,
)
from transfer.timeouts import Timeouts


def _pipeline(kv_args: Any, ctx: dict[str, Any], prefill: bool) -> tuple[int, int]:
    """This rank's PP stage and the PP size. A prefill's stages each own their layers (an
    owner is a (PP stage, CP rank) pair); a decode reads every layer into one pool, so a
    decode split into stages is refused."""
    pp_rank, pp_size = _env_int("PDKV_SGLANG_PP_RANK"), _env_int("PDKV_SGLANG_PP_SIZE")
    pp_rank = int(getattr(kv_args, "pp_rank", 0) or 0) if pp_rank is None else pp_rank
    pp_size = int(ctx.get("pp_size", 1)) if pp_size is None else pp_size
    if not 0 <= pp_rank < pp_size:
        raise LayoutError(f"pipeline stage (PP rank) {pp_rank} outside a PP size of {pp_size}")
    if pp_size > 1 and not prefill:
        raise LayoutError("pdkv's SGLang backend reads every layer into one decode pool: a decode with PP > 1")
    return pp_rank, pp_size


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    registry_url: str  # a prefill's bootstrap server; "" on a decode (each request names one)
    cp_rank: int
    cp_size: int
    layer_num: int
    device: torch.device
    # cp_rank, cp_size: this rank's owner index and the engine's owner count. An owner is a
    # (PP stage, CP rank) pair, numbered stage-major: with PP 1, the CP rank and size.
    # Attention TP: MLA keeps the whole latent on every TP rank. On a prefill only TP rank 0
    # exports; on a decode every TP rank reads the whole room (one of `tp_size` readers).
    tp_rank: int = 0
    tp_size: int = 1
    # A prefill's control endpoint: the address it registers, and where it listens.
    advertise: str = "127.0.0.1"
    bind: str = "127.0.0.1"

    @property
    def exports(self) -> bool:
        return self.tp_rank == 0


_warned_no_secret = False


def secret() -> str | None:
    """The shared secret from PDKV_SECRET. Without one every pdkv service answers anyone on
    its network, with descriptors whose keys grant READs of the prefill's memory: warned
    once, or refused where PDKV_REQUIRE_SECRET=1."""
    global _warned_no_secret
    value = os.environ.get("PDKV_SECRET") or None
    if value is None:
        if os.environ.get("PDKV_REQUIRE_SECRET", "") not in ("", "0", "false", "no"):
            raise AuthError("PDKV_REQUIRE_SECRET is set but PDKV_SECRET is not: pdkv refuses to start")
        if not _warned_no_secret:
            _warned_no_secret = True
            logger.warning("pdkv: no PDKV_SECRET set; its services answer anyone on the network (set it on every node)")
    return value


def environment(
    registry: str,
    cp_rank: int,
    cp_size: int,
    layers: int,
    device: str,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> dict[str, str]:
    """The variables above, as a launcher (or a test) sets them for one rank (PP's only
    where there are stages: else SGLang's own say)."""
    stages = {"PDKV_SGLANG_PP_RANK": str(pp_rank), "PDKV_SGLANG_PP_SIZE": str(pp_size)} if pp_size > 1 else {}
    return {
        **stages,
        "PDKV_SGLANG_REGISTRY": registry,
        "PDKV_SGLANG_CP_RANK": str(cp_rank),
        "PDKV_SGLANG_CP_SIZE": str(cp_size),
        "PDKV_SGLANG_LAYERS": str(layers),
        "PDKV_SGLANG_DEVICE": device,
        "PDKV_SGLANG_TP_RANK": str(tp_rank),
        "PDKV_SGLANG_TP_SIZE": str(tp_size),
    }


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise LayoutError(f"{name}={value!r} is not an integer") from exc


def _sglang_context() -> dict[str, Any]:
    """What SGLang's runtime context says, where it has been set in this process."""
    try:
        from sglang.srt import runtime_context as rc

        parallel, disagg, serving = rc.get_parallel(), rc.get_disagg(), rc.get_serving()
        return {
            "host": serving.host,
            "dist_init_addr": getattr(parallel, "dist_init_addr", None),
            "port": disagg.disaggregation_bootstrap_port,
            "cp_rank": parallel.attn_cp_rank if parallel.enable_dsa_cache_layer_split else 0,
            "cp_size": parallel.attn_cp_size if parallel.enable_dsa_cache_layer_split else 1,
            "tp_size": parallel.attn_tp_size,
            "tp_rank": parallel.attn_tp_rank,
            "pp_size": parallel.pp_size,
        }
    except Exception as exc:  # not set (a test, a tool): the environment must say it
        logger.debug("no SGLang runtime context: %s", exc)
        return {}


def _model_layers(server_args: Any) -> int | None:
    """`num_hidden_layers` of the model SGLang serves, from its config.json (a local
    directory, or Hugging Face's cache where the hub client is installed); None if unknown."""
    path = getattr(server_args, "model_path", None)
    if not path:
        return None
    config = Path(path) / "config.json"
    if not config.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json", revision=getattr(server_args, "revision", None))
        except ImportError:
            return None
        if not isinstance(cached, str):
            return None
        config = Path(cached)
    try:
        body = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("cannot read %s: %s", config, exc)
        return None
    text = body.get("text_config") or {}
    layers = body.get("num_hidden_layers", text.get("num_hidden_layers"))
    return int(layers) if isinstance(layers, int) and layers > 0 else None


def topology(kv_args: Any, prefill: bool, server_args: Any = None) -> Topology:
    """This rank's place, from the environment, else SGLang's runtime context, else `kv_args`."""
    ctx = _sglang_context()
    registry = os.environ.get("PDKV_SGLANG_REGISTRY", "")
    shared = bool(registry) and not registry_is_local(registry)  # other hosts read it
    if prefill and not registry:
        if "port" not in ctx:
            raise LayoutError("a pdkv prefill needs its bootstrap server: set PDKV_SGLANG_REGISTRY")
        registry, shared = _bootstrap_url(ctx)
    cp_rank = _env_int("PDKV_SGLANG_CP_RANK")
    cp_size = _env_int("PDKV_SGLANG_CP_SIZE")
    cp_rank = ctx.get("cp_rank", 0) if cp_rank is None else cp_rank
    cp_size = ctx.get("cp_size", 1) if cp_size is None else cp_size
    pp_rank, pp_size = _pipeline(kv_args, ctx, prefill)
    layers = _env_int("PDKV_SGLANG_LAYERS")
    if layers is None and prefill and cp_size * pp_size > 1:
        layers = _model_layers(server_args)
        if layers is None:
            raise LayoutError(
                "a layer-split pdkv prefill needs the model's layer count: no config.json with "
                "num_hidden_layers at SGLang's --model-path; set PDKV_SGLANG_LAYERS"
            )
    if layers is None:
        layers = len(kv_args.kv_data_ptrs) - int(getattr(kv_args, "num_draft_entries", 0) or 0)
    wanted = os.environ.get("PDKV_SGLANG_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", int(kv_args.gpu_id)) if wanted == "cuda" else torch.device("cpu")
    if not 0 <= cp_rank < cp_size:
        raise LayoutError(f"CP rank {cp_rank} outside a CP size of {cp_size}")
    tp_rank, tp_size = _env_int("PDKV_SGLANG_TP_RANK"), _env_int("PDKV_SGLANG_TP_SIZE")
    tp_rank = ctx.get("tp_rank", 0) if tp_rank is None else tp_rank
    tp_size = ctx.get("tp_size", 1) if tp_size is None else tp_size
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"attention TP rank {tp_rank} outside a TP size of {tp_size}")
    cp_rank, cp_size = pp_rank * cp_size + cp_rank, pp_size * cp_size  # the engine's owners, stage-major
    advertise = bind = "127.0.0.1"
    if prefill:
        advertise = _advertised(registry, shared)
        bind = (os.environ.get("PDKV_SGLANG_BIND") or "").strip("[]") or bind_for(advertise)
        if urlsplit(registry).scheme == "etcd":  # one etcd, many prefills: each under its router's name
            if "port" not in ctx:
                raise LayoutError(
                    "a pdkv prefill on an etcd registry is named by its bootstrap port: SGLang's is unset"
                )
            registry = prefill_registry(registry, f"{url_host(advertise)}:{ctx['port']}")
    return Topology(registry.rstrip("/"), cp_rank, cp_size, layers, device, tp_rank, tp_size, advertise, bind)


def prefill_registry(registry: str, bootstrap_addr: str) -> str:
    """Where the prefill that SGLang's router names `bootstrap_addr` (HOST:PORT) is registered:
    its bootstrap server, or its name under the etcd cluster `registry` (PDKV_SGLANG_REGISTRY)."""
    if "://" in bootstrap_addr:
        return bootstrap_addr
    if urlsplit(registry).scheme == "etcd":
        return f"{registry.rstrip('/')}/{bootstrap_addr}"
    return f"http://{bootstrap_addr}"


def _bootstrap_url(ctx: dict[str, Any]) -> tuple[str, bool]:
    """SGLang's bootstrap server as SGLang's own prefill ranks reach it: on the host of
    `--dist-init-addr` (several nodes), else on the launcher's `--host` (a wildcard there
    reached through loopback); and whether other hosts read it (all but a loopback `--host`)."""
    host = str(ctx.get("host") or "127.0.0.1")
    if ctx.get("dist_init_addr"):
        host = str(ctx["dist_init_addr"]).rsplit(":", 1)[0].strip("[]")
    shared = not is_local_only(host) or is_wildcard(host)
    if is_wildcard(host):
        host = "::1" if ":" in host else "127.0.0.1"
    return http_url(host, int(ctx["port"])), shared


def _advertised(registry: str, shared: bool) -> str:
    """The address a prefill rank registers (the module's docstring, PDKV_SGLANG_HOST)."""
    given = os.environ.get("PDKV_SGLANG_HOST") or os.environ.get("SGLANG_HOST_IP") or os.environ.get("HOST_IP")
    if given:  # the operator's word: it may be forwarded here (NAT), so it need not be this host's
        chosen = given.strip("[]")
    else:
        found = _sglang_local_ip()
        chosen = found or ""
        if found is None or not is_own_address(found) or is_local_only(found):
            chosen = (route_source(registry) if shared else None) or "127.0.0.1"
            logger.info("SGLang's get_local_ip_auto() gave %s, not this host's: advertising %s", found, chosen)
    if is_local_only(chosen) and shared:
        raise AddressError(
            f"a pdkv prefill would advertise {chosen} to a bootstrap server ({registry}) that other "
            "hosts read: set PDKV_SGLANG_HOST (or SGLANG_HOST_IP) to the address they reach this host at"
        )
    return chosen


def _sglang_local_ip() -> str | None:
    """What SGLang's KV managers advertise (`get_local_ip_auto`: its NIC, then its route out),
    None where it finds nothing."""
    try:
        from sglang.srt.utils.network import get_local_ip_auto

        return str(get_local_ip_auto()).strip("[]")
    except Exception as exc:  # no SGLang here, or it found no address
        logger.debug("SGLang's get_local_ip_auto: %s", exc)
        return None


def ucx_devices(kv_args: Any, server_args: Any) -> str | None:
    """The NICs UCX may use, from SGLang's `--disaggregation-ib-device` (a list, or per GPU),
    for NIXL's UCX `device_list`; None where it is not given or UCX_NET_DEVICES is set."""
    ib = getattr(server_args, "disaggregation_ib_device", None) or getattr(kv_args, "ib_device", None)
    if not ib:
        return None
    if os.environ.get("UCX_NET_DEVICES"):
        logger.warning("UCX_NET_DEVICES is set: --disaggregation-ib-device %s is not applied to pdkv's UCX", ib)
        return None
    try:
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu

        devices = get_ib_devices_for_gpu(ib, int(getattr(kv_args, "gpu_id", 0) or 0))
    except ImportError:
        devices = ib
    except ValueError as exc:
        raise LayoutError(f"--disaggregation-ib-device {ib!r}: {exc}") from exc
    names = [n.strip() for n in str(devices or "").split(",") if n.strip()]
    if any(":" in n for n in names):  # NIXL appends the port itself
        raise LayoutError(f"--disaggregation-ib-device {ib!r}: HCA names without a port (mlx5_0, not mlx5_0:1)")
    return ", ".join(names) or None


@dataclass(frozen=True)
class Settings:
    """An SGLang rank's transfer settings (the module's docstring): None keeps pdkv's default."""

    ucx_workers: int | None = None  # a decode's UCX workers
    lane: str = "auto"  # a decode's lanes: auto, ucx or cuda_ipc
    owner_progress: float | None = None  # seconds between a prefill rank's UCX progress calls


LANES = ("auto", "ucx", "cuda_ipc")


def settings() -> Settings:
    """The PDKV_SGLANG_* transfer settings, checked."""
    workers = _env_int("PDKV_SGLANG_UCX_WORKERS")
    if workers is not None and not 1 <= workers <= 64:
        raise LayoutError(f"PDKV_SGLANG_UCX_WORKERS={workers}: 1 to 64")
    lane = os.environ.get("PDKV_SGLANG_LANE") or "auto"
    if lane not in LANES:
        raise LayoutError(f"PDKV_SGLANG_LANE={lane!r}: one of {', '.join(LANES)}")
    if "PDKV_SGLANG_PATH" in os.environ:  # the old name: refused, not silently ignored
        raise LayoutError("PDKV_SGLANG_PATH is now PDKV_SGLANG_LANE (the same values)")
    progress = os.environ.get("PDKV_SGLANG_OWNER_PROGRESS_MS")
    try:
        ms = None if progress is None else float(progress)
    except ValueError as exc:
        raise LayoutError(f"PDKV_SGLANG_OWNER_PROGRESS_MS={progress!r} is not a number") from exc
    if ms is not None and not 0 < ms <= 1000:
        raise LayoutError(f"PDKV_SGLANG_OWNER_PROGRESS_MS={progress}: above 0, at most 1000")
    return Settings(workers, lane, None if ms is None else ms / 1e3)


STREAM_HEARTBEAT = 1.0


def _sglang_env(name: str, default: float) -> float:
    """SGLang's own setting `name` (its default where unset), as SGLang reads it."""
    try:
        from sglang.srt.environ import envs

        return float(getattr(envs, name).get())
    except (ImportError, AttributeError):
        value = os.environ.get(name)
        return default if value is None else float(value)


def sglang_timeouts(base: Timeouts = Timeouts()) -> Timeouts:
    """pdkv's bounds from SGLang's disaggregation settings (see the README's table):
    how long a room waits for its decode, how long a decode waits for its KV, and when
    silence means a peer is dead."""
    bootstrap = _sglang_env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300)
    waiting = _sglang_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300)
    interval = _sglang_env("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0)
    failures = _sglang_env("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2)
    return base.replace(
        pin=bootstrap,
        lookup=bootstrap,
        fetch=waiting,
        publish=waiting,
        # A readiness stream's heartbeat: silent for three, its owner is taken as lost (a link
        # cut is then noticed within 3 s), not SGLang's interval x failures (10 s by default).
        heartbeat=min(interval, STREAM_HEARTBEAT),
        lease=interval * max(1.0, failures),
    )
