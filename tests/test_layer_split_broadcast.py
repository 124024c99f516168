import pytest
import torch

from tests.distributed import run_group
from tests.pool_workers import owner_broadcast_reads


@pytest.mark.parametrize("world,layers", [(2, 7), (3, 7), (4, 10), (3, 2)])
def test_every_rank_reads_every_layer_byte_exact(world, layers):
    out = run_group(owner_broadcast_reads, world, layers)
    assert sorted(v["owned"] for v in out.values()) == sorted(
        [len(range(*__import__("pdkv").get_layer_shard_range(r, world, layers))) for r in range(world)]
    )
    # Every rank ran the same collectives: the broadcast counts agree.
    assert len({v["kv_broadcasts"] for v in out.values()}) == 1


def test_the_demo_prefill_broadcasts_over_nccl_only_with_a_gpu_per_rank(monkeypatch):
    from transfer.app.prefill_worker import broadcast_backend

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert broadcast_backend("cuda:0", 4) == "gloo"  # four ranks on one GPU: NCCL refuses
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert broadcast_backend(torch.device("cuda:0"), 4) == "nccl"
    assert broadcast_backend(torch.device("cpu"), 4) == "gloo"
