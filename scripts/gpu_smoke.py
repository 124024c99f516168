"""GPU smoke and measurements for the lent H200 (see scripts/gpu_check.sh): pools on CUDA,
the NCCL broadcast channel with one rank, and KV fetched GPU to GPU between processes."""

from __future__ import annotations

import asyncio
import datetime
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import DSAKVPool, OwnerBroadcaster, tiny  # noqa: E402
from pdkv.synthetic import RequestContent, token_locations  # noqa: E402
from transfer.router import Deployment, DeploymentSpec  # noqa: E402


def step(name):
    def wrap(fn):
        def run(*a):
            t0 = time.perf_counter()
            try:
                out = fn(*a)
                print(f"[ok]   {name} ({time.perf_counter() - t0:.1f}s) {out or ''}", flush=True)
            except Exception:
                print(f"[FAIL] {name}\n{traceback.format_exc()}", flush=True)
        return run
    return wrap


@step("cuda pool: write, read back, move, cpu offload")
def pool_on_cuda():
    pool = DSAKVPool(tiny(layer_num=5, size=1024, device="cuda"))
    pages = torch.tensor([9, 3, 20, 4])
    content = RequestContent(7, 15, prefix_seed=3, prefix_tokens=4)
    loc = token_locations(pool.layout, pages, 15)
    for layer in range(5):
        d = content.layer(pool.layout, layer)
        pool.set_kv_buffer(layer, loc, d.kv_rows(pool.layout))
        pool.set_index_k_and_scale(layer, loc, d.index_k, d.index_scale)
    assert content.mismatched_layers(pool, pages) == []
    copy = pool.get_cpu_copy(loc)
    pool.kv_slab.zero_()
    pool.index_slab.zero_()
    pool.load_cpu_copy(copy, loc)
    assert content.mismatched_layers(pool, pages) == []
    return "byte-exact"


@step("NCCL owner broadcast, one rank, side stream, awaited")
def nccl_one_rank():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            bc = OwnerBroadcaster(device="cuda")
            t = torch.arange(1 << 20, device="cuda", dtype=torch.int32)
            handle = bc.start(t, 0, "smoke")
            asyncio.run(handle.wait_async())
            assert handle.done() and int(t[-1]) == (1 << 20) - 1
        finally:
            dist.destroy_process_group()
    return "landed"


async def deployment(preset, engines, sizes, pool):
    spec = DeploymentSpec(engines=engines, decoders=1, preset=preset, device="cuda", prefill_pool_tokens=pool,
                          decode_pool_tokens=pool, start_timeout=240)
    async with Deployment(spec) as d:
        outs = [await d.submit(n) for n in sizes]
    bad = [o.error for o in outs if not o.ok]
    assert not bad, bad[:2]
    nbytes = sum(o.decode.nbytes for o in outs)
    busy = sum(o.decode.read_seconds for o in outs)
    return f"{len(outs)} requests verified, UCX READ {nbytes / busy / 1e9:.1f} GB/s while reading"


@step("GPU->GPU fetch between processes, tiny, CP=1")
def fetch_tiny():
    return asyncio.run(deployment("tiny", (1,), [17, 200, 999], 8192))


@step("GPU->GPU fetch between processes, DSA, CP=1, 8k and 32k")
def fetch_dsa():
    return asyncio.run(deployment("dsa_v32", (1,), [8192, 8192, 32768, 32768], 65536))


@step("GPU->GPU fetch, DSA, CP=2 on the one GPU (NCCL group of two ranks on one device)")
def fetch_cp2():
    return asyncio.run(deployment("tiny", (2,), [100], 4096))


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    print({k: v for k, v in os.environ.items() if k.startswith(("UCX", "NCCL"))}, flush=True)
    pool_on_cuda()
    nccl_one_rank()
    fetch_tiny()
    fetch_dsa()
    fetch_cp2()
