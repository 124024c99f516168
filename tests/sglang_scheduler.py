"""SGLang 0.5.23's own disaggregation scheduler code driving pdkv, on the CPU.

A prefill scheduler process per CP rank (a layer-split DSA prefill) and a decode scheduler
process per attention-TP rank, each running SGLang's own queue code in a loop:

* prefill: `PrefillBootstrapQueue` (`add`, `pop_bootstrapped`), the scheduler mixin's
  `resolve_waiting_queue_bootstrap`, `send_kv_chunk`, `process_disagg_prefill_inflight_queue`
  (and its failure paths), with its poll states all-reduced over real gloo groups (attention
  TP, then attention CP: both CP ranks of a prefill take the same decisions);
* decode: `DecodePreallocQueue` (`add`, `pop_preallocated`) and `DecodeTransferQueue`
  (`pop_transferred`), through the scheduler mixin's `process_decode_queue`, the poll states
  all-reduced over the attention-TP gloo group.

Real SGLang parts: `ServerArgs` published as the process's runtime context, the DSA pools
(`LayerSplitDSATokenToKVPool` on the prefill's CP ranks, `DSATokenToKVPool` on the decode),
`ReqToTokenPool` / `DecodeReqToTokenPool`, `PagedTokenToKVPoolAllocator`, a disabled
`RadixCache`, `MetadataBuffers`, `ReqToMetadataIdxAllocator`, `Req`, and the `Scheduler`
class's methods (the object is made with `object.__new__`: its `__init__` loads a model).
`KVArgs` are built by SGLang's `_init_kv_manager`, the classes come from SGLang's
`get_kv_class(TransferBackend.MOONCAKE, ...)` with pdkv's plugin hook applied
(`load_plugins()` under `PDKV_SGLANG=1`), the bootstrap server is pdkv's.

Stubbed, as the brief allows, only what needs a model: the forward pass (it allocates the
request's KV through the real allocator, as SGLang's batch preparation does, writes known
bytes into the real pool pages of every layer this rank owns, and samples a known first
token), the scheduler's model-bound fields (`tp_worker.model_runner`, `model_config`), and
its output side (`output_streamer`, `metrics_reporter`: the harness records what would be
streamed). The scheduler's `abort_request` needs its tokenizer-facing managers (grammar,
multimodal, beam); the harness runs the disaggregation branch of it, line for line.

`torchvision` cannot be installed beside the CPU torch (its wheels bring a CUDA torch), and
SGLang's `configs` package imports it at import time for multimodal processors; the harness
puts an empty stand-in module in its place (after telling transformers it is absent). Nothing
on the disaggregation path calls it.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import queue
import sys
import tempfile
import time
import traceback
import types
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tests import children

LAYERS, PAGE, POOL_PAGES = 4, 64, 24  # DSA needs 64-token physical pages
KV_DIM = 576  # 512 lora + 64 rope, bf16
INDEX_ITEM = PAGE * 132  # 64 x 128 fp8 keys + 64 fp32 scales a page
MAX_REQS = 8
CONTEXT = PAGE * 8
SENTINEL = 0x5A  # what a decode's radix cache holds in the pages it kept (Role.decode_radix)

logger = logging.getLogger("sglang_scheduler")


# ---- imports ----------------------------------------------------------------------------------


class _Absent(types.ModuleType):
    """A module whose every attribute is another such module: `from torchvision.transforms
    import InterpolationMode` binds a placeholder; calling one raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.__name__}: torchvision is not installed (stand-in of tests/sglang_scheduler.py)")


class _AbsentFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _Absent(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []  # type: ignore[attr-defined]


def import_sglang_scheduler_code() -> None:
    """Import SGLang's prefill.py and decode.py on the CPU (see the module docstring)."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        from transformers.utils import import_utils

        # cached False before the stand-in exists, so transformers never uses it
        assert not import_utils.is_torchvision_available()
        import_utils.is_torchvision_v2_available()
        if not any(isinstance(f, _AbsentFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _AbsentFinder())
    import sglang.srt.disaggregation.decode  # noqa: F401
    import sglang.srt.disaggregation.prefill  # noqa: F401


# ---- what a request holds -----------------------------------------------------------------------


def first_token(room: int) -> int:
    return 1000 + room % 997


def kv_bytes(room: int, layer: int, tokens: int) -> Any:
    """The latent KV rows (bf16 as bytes) the stub forward writes for `room` at `layer`."""
    import torch

    g = torch.Generator().manual_seed(room * 131 + layer)
    return torch.randint(0, 256, (tokens, KV_DIM * 2), generator=g, dtype=torch.uint8)


def index_bytes(room: int, layer: int, pages: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(room * 131 + layer + 7_000_000)
    return torch.randint(0, 256, (pages, INDEX_ITEM), generator=g, dtype=torch.uint8)


# ---- a process's SGLang context ----------------------------------------------------------------


def _model_dir() -> str:
    """A model directory SGLang's `ServerArgs` resolves on the CPU (no DSA hooks, which ask
    for a GPU); the pools themselves are DSA's."""
    d = tempfile.mkdtemp(prefix="pdkv-sglang-model-")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": LAYERS,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d


