import pytest
import torch

from tests.distributed import run_group
from tests.pool_workers import owner_broadcast_reads


@pytest.mark.parametrize(
    "world,layers,dsa", [(2, 7, False), (3, 7, False), (4, 10, False), (3, 2, False), (3, 5, True)]
)
def test_every_rank_reads_every_layer_byte_exact(world, layers, dsa):
    """`dsa`: float8 latent reads, each kind also read alone (a read with no prefetch)."""
    out = run_group(owner_broadcast_reads, world, layers, "cpu", None, dsa)
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


def test_the_nccl_config_is_the_prefix_nccl_2_17_defined():
    """NCCL copies `size` bytes of the config and reads no field newer than `version`: the
    offsets must be C's, or maxCTAs would land in another field."""
    import ctypes

    from pdkv.nccl import _Config, config

    offsets = {name: getattr(_Config, name).offset for name, _ in _Config._fields_}
    assert offsets == {
        "size": 0, "magic": 8, "version": 12, "blocking": 16,
        "cgaClusterSize": 20, "minCTAs": 24, "maxCTAs": 28, "netName": 32,
    }  # fmt: skip
    cfg = config(4)
    assert (cfg.size, cfg.magic, cfg.version) == (ctypes.sizeof(_Config), 0xCAFEBEEF, 21700) and cfg.size == 40
    assert (cfg.blocking, cfg.maxCTAs, config(None).maxCTAs) == (1, 4, -(2**31))
