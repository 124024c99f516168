"""GPU paths, run where CUDA is present (scripts/gpu_check.sh on the lent H200); skipped in CI.

The pool tests in test_pool.py also run on CUDA there (their `device` parameter)."""

import asyncio
import datetime

import pytest
import torch
import torch.distributed as dist

from pdkv import OwnerBroadcaster, tiny
from transfer.router import Deployment, DeploymentSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_nccl_owner_broadcast_one_rank_side_stream_awaited(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/init", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        bc = OwnerBroadcaster(device="cuda")
        t = torch.arange(1 << 20, device="cuda", dtype=torch.int32)
        compute = torch.cuda.current_stream()
        t.mul_(3)  # queued on the compute stream: the broadcast must be ordered after it
        handle = bc.start(t, 0, "gpu test")
        asyncio.run(handle.wait_async())  # awaited without blocking; then ordered on compute
        compute.synchronize()
        assert handle.done() and int(t[-1]) == 3 * ((1 << 20) - 1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("engines", [(1,), (2,)])
def test_gpu_to_gpu_fetch_between_processes_byte_exact(engines):
    async def run():
        spec = DeploymentSpec(engines=engines, decoders=1, preset="tiny", device="cuda",
                              prefill_pool_tokens=8192, decode_pool_tokens=8192, start_timeout=240)
        async with Deployment(spec) as d:
            return [await d.submit(n) for n in (1, 37, 500, 2000)]

    outs = asyncio.run(run())
    assert [o.error for o in outs if not o.ok] == []
    layout = tiny()
    for o in outs:
        assert o.decode.verified_bytes == o.num_tokens * 7 * (layout.kv_token_bytes + layout.index_token_bytes)


def test_layer_split_reads_on_cuda_through_gloo_ranks_sharing_the_gpu():
    # NCCL wants one rank per device; ranks sharing one GPU broadcast CUDA tensors over gloo.
    from tests.distributed import run_group
    from tests.pool_workers import owner_broadcast_reads

    out = run_group(owner_broadcast_reads, 2, 7, "cuda", "gloo")
    assert len({v["kv_broadcasts"] for v in out.values()}) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layers", [7, 10])
def test_nccl_owner_broadcast_across_gpus_every_byte_on_every_rank(layers):
    from tests.distributed import run_group
    from tests.pool_workers import owner_broadcast_reads

    world = torch.cuda.device_count()
    out = run_group(owner_broadcast_reads, world, layers, "cuda:rank", "nccl")
    assert len({v["kv_broadcasts"] for v in out.values()}) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_decode_assembles_from_owners_on_other_gpus():
    async def run():
        spec = DeploymentSpec(engines=(torch.cuda.device_count(),), decoders=1, preset="tiny", device="cuda",
                              prefill_pool_tokens=8192, decode_pool_tokens=8192, start_timeout=240)
        async with Deployment(spec) as d:
            return [await d.submit(n, prefix_id=1 if n > 100 else -1, prefix_tokens=64) for n in (1, 37, 500, 2000)]

    outs = asyncio.run(run())
    assert [o.error for o in outs if not o.ok] == []