@dataclass
class Role:
    """One scheduler process: `mode` "prefill" or "decode", its rank in its gloo group of
    `size` (CP ranks of a prefill, attention-TP ranks of a decode)."""

    mode: str
    rank: int
    size: int
    registry: str  # pdkv's bootstrap server URL (SGLang's bootstrap server)
    dist_init: str  # the gloo group's rendezvous (file://)
    # A prefill's pipeline stage of `pp_size`: its ranks own the stage's layers, split between them.
    pp_rank: int = 0
    pp_size: int = 1
    # A decode's radix cache (--disaggregation-decode-enable-radix-cache): what it received is
    # inserted into its tree, the pages then set to SENTINEL (a later read of them would show).
    decode_radix: bool = False
    env: dict[str, str] = field(default_factory=dict)
    timeouts: dict[str, str] = field(default_factory=dict)  # SGLANG_DISAGGREGATION_* settings
    netns: str | None = None  # the network namespace (tests/netns.py's host) it runs in
    drafts: int = 0  # a draft model's (MTP) layers: a DSA draft pool on each rank, as SGLang's MTP keeps
    bootstrap: str | None = None  # SGLang's bootstrap server, where `registry` is elsewhere (etcd)
    # A decode's pace of asking after a prefill it does not know yet (SGLang's prealloc queue,
    # `_ensure_retry_interval`, 1 s): slowed, a test acts while a first room waits for `init`.
    ensure_retry_s: float | None = None

    @property
    def bootstrap_port(self) -> int:
        """SGLang's --disaggregation-bootstrap-port: the registry's where it is the bootstrap server."""
        return int((self.bootstrap or self.registry).rsplit(":", 1)[1])


def _set_env(role: Role) -> None:
    from transfer.sglang.topology import environment

    if role.mode == "prefill":
        stage = {"pp_rank": role.pp_rank, "pp_size": role.pp_size}
        os.environ.update(environment(role.registry, role.rank, role.size, LAYERS, "cpu", **stage))
        os.environ.setdefault("PDKV_SGLANG_HOST", "127.0.0.1")  # loopback unless the test says a host
    else:
        os.environ.update(environment("", 0, 1, LAYERS, "cpu", role.rank, role.size))
    os.environ["PDKV_SGLANG"] = "1"
    os.environ.update(role.timeouts)
    os.environ.update(role.env)


def _publish(role: Role) -> Any:
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    port = role.bootstrap_port
    cp = role.mode == "prefill" and role.size > 1
    server_args = ServerArgs(
        model_path=_model_dir(),
        disaggregation_mode=role.mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=port,
        device="cpu",
        page_size=PAGE,
        skip_tokenizer_init=True,
        tp_size=role.size,
        **({"attn_cp_size": role.size, "enable_prefill_cp": True, "cp_strategy": "interleave"} if cp else {}),
        **({"disaggregation_decode_enable_radix_cache": True} if role.decode_radix else {}),
    )
    rc.publish(server_args, role="scheduler")
    if cp:
        # SGLang's ServerArgs takes --enable-dsa-cache-layer-split only for a DSA model, whose
        # hooks ask for a GPU: the flag is set on the published context instead
        rc.get_parallel().override_permanently(enable_dsa_cache_layer_split=True)
    return server_args


def _stage_layers(role: Role) -> dict[str, int]:
    """A prefill stage's pool arguments: the layers SGLang's `get_pp_indices` gives its PP rank
    ({} without stages)."""
    if role.pp_size == 1:
        return {}
    from sglang.srt.distributed.utils import get_pp_indices

    start, end = get_pp_indices(LAYERS, role.pp_rank, role.pp_size)
    return {"layer_num": end - start, "start_layer": start, "end_layer": end}


class _ByModelLayer:
    """A stage's pool as the stub forward and the checks index it: by the model's layer number
    (a layer outside the stage is an empty buffer, as one outside a CP rank's share is)."""

    def __init__(self, pool: Any) -> None:
        import torch

        empty = torch.empty(0)
        before, after = pool.start_layer, LAYERS - pool.start_layer - pool.layer_num
        self.kv_buffer = [empty] * before + list(pool.kv_buffer) + [empty] * after
        index = pool.index_k_with_scale_buffer
        self.index_k_with_scale_buffer = [empty] * before + list(index) + [empty] * after


@dataclass
class _Group:
    """What SGLang's `GroupCoordinator` offers the pools and queues here: a real gloo group."""

    cpu_group: Any
    world_size: int
    rank_in_group: int
    pynccl_comm: Any = None
    device: Any = "cpu"


