import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv import LayoutError, PageRangeError, ShardPlan, get_layer_owner, get_layer_shard_range


def test_reference_plan_for_61_layers_over_4_ranks():
    assert [get_layer_shard_range(r, 4, 61) for r in range(4)] == [(0, 16), (16, 31), (31, 46), (46, 61)]


@given(st.integers(1, 128), st.integers(1, 16))
def test_every_layer_owned_once_contiguous_balanced(layers, n):
    ranges = [get_layer_shard_range(r, n, layers) for r in range(n)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end == start
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 1
    for r, (s, e) in enumerate(ranges):
        for layer in range(s, e):
            assert get_layer_owner(layer, n, layers) == r


@given(st.integers(1, 128), st.integers(1, 16), st.integers(0, 50))
def test_plan_speaks_global_layer_ids(layers, n, start):
    plans = [ShardPlan(r, n, layers, start) for r in range(n)]
    owned = [layer for p in plans for layer in p.owned]
    assert owned == list(range(start, start + layers))
    for p in plans:
        for layer in p.owned:
            assert p.owns(layer) and p.owner_of(layer) == p.rank


def test_bad_arguments_raise_typed_errors():
    with pytest.raises(LayoutError):
        get_layer_shard_range(4, 4, 10)
    with pytest.raises(LayoutError):
        get_layer_shard_range(0, 0, 10)
    with pytest.raises(PageRangeError):
        get_layer_owner(10, 4, 10)
    with pytest.raises(PageRangeError):
        get_layer_owner(-1, 4, 10)
