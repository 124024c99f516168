import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdkv import PageRangeError
from pdkv.pages import PageAllocator, fragmented_page_order
from transfer.engine import _split
from transfer.plan import BufferPair, ReadPlan, build_read_plan, page_runs


def test_runs_merge_only_where_both_sides_are_consecutive():
    runs = page_runs(np.array([4, 5, 6, 9, 10, 2]), np.array([7, 8, 1, 2, 3, 4]))
    assert runs.src_start.tolist() == [4, 6, 9, 2]
    assert runs.dst_start.tolist() == [7, 1, 2, 4]
    assert runs.length.tolist() == [2, 1, 2, 1]


@given(st.lists(st.integers(0, 63), min_size=1, max_size=64, unique=True), st.randoms())
def test_plan_reads_exactly_the_requested_bytes(src, rnd):
    dst = list(range(64))
    rnd.shuffle(dst)
    dst = dst[: len(src)]
    pairs = [BufferPair(10_000, 1_000_000, 8, 64, 64), BufferPair(90_000, 2_000_000, 3, 64, 64)]
    for merge in (True, False):
        plan = build_read_plan(pairs, np.array(src), np.array(dst), merge=merge)
        # Expand each descriptor back into (remote byte, local byte) pairs: must be exactly
        # item_len bytes of page src[i] going to page dst[i], for every page and buffer.
        got = set()
        for (la, ln, _), (ra, rn, _) in zip(plan.local, plan.remote):
            assert ln == rn
            got.update(zip(range(ra, ra + rn), range(la, la + ln)))
        want = {
            (b.remote_addr + s * b.item_len + k, b.local_addr + d * b.item_len + k)
            for b in pairs for s, d in zip(src, dst) for k in range(b.item_len)
        }
        assert got == want
        assert plan.nbytes == len(src) * (8 + 3)
    assert build_read_plan(pairs, np.array(src), np.array(dst)).descriptors <= 2 * len(src)


def test_pages_out_of_range_refused_before_any_descriptor():
    pairs = [BufferPair(0, 0, 8, 16, 32)]
    with pytest.raises(PageRangeError, match="destination"):
        build_read_plan(pairs, np.array([1, 2]), np.array([3, 16]))
    with pytest.raises(PageRangeError, match="source"):
        build_read_plan(pairs, np.array([-1, 2]), np.array([3, 4]))
    with pytest.raises(PageRangeError):
        build_read_plan(pairs, np.array([1, 2]), np.array([3]))


def test_fragmented_order_is_a_permutation_with_short_runs():
    pages = np.arange(1, 10_001)
    order = fragmented_page_order(pages, np.random.default_rng(0))
    assert sorted(order.tolist()) == pages.tolist()
    runs = page_runs(order, order)
    assert 3.0 < len(order) / len(runs) < 5.0  # geometric runs, mean about 4


def test_allocator_reuses_freed_pages_and_refuses_double_free():
    alloc = PageAllocator(9)
    a = alloc.alloc(8)
    assert 0 not in a.tolist() and alloc.free_count == 0
    alloc.free(a[:3])
    assert sorted(alloc.alloc(3).tolist()) == sorted(a[:3].tolist())
    alloc.free(a[3:4])
    with pytest.raises(PageRangeError):
        alloc.free(a[3:4])


@given(st.lists(st.integers(1, 1 << 22), min_size=1, max_size=3000), st.integers(1, 8))
def test_a_split_read_covers_the_plan_once_in_order(lengths, pieces):
    n = len(lengths)
    local = np.stack([np.arange(n) * (1 << 23), lengths, np.zeros(n, np.int64)], axis=1)
    plan = ReadPlan(local, local + [1 << 40, 0, 0], int(sum(lengths)))
    parts = _split(plan, pieces)
    assert 1 <= len(parts) <= pieces and all(len(a) > 0 for a, _ in parts)
    assert np.array_equal(np.concatenate([a for a, _ in parts]), plan.local)
    assert np.array_equal(np.concatenate([b for _, b in parts]), plan.remote)
    if n < 512 and plan.nbytes < 8 << 20:
        assert len(parts) == 1  # too small to be worth another lane