def _groups(role: Role) -> tuple[Any, Any]:
    """(attention-TP group, attention-CP group) of this process, real gloo groups."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=role.dist_init, rank=role.rank, world_size=role.size)
    singles = [dist.new_group([r], backend="gloo") for r in range(role.size)]
    everyone = dist.new_group(list(range(role.size)), backend="gloo")
    if role.mode == "prefill":  # CP ranks: TP of one each, CP across
        return singles[role.rank], everyone
    return everyone, singles[role.rank]


# ---- the scheduler object ---------------------------------------------------------------------


class Outputs:
    """What the scheduler would stream to its tokenizer: (rid, finished reason) records."""

    def __init__(self) -> None:
        self.streamed: list[tuple[str, str]] = []
        self.why: list[tuple[str, str | None]] = []  # (rid, the finished reason's message), in step

    def stream_output(self, reqs: list[Any], *args: Any, **kwargs: Any) -> None:
        for req in reqs:
            self.streamed.append((req.rid, type(req.finished_reason).__name__))
            self.why.append((req.rid, getattr(req.finished_reason, "message", None)))


def _scheduler(role: Role, server_args: Any, tp_group: Any, cp_group: Any) -> Any:
    """SGLang's `Scheduler` with the fields its disaggregation code reads; no model."""
    import torch
    from sglang.srt import runtime_context as rc
    from sglang.srt.disaggregation.decode import (
        DecodePreallocQueue,
        DecodeReqToTokenPool,
        DecodeTransferQueue,
    )
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        MetadataBuffers,
        ReqToMetadataIdxAllocator,
        TransferBackend,
    )
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    prefill = role.mode == "prefill"
    parallel = rc.get_parallel()
    tp_rank, tp_size = role.rank, role.size  # a prefill's CP ranks are its TP ranks, of attention TP 1
    attn_tp_rank, attn_tp_size = (0, 1) if prefill else (role.rank, role.size)
    parallel.override_permanently(
        tp_rank=tp_rank,
        attn_tp_rank=attn_tp_rank,
        attn_cp_rank=role.rank if prefill else 0,
        attn_dp_rank=0,
        dp_rank=None,
        pp_rank=0,
        attn_tp_group=_Group(tp_group, attn_tp_size, attn_tp_rank),
        attn_cp_group=_Group(cp_group, role.size if prefill else 1, role.rank if prefill else 0),
    )
    rc.get_device()._set("gpu_id", 0)

    tokens = PAGE * POOL_PAGES
    pool_kwargs = dict(
        size=tokens,
        page_size=PAGE,
        kv_lora_rank=512,
        dtype=torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=KV_DIM,
    )
    pool_kwargs.update(_stage_layers(role))  # a pipeline stage's pool holds its own layers only, as SGLang's
    if prefill and role.size > 1:
        pool = LayerSplitDSATokenToKVPool(**pool_kwargs, layer_shard_rank=role.rank, layer_shard_size=role.size)
    else:
        pool = DSATokenToKVPool(**pool_kwargs)
    # the draft shares the target's token ids; under the layer split SGLang sends it from the last CP rank only
    draft = DSATokenToKVPool(**{**pool_kwargs, "layer_num": role.drafts}) if role.drafts else None
    allocator = PagedTokenToKVPoolAllocator(tokens, PAGE, torch.int64, "cpu", pool, need_sort=False)
    if prefill:
        req_to_token = ReqToTokenPool(MAX_REQS, CONTEXT, "cpu", False)
    else:
        req_to_token = DecodeReqToTokenPool(MAX_REQS, CONTEXT, "cpu", False, pre_alloc_size=MAX_REQS)
    tree = RadixCache(
        CacheInitParams(
            disable=not role.decode_radix,
            req_to_token_pool=req_to_token,
            token_to_kv_pool_allocator=allocator,
            page_size=PAGE,
        )
    )

    s = object.__new__(Scheduler)
    s.server_args = server_args
    s.disaggregation_mode = DisaggregationMode.PREFILL if prefill else DisaggregationMode.DECODE
    s.transfer_backend = TransferBackend.MOONCAKE
    s.tp_rank, s.tp_size = tp_rank, tp_size
    s.attn_tp_cpu_group, s.attn_cp_cpu_group = tp_group, cp_group
    s.req_to_token_pool, s.token_to_kv_pool_allocator, s.tree_cache = req_to_token, allocator, tree
    s.max_total_num_tokens = tokens
    s.waiting_queue = []
    s.running_batch = types.SimpleNamespace(reqs=[], batch_is_full=False)
    s.last_batch = None
    s.chunked_req = None
    s.enable_overlap = False
    s.enable_staging = False
    s.enable_hisparse = False
    s.enable_lora = False
    s.enable_decode_hicache = False
    s.enable_priority_scheduling = False
    s.rust_server = None
    s.processed_tokens_counter = 0
    s.random_seed = 0
    s.output_streamer = Outputs()
    s.scheduler_stage_metrics = None
    # the decode's commit counts reasoning tokens of what the prefill sampled: no tokenizer here
    s.batch_result_processor = types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a, **k: None)
    s.metrics_reporter = types.SimpleNamespace(
        enable_metrics=False, kv_transfer_latency_ms=None, kv_transfer_speed_gb_s=None
    )
    # model-bound fields
    s.model_config = types.SimpleNamespace(
        num_hidden_layers=LAYERS, hf_text_config=types.SimpleNamespace(), hf_config=types.SimpleNamespace()
    )
    s.tp_worker = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(kv_cache_dtype_str="auto", effective_logical_max_total_num_tokens=tokens),
        is_hybrid_swa=False,
    )
    s.spec_algorithm = types.SimpleNamespace(is_eagle=lambda: False, is_none=lambda: True)

    s.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(MAX_REQS * 2)
    s.disagg_metadata_buffers = MetadataBuffers(
        MAX_REQS * 2, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
    )
    if prefill:
        s.disagg_prefill_bootstrap_queue = PrefillBootstrapQueue(
            token_to_kv_pool=pool,
            draft_token_to_kv_pool=draft,
            req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=s.disagg_metadata_buffers,
            gpu_id=0,
            bootstrap_port=role.bootstrap_port,
            max_total_num_tokens=tokens,
            scheduler=s,
            scheduler_stage_metrics=None,
            transfer_backend=TransferBackend.MOONCAKE,
        )
        s.disagg_prefill_inflight_queue = []
        s.disagg_prefill_pending_chunk_rids = set()
    else:
        s.disagg_decode_transfer_queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=s.disagg_metadata_buffers,
            scheduler=s,
            tree_cache=tree,
        )
        s.disagg_decode_prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=req_to_token,
            token_to_kv_pool_allocator=allocator,
            draft_token_to_kv_pool=draft,
            req_to_metadata_buffer_idx_allocator=s.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=s.disagg_metadata_buffers,
            scheduler=s,
            transfer_queue=s.disagg_decode_transfer_queue,
            tree_cache=tree,
            gpu_id=0,
            bootstrap_port=role.bootstrap_port,
            max_total_num_tokens=tokens,
            num_reserved_decode_tokens=0,
            transfer_backend=TransferBackend.MOONCAKE,
        )
    s.harness_pool, s.harness_draft = pool, draft
    return s


