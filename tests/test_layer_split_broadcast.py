import pytest

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
