"""Where an SGLang rank sits, as pdkv needs it: what SGLang does not put in `KVArgs`.

SGLang keeps its parallel layout in a process-wide runtime context; pdkv reads it there
when SGLang has set it, and environment variables override it (they are how a test, or
a deployment SGLang does not describe, says it):

    PDKV_SGLANG_REGISTRY   a prefill's bootstrap server URL (default: SGLang's host and
                           disaggregation bootstrap port)
    PDKV_SGLANG_CP_RANK, PDKV_SGLANG_CP_SIZE
                           a layer-split prefill's CP rank and size (default: SGLang's
                           attention CP rank and size)
    PDKV_SGLANG_LAYERS     the model's layer count (default: a decode's own layers; a
                           layer-split prefill reads `num_hidden_layers` from the model's
                           config.json, by SGLang's `--model-path`)
    PDKV_SGLANG_TP_RANK, PDKV_SGLANG_TP_SIZE
                           this rank's attention TP rank and size (default: SGLang's)
    PDKV_SGLANG_DEVICE     "cpu" or "cuda" (default: cuda where there is a GPU)
    PDKV_SGLANG_UCX_WORKERS
                           a decode's UCX workers, the threads that post its READs
                           (default: one a core, up to 8; 4 for a GPU pool)
    PDKV_SGLANG_PATH       how a decode reads its owners: "auto" (the same-host GPU lane
                           where it reaches them, else UCX), "ucx" or "cuda_ipc" (default auto)
    PDKV_SGLANG_OWNER_PROGRESS_MS
                           how often a prefill rank drives its UCX worker, in ms (default 10);
                           over TCP between hosts a READ waits for it: 1 there
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

import torch

from pdkv.errors import AuthError, LayoutError
from transfer.timeouts import Timeouts

__all__ = ["Settings", "Topology", "topology", "environment", "secret", "settings", "sglang_timeouts"]


def _supported(kv_args: Any, ctx: dict[str, Any]) -> None:
    """Refuse the layouts pdkv's SGLang backend does not serve (see the README)."""
    if int(getattr(kv_args, "pp_rank", 0) or 0) or ctx.get("pp_size", 1) > 1:
        raise LayoutError("pdkv's SGLang backend does not serve pipeline parallelism (PP > 1)")


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Topology:
    registry_url: str  # a prefill's bootstrap server; "" on a decode (each request names one)
    cp_rank: int
    cp_size: int
    layer_num: int
    device: torch.device
    # Attention TP: MLA keeps the whole latent on every TP rank. On a prefill only TP rank 0
    # exports; on a decode every TP rank reads the whole room (one of `tp_size` readers).
    tp_rank: int = 0
    tp_size: int = 1

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
    registry: str, cp_rank: int, cp_size: int, layers: int, device: str, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, str]:
    """The variables above, as a launcher (or a test) sets them for one rank."""
    return {
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
    if prefill and not registry:
        if "port" not in ctx:
            raise LayoutError("a pdkv prefill needs its bootstrap server: set PDKV_SGLANG_REGISTRY")
        registry = f"http://{ctx['host'] or '127.0.0.1'}:{ctx['port']}"
    cp_rank = _env_int("PDKV_SGLANG_CP_RANK")
    cp_size = _env_int("PDKV_SGLANG_CP_SIZE")
    cp_rank = ctx.get("cp_rank", 0) if cp_rank is None else cp_rank
    cp_size = ctx.get("cp_size", 1) if cp_size is None else cp_size
    layers = _env_int("PDKV_SGLANG_LAYERS")
    if layers is None and prefill and cp_size > 1:
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
    _supported(kv_args, ctx)
    return Topology(registry.rstrip("/"), cp_rank, cp_size, layers, device, tp_rank, tp_size)


@dataclass(frozen=True)
class Settings:
    """An SGLang rank's transfer settings (the module's docstring): None keeps pdkv's default."""

    ucx_workers: int | None = None  # a decode's UCX workers
    path: str = "auto"  # a decode's lanes: auto, ucx or cuda_ipc
    owner_progress: float | None = None  # seconds between a prefill rank's UCX progress calls


PATHS = ("auto", "ucx", "cuda_ipc")


def settings() -> Settings:
    """The PDKV_SGLANG_* transfer settings, checked."""
    workers = _env_int("PDKV_SGLANG_UCX_WORKERS")
    if workers is not None and not 1 <= workers <= 64:
        raise LayoutError(f"PDKV_SGLANG_UCX_WORKERS={workers}: 1 to 64")
    path = os.environ.get("PDKV_SGLANG_PATH") or "auto"
    if path not in PATHS:
        raise LayoutError(f"PDKV_SGLANG_PATH={path!r}: one of {', '.join(PATHS)}")
    progress = os.environ.get("PDKV_SGLANG_OWNER_PROGRESS_MS")
    try:
        ms = None if progress is None else float(progress)
    except ValueError as exc:
        raise LayoutError(f"PDKV_SGLANG_OWNER_PROGRESS_MS={progress!r} is not a number") from exc
    if ms is not None and not 0 < ms <= 1000:
        raise LayoutError(f"PDKV_SGLANG_OWNER_PROGRESS_MS={progress}: above 0, at most 1000")
    return Settings(workers, path, None if ms is None else ms / 1e3)


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
        heartbeat=interval,
        lease=interval * max(1.0, failures),
    )