def _new_req(rid: str, room: int, tokens: int, host: str, port: int, mode: str) -> Any:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=1 if mode == "prefill" else 4)
    params.normalize(None)
    req = Req(
        rid,
        "",
        array("q", tokens if isinstance(tokens, list) else [(room + i) % 2000 + 1 for i in range(tokens)]),
        params,
        bootstrap_host=host,
        bootstrap_port=port,
        bootstrap_room=room,
        disagg_mode=DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE,
    )
    return req


# ---- the stub forward ---------------------------------------------------------------------------


def _owned_layers(pool: Any) -> list[int]:
    return [layer for layer in range(LAYERS) if pool.kv_buffer[layer].shape[0] > 0]


def _prefill_forward(s: Any, req: Any) -> None:
    """One prefill forward of a whole prompt: KV allocated through SGLang's allocator (as its
    batch preparation does), known bytes into the owned layers' pages, a first token sampled;
    then what `process_batch_result_disagg_prefill` does with a finished request."""
    import torch

    pool, n = s.harness_pool, len(req.origin_input_ids)
    assert s.req_to_token_pool.alloc([req]) is not None
    locs = s.token_to_kv_pool_allocator.alloc(-(-n // PAGE) * PAGE)
    assert locs is not None, "the prefill's KV pool is full"
    s.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, n)), locs[:n].to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = n
    req.prefix_len, req.extend_end = 0, n
    pages = locs[::PAGE] // PAGE
    for layer in _owned_layers(pool):
        pool.kv_buffer[layer].view(torch.uint8).view(-1, KV_DIM * 2)[locs[:n]] = kv_bytes(req.bootstrap_room, layer, n)
        pool.index_k_with_scale_buffer[layer][pages] = index_bytes(req.bootstrap_room, layer, len(pages))
    for d in range(s.harness_draft.layer_num if s.harness_draft is not None else 0):  # draft layer d: LAYERS + d
        s.harness_draft.kv_buffer[d].view(torch.uint8).view(-1, KV_DIM * 2)[locs[:n]] = kv_bytes(
            req.bootstrap_room, LAYERS + d, n
        )
        s.harness_draft.index_k_with_scale_buffer[d][pages] = index_bytes(req.bootstrap_room, LAYERS + d, len(pages))
    req.output_ids.append(first_token(req.bootstrap_room))
    s.checkpoint_disagg_prefill(req)
    s.disagg_prefill_inflight_queue.append(req)
    if not req.pending_bootstrap:
        s.send_kv_chunk(req, last_chunk=True)


def _past(rows: Any, held: int) -> Any:
    """`rows` with the first `held` set to SENTINEL: what a decode holding them as its prefix has."""
    rows[:held] = SENTINEL
    return rows


def _keep_as_prefix(s: Any, req: Any) -> None:
    """A finished request on a decode with its radix cache: its pages set to SENTINEL (a later
    read of the ones the tree keeps would show), then SGLang's release inserts it into the tree."""
    import torch
    from sglang.srt.mem_cache.common import release_kv_cache

    pool, n = s.harness_pool, len(req.origin_input_ids)
    locs = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    for layer in range(LAYERS):
        pool.kv_buffer[layer].view(torch.uint8).view(-1, KV_DIM * 2)[locs] = SENTINEL
        pool.index_k_with_scale_buffer[layer][locs[::PAGE] // PAGE] = SENTINEL
    release_kv_cache(req, s.tree_cache, checkpoint=True)


def _record_frees(mgr: Any) -> dict[int, list[list[int]]]:
    """The pages each room's pin freed on this rank's exporter, every free in order (a
    decode's prefix goes ahead of the release), recorded as its `RoomTable` frees them (on
    pdkv's thread), by room."""
    freed: dict[int, list[list[int]]] = {}
    rooms = mgr.exporter.exporter.rooms
    inner = rooms._on_free

    def on_free(room: int, pages: Any) -> None:
        freed.setdefault(room, []).append(sorted(int(p) for p in pages))
        inner(room, pages)

    rooms._on_free = on_free
    return freed


def _decode_check(s: Any, req: Any) -> dict[str, Any]:
    """What the decode's first forward would read: the room's KV and aux, byte for byte."""
    import torch

    pool, n = s.harness_pool, len(req.origin_input_ids)
    held = int(req.kv.cache_protected_len)  # its radix-cache prefix: kept as it was (SENTINEL), not read
    locs = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    pages = locs[::PAGE] // PAGE
    bad = []
    for layer in range(LAYERS):
        got = pool.kv_buffer[layer].view(torch.uint8).view(-1, KV_DIM * 2)[locs]
        if not torch.equal(got, _past(kv_bytes(req.bootstrap_room, layer, n), held)):
            bad.append(("kv", layer))
        if not torch.equal(
            pool.index_k_with_scale_buffer[layer][pages],
            _past(index_bytes(req.bootstrap_room, layer, len(pages)), held // PAGE),
        ):
            bad.append(("index", layer))
    for d in range(s.harness_draft.layer_num if s.harness_draft is not None else 0):
        got = s.harness_draft.kv_buffer[d].view(torch.uint8).view(-1, KV_DIM * 2)[locs]
        if not torch.equal(got, kv_bytes(req.bootstrap_room, LAYERS + d, n)):
            bad.append(("draft kv", d))
        want = index_bytes(req.bootstrap_room, LAYERS + d, len(pages))
        if not torch.equal(s.harness_draft.index_k_with_scale_buffer[d][pages], want):
            bad.append(("draft index", d))
    return {"bad": bad, "first_token": list(req.output_ids)[:1], "pages": pages.tolist()}


# ---- watched pages: no byte lands after Failed -------------------------------------------------------

WATCH_SENTINEL = 0xA5  # what a watched request's pages hold from its claim on (not a byte the stub writes whole)


def _watched_pages(s: Any, locs: Any) -> list[Any]:
    """Views of every byte a request's KV occupies on this decode rank (its token rows and
    index pages, in every layer, the draft's too), in one fixed order."""
    import torch

    pages = locs[::PAGE] // PAGE
    views = []
    for p in [s.harness_pool] + ([s.harness_draft] if s.harness_draft is not None else []):
        for layer in range(len(p.kv_buffer)):
            views.append((p.kv_buffer[layer].view(torch.uint8).view(-1, KV_DIM * 2), locs))
            views.append((p.index_k_with_scale_buffer[layer], pages))
    return views


def _write_sentinel(s: Any, req: Any) -> Any:
    """WATCH_SENTINEL into the pages the decode allocated for `req`; returns their token
    locations (its pages are freed at Failed: the rows go, the locations are kept here).
    Only for a held room: nothing may be read into them yet."""
    import torch

    locs = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)].to(torch.int64)
    for buf, at in _watched_pages(s, locs):
        buf[at] = WATCH_SENTINEL
    return locs


def _landed(s: Any, locs: Any) -> int:
    """How many of the watched blocks (a layer's KV rows or index pages) no longer hold only the sentinel."""
    return sum(bool((buf[at] != WATCH_SENTINEL).any()) for buf, at in _watched_pages(s, locs))


@dataclass
class _Watch:
    """A request whose pages hold the sentinel from its claim: whether bytes first landed
    (told once), and what its pages held when SGLang ended it (streamed: Failed, aborted)."""

    locs: Any
    landing_told: bool = False
    at_end: list[Any] | None = None

    def state(self, s: Any) -> dict[str, Any]:
        import torch

        now = [buf[at].clone() for buf, at in _watched_pages(s, self.locs)]
        unchanged = self.at_end is None or all(torch.equal(a, b) for a, b in zip(self.at_end, now))
        changed = [i for i, b in enumerate(now) if bool((b != WATCH_SENTINEL).any())]
        bytes_in = [int((now[i] != WATCH_SENTINEL).sum()) for i in changed]
        return {"landed": len(changed), "blocks": len(now), "unchanged": unchanged, "which": changed, "bytes": bytes_in}


def _watch_step(s: Any, role: Role, outbox: Any, wanted: set[str], watched: dict[str, _Watch]) -> None:
    """After the decode's queues ran: the sentinel into a wanted request's pages once it sits
    in the transfer queue (its pages allocated, its room claimed), and word when its first
    bytes land (a READ under way)."""
    for d in s.disagg_decode_transfer_queue.queue:
        rid = d.req.rid
        if rid in wanted:
            wanted.discard(rid)
            watched[rid] = _Watch(_write_sentinel(s, d.req))
            outbox.put(("sentinel", role.rank, rid, time.time()))
        elif rid in watched and not watched[rid].landing_told and _landed(s, watched[rid].locs):
            watched[rid].landing_told = True
            outbox.put(("landing", role.rank, rid, time.time()))


# ---- aborts, as the scheduler's abort_request takes them -----------------------------------------


def _abort_prefill(s: Any, rid: str) -> None:
    """The prefill branch of `Scheduler.abort_request` (0.5.23): the waiting queue's
    entries are popped and released, the bootstrap and in-flight queues' senders aborted."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for i in reversed([i for i, r in enumerate(s.waiting_queue) if r.rid.startswith(rid)]):
        req = s.waiting_queue.pop(i)
        s._release_aborted_request(req)
        req.finished_reason = req.finished_reason or FINISH_ABORT()
        s.output_streamer.stream_output([req])
        s.release_aborted_prefill_waiting_req(req)
    for req in s.disagg_prefill_bootstrap_queue.queue:
        if req.rid.startswith(rid):
            s._release_aborted_request(req)
            req.disagg_kv_sender.abort()
    for req in s.disagg_prefill_inflight_queue:
        if req.rid.startswith(rid):
            req.disagg_kv_sender.abort()


def _abort_decode(s: Any, rid: str) -> None:
    """The decode branch of `Scheduler.abort_request` (0.5.23) for its two queues."""
    for decode_req in s.disagg_decode_prealloc_queue.queue:
        if decode_req.req.rid.startswith(rid):
            decode_req.kv_receiver.abort()
    for decode_req in s.disagg_decode_transfer_queue.queue:
        if decode_req.req.rid.startswith(rid):
            decode_req.kv_receiver.abort()


# ---- the scheduler processes ---------------------------------------------------------------------


def _prefill_stats(s: Any) -> dict[str, Any]:
    """The target exporter's rooms and pins; `parts`: every part's (the draft's too), by suffix."""
    mgr = s.disagg_prefill_bootstrap_queue.kv_manager
    rooms = mgr.exporter.exporter.rooms
    parts = {
        part: {"pinned_pages": e.exporter.rooms.pinned_pages, "rooms": sorted(e.exporter.rooms._live)}
        for part, e in mgr.exporters.items()
    }
    return {
        "live_rooms": rooms.live_rooms,
        "pinned_pages": rooms.pinned_pages,
        "rooms": sorted(rooms._live),
        "parts": parts,
        "claims": {room: len(r.open_claims) for room, r in rooms._live.items()},  # granted, not released
    }


def scheduler_main(role: Role, inbox: Any, outbox: Any) -> None:
    """One scheduler process: SGLang's own queue code in a loop, commands from the test
    (rank 0 reads them and broadcasts them over the group, as SGLang broadcasts requests)."""
    if role.netns is not None:  # first: before any thread or socket exists
        from tests.netns import enter_netns

        enter_netns(role.netns)
    logging.basicConfig(level=os.environ.get("PDKV_TEST_LOG", "WARNING"))
    try:
        _set_env(role)
        import_sglang_scheduler_code()
        import torch.distributed as dist
        from sglang.srt.disaggregation.utils import is_aborted
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.common import release_kv_cache
        from sglang.srt.plugins import load_plugins

        load_plugins()
        if os.environ.get("PDKV_SGLANG_SCHEDULER_PRELOAD"):
            # diagnostic: a module imported after the plugin, to try a change to pdkv's classes
            # without editing transfer/ (never set by the tests)
            __import__(os.environ["PDKV_SGLANG_SCHEDULER_PRELOAD"])
        server_args = _publish(role)
        tp_group, cp_group = _groups(role)
        s = _scheduler(role, server_args, tp_group, cp_group)
        if role.pp_size > 1:
            s.harness_pool = _ByModelLayer(s.harness_pool)
        if role.ensure_retry_s is not None and role.mode == "decode":
            s.disagg_decode_prealloc_queue._ensure_retry_interval = role.ensure_retry_s
        group = cp_group if role.mode == "prefill" else tp_group
        prefill = role.mode == "prefill"
        mgr = s.disagg_prefill_bootstrap_queue.kv_manager if prefill else s.disagg_decode_prealloc_queue.kv_manager
        freed = _record_frees(mgr) if prefill else {}
        outbox.put(("ready", role.rank, type(mgr).__module__ + "." + type(mgr).__qualname__))
    except BaseException:
        outbox.put(("error", role.rank, traceback.format_exc()))
        raise
    streamed = 0
    held: set[str] = set()  # prefill: requests whose forward waits for a "go"
    sent: dict[int, list[int]] = {}  # prefill: the pages SGLang sends of each room, in order
    receivers: dict[str, Any] = {}  # decode: each request's receiver, for what it moved
    wanted: set[str] = set()  # decode: requests to get the sentinel once claimed ("sentinel")
    watched: dict[str, _Watch] = {}  # decode: requests whose pages hold it
    try:
        while True:
            cmds: list[Any] = []
            if role.rank == 0:
                while True:
                    try:
                        cmds.append(inbox.get_nowait())
                    except queue.Empty:
                        break
            box = [cmds]
            dist.broadcast_object_list(box, src=0, group=group)
            cmds = box[0]
            if any(c[0] == "stop" for c in cmds):
                break
            for cmd in cmds:
                if cmd[0] == "req":
                    _, rid, room, tokens, host, port, hold = cmd
                    if hold:
                        held.add(rid)
                    req = _new_req(rid, room, tokens, host, port, role.mode)
                    if prefill:
                        s.disagg_prefill_bootstrap_queue.add(req, num_kv_heads=1)
                    else:
                        s.disagg_decode_prealloc_queue.add(req)
                elif cmd[0] == "abort":
                    (_abort_prefill if prefill else _abort_decode)(s, cmd[1])
                    outbox.put(("aborted", role.rank, cmd[1], time.time()))
                elif cmd[0] == "sentinel" and not prefill:
                    wanted.add(cmd[1])
                elif cmd[0] == "check" and not prefill:  # the watched pages now, against what they held at the end
                    outbox.put(("kept", role.rank, cmd[1], watched[cmd[1]].state(s), time.time()))
                elif cmd[0] == "go":
                    held.discard(cmd[1])
                elif cmd[0] == "stats" and prefill:
                    outbox.put(("stats", role.rank, _prefill_stats(s)))
                elif cmd[0] == "pins" and prefill:
                    counters = vars(mgr.exporter.exporter.rooms.counters)
                    outbox.put(("pins", role.rank, {"sent": dict(sent), "freed": dict(freed), "counters": counters}))
            if prefill:
                s.waiting_queue.extend(s.disagg_prefill_bootstrap_queue.pop_bootstrapped())
                s.resolve_waiting_queue_bootstrap()
                batch = [r for r in s.waiting_queue if not is_aborted(r) and r.rid not in held]
                s.waiting_queue = [r for r in s.waiting_queue if r not in batch]
                for req in batch:
                    _prefill_forward(s, req)
                    row = s.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids) : PAGE]
                    sent[req.bootstrap_room] = [int(p) // PAGE for p in row]  # in the room's order
                for req in s.process_disagg_prefill_inflight_queue():
                    state = int(req.disagg_kv_sender.poll())
                    error = None
                    try:
                        req.disagg_kv_sender.failure_exception() if state == 0 else None
                    except Exception as exc:
                        error = f"{type(exc).__name__}: {exc}"
                    outbox.put(
                        ("done", role.rank, req.rid, type(req.finished_reason).__name__, state, error, time.time())
                    )
            else:
                for d in (*s.disagg_decode_prealloc_queue.queue, *s.disagg_decode_transfer_queue.queue):
                    if d.kv_receiver is not None:
                        receivers[d.req.rid] = d.kv_receiver
                s.process_decode_queue()
                if wanted or watched:
                    _watch_step(s, role, outbox, wanted, watched)
                for req in s.waiting_queue:
                    got, receiver = _decode_check(s, req), receivers.pop(req.rid, None)
                    got["held"] = int(req.kv.cache_protected_len)  # the decode's prefix, in tokens
                    got["moved"] = None if receiver is None else receiver.get_transfer_metric().transfer_total_bytes
                    outbox.put(("received", role.rank, req.rid, got, time.time()))
                    req.finished_reason = FINISH_LENGTH(length=0)
                    if role.decode_radix:
                        _keep_as_prefix(s, req)
                    else:
                        release_kv_cache(req, s.tree_cache, checkpoint=False)
                s.waiting_queue = []
            for rid, reason in s.output_streamer.streamed[streamed:]:
                receivers.pop(rid, None)
                if rid in watched and watched[rid].at_end is None:  # Failed: what its pages hold from now on
                    watch = watched[rid]
                    watch.at_end = [buf[at].clone() for buf, at in _watched_pages(s, watch.locs)]
                    outbox.put(("kept", role.rank, rid, watch.state(s), time.time()))
                outbox.put(("streamed", role.rank, rid, reason, time.time()))
            for rid, message in s.output_streamer.why[streamed:]:
                outbox.put(("why", role.rank, rid, message))
            streamed = len(s.output_streamer.streamed)
            time.sleep(0.002)
    except BaseException:
        outbox.put(("error", role.rank, traceback.format_exc()))
        raise
    finally:
        mgr.close()
        dist.destroy_process_group()


# ---- the test's side -------------------------------------------------------------------------------


def registry_main(netns: str | None, host: str, outbox: Any, stop: Any) -> None:
    """pdkv's bootstrap server (SGLang's bootstrap server in a deployment) on a host of its own."""
    if netns is not None:
        from tests.netns import enter_netns

        enter_netns(netns)
    from transfer.sglang.conn import PdkvKVBootstrapServer

    server = PdkvKVBootstrapServer(host, 0)
    outbox.put(server.url)
    try:
        stop.get()
    finally:
        server.close()


class Registry:
    """`registry_main` in a process, on `host` inside `netns`."""

    def __init__(self, netns: str | None, host: str) -> None:
        ctx = children.context()
        self.outbox, self.stop = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=registry_main, args=(netns, host, self.outbox, self.stop), daemon=True)
        self.proc.start()
        self.url: str = self.outbox.get(timeout=600)  # its import of SGLang is slow on a loaded machine

    def close(self) -> None:
        self.stop.put(None)
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()


class Side:
    """The scheduler processes of one prefill (its CP ranks) or one decode (its TP ranks)."""

    def __init__(self, mode: str, size: int, registry: str, **kwargs: Any) -> None:
        ctx = children.context()
        self.mode, self.size = mode, size
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.rendezvous = tempfile.NamedTemporaryFile(prefix=f"pdkv-{mode}-gloo-", delete=False).name
        os.unlink(self.rendezvous)
        port = "file://" + self.rendezvous
        self.idle = [ctx.Queue() for _ in range(size - 1)]  # the other ranks hear from rank 0
        inboxes = [self.inbox, *self.idle]
        self.procs = [
            ctx.Process(
                target=scheduler_main,
                args=(Role(mode, r, size, registry, port, **kwargs), inboxes[r], self.outbox),
                daemon=True,
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()
        self.events: list[tuple] = []
        self.failure: str | None = None  # a rank's traceback, once one failed

    def ready(self, timeout: float = 90) -> list[str]:
        managers = [self.wait("ready", timeout=timeout)[2] for _ in range(self.size)]
        return managers

    def send(self, *cmd: Any) -> None:
        self.inbox.put(cmd)

    def _pump(self, timeout: float) -> tuple | None:
        try:
            event = self.outbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if event[0] == "error":
            self.failure = f"{self.mode} rank {event[1]} failed:\n{event[2]}"
        self.events.append(event)
        return event

    def wait(self, kind: str, rid: str | None = None, timeout: float = 60, rank: int | None = None) -> tuple:
        """The first event of `kind` (for `rid`, from `rank`) not yet taken."""
        end = time.monotonic() + timeout
        while True:
            if self.failure is not None:  # its group cannot go on: every later wait fails at once
                raise RuntimeError(self.failure)
            for i, e in enumerate(self.events):
                if e[0] == kind and (rid is None or e[2] == rid) and (rank is None or e[1] == rank):
                    return self.events.pop(i)
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.mode}: no {kind} event for {rid} in {timeout} s; seen {self.events}")
            self._pump(min(left, 0.5))

    def kill(self, rank: int) -> None:
        """SIGKILL rank `rank`'s process (a crash: no close, no word to any peer)."""
        self.procs[rank].kill()
        self.procs[rank].join(10)

    def close(self) -> None:
        self.send("stop")
        for p in self.procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)


# ---- a module's cluster, as its fixture holds it ----------------------------------------------------


class _Cluster(Protocol):
    def start(self) -> None: ...
    def close(self) -> None: ...


C = TypeVar("C", bound=_Cluster)


@contextlib.contextmanager
def secret_for_children(secret: str) -> Iterator[None]:
    """PDKV_SECRET set for the processes spawned meanwhile (they inherit it), then restored."""
    before = os.environ.get("PDKV_SECRET")
    os.environ["PDKV_SECRET"] = secret
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PDKV_SECRET", None)
        else:
            os.environ["PDKV_SECRET"] = before


@contextlib.contextmanager
def bootstrap_server() -> Iterator[Any]:
    """pdkv's bootstrap server on loopback (SGLang's bootstrap server in a deployment)."""
    from transfer.sglang.conn import PdkvKVBootstrapServer

    server = PdkvKVBootstrapServer("127.0.0.1", 0)
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def started(cluster: C) -> Iterator[C]:
    """`cluster` started (every rank ready), and closed however the module ends."""
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
