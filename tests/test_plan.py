import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdkv import PageRangeError
from pdkv.pages import PageAllocator, bounded_ids, page_ids
from transfer.app.synthetic import fragmented_page_order
from transfer.lanes.cuda_ipc.plan import (
    build_gather_plan,
    gather_plan,
    gather_table,
    merge_gather_tables,
    route_pages,
)
from transfer.lanes.runs import BufferPair, page_runs
from transfer.lanes.ucx.plan import ReadPlan, build_read_plan
from transfer.lanes.ucx.worker import split as _split


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
            for b in pairs
            for s, d in zip(src, dst)
            for k in range(b.item_len)
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


# ---- gather plans: the same-host GPU lane's launches, checked on the host -----------------------


def _pair(local, remote, item=64, items=10):
    return BufferPair(local, remote, item, items, items)


def test_gather_plan_table_and_widest_word():
    plan = build_gather_plan([_pair(4096, 8192), _pair(1 << 20, 1 << 21, item=24)], np.array([3, 1]), np.array([0, 9]))
    assert plan.table.table.tolist() == [[8192, 1 << 21], [4096, 1 << 20], [64, 24], [0, 0]]
    assert plan.src_pages.tolist() == [[3, 1]]
    assert plan.word == 8 and plan.pages == 2 and plan.nbytes == (64 + 24) * 2
    odd = build_gather_plan([_pair(4098, 8192)], np.array([1]), np.array([2]))
    assert odd.word == 2  # an address only 2-aligned: loads of 2 bytes


def test_gather_plan_refuses_pages_outside_either_side():
    with pytest.raises(PageRangeError, match="source"):
        build_gather_plan([_pair(0, 0, items=4)], np.array([4]), np.array([0]))
    with pytest.raises(PageRangeError, match="destination"):
        build_gather_plan([BufferPair(0, 0, 64, 3, 10)], np.array([0]), np.array([3]))
    with pytest.raises(PageRangeError):
        build_gather_plan([_pair(0, 0)], np.array([-1]), np.array([0]))


def test_gather_plan_trusts_a_destination_bound_only_within_its_table():
    table = gather_table([BufferPair(0, 0, 64, 3, 10)])  # the destination holds 3 items
    # Ids a fetch's `page_ids` bounded by 3 or fewer pages are not checked again...
    assert gather_plan(table, [np.array([9])], np.array([2]), dst_below=3).dst_pages.tolist() == [2]
    # ...but a bound past the table's items proves nothing, and the source is always checked.
    with pytest.raises(PageRangeError, match="destination"):
        gather_plan(table, [np.array([0])], np.array([3]), dst_below=4)
    with pytest.raises(PageRangeError, match="source"):
        gather_plan(table, [np.array([10])], np.array([0]), dst_below=3)


def test_route_pages_check_as_a_plan_does_and_go_to_the_kernel_as_int64_ids():
    """A route's read builds no plan: its ids are checked the same way, in one reduction a
    side, and handed on as they are."""
    table = merge_gather_tables([gather_table([BufferPair(0, 0, 64, 3, 10)])] * 2, True)
    src, dst = route_pages(table, np.array([9, 0], np.int32), np.array([2, 1]), dst_below=3)
    assert src.dtype == dst.dtype == np.int64 and src.tolist() == [9, 0] and dst.tolist() == [2, 1]
    with pytest.raises(PageRangeError, match="source"):
        route_pages(table, np.array([10]), np.array([0]), dst_below=3)
    with pytest.raises(PageRangeError, match="source"):
        route_pages(table, np.array([-1]), np.array([0]), dst_below=3)
    with pytest.raises(PageRangeError, match="destination"):
        route_pages(table, np.array([0]), np.array([3]), dst_below=4)  # a bound past the table proves nothing
    with pytest.raises(PageRangeError):
        route_pages(table, np.array([0, 1]), np.array([0]), dst_below=3)
    assert route_pages(gather_table([]), np.array([5]), np.array([7]), dst_below=3)[0].tolist() == [5]


@pytest.mark.parametrize("given", [np.array([4, 1, 2]), torch.tensor([4, 1, 2]), [4, 1, 2]])
def test_page_ids_are_a_copy_the_caller_cannot_change_after_the_check(given):
    ids = page_ids(given, 5)
    given[0] = 99  # out of range: a plan that trusts the bound must never see it
    assert ids.tolist() == [4, 1, 2]


def test_bounded_ids_bound_an_integer_arrays_ids_and_leave_every_other_form_to_page_ids():
    given = np.array([4, 1, 4], dtype=np.int32)  # a repeat is `page_ids`' to refuse, not this check's
    ids = bounded_ids(given, 5)
    assert ids is not None and ids.dtype == np.int64 and ids.tolist() == [4, 1, 4]
    given[0] = 99  # a launch that trusts the bound must never see it
    assert ids.tolist() == [4, 1, 4]
    for bad in (np.array([5]), np.array([-1]), np.array([2**63], dtype=np.uint64)):
        with pytest.raises(PageRangeError):
            bounded_ids(bad, 5)
    masked = np.ma.array([3, 10**9], mask=[False, True])  # a reduction would skip the masked id
    for other in ([1, 2], np.array([[1, 2]]), np.array([1.0]), np.array([True]), torch.tensor([1.0]), masked):
        assert bounded_ids(other, 5) is None
    tensor = torch.tensor([3, 0], dtype=torch.int32)
    ids = bounded_ids(tensor, 5)
    tensor[0] = 99
    assert ids is not None and ids.tolist() == [3, 0]
    with pytest.raises(PageRangeError):
        bounded_ids(torch.tensor([5]), 5)
    assert bounded_ids(np.array([], dtype=np.int64), 5).size == 0


def test_merged_tables_keep_each_owners_source_pages():
    """Owners of one room in one launch (the lane's merged table): each reads its own
    source pages into the shared destination pages."""
    a = [_pair(0, 4096)]
    b = [_pair(8192, 16384, item=32), _pair(9000 * 8, 20000 * 8)]
    table = merge_gather_tables([gather_table(a), gather_table(b)], shared_pages=False)
    m = gather_plan(table, [np.array([5, 6]), np.array([7, 3])], np.array([1, 2]))
    alone = [build_gather_plan(x, np.array([5, 6]), np.array([1, 2])) for x in (a, b)]
    assert m.src_pages.tolist() == [[5, 6], [7, 3]] and m.table.table[3].tolist() == [0, 1, 1]
    assert m.nbytes == sum(p.nbytes for p in alone) and m.word == 16  # every address and length 16-aligned


def test_owners_with_the_same_source_pages_share_one_list():
    a = gather_table([_pair(0, 4096, items=10)])
    b = gather_table([_pair(8192, 16384, items=7)])
    table = merge_gather_tables([a, b], shared_pages=True)
    m = gather_plan(table, [np.array([5, 6])], np.array([1, 2]))
    assert m.src_pages.tolist() == [[5, 6]] and m.table.table[3].tolist() == [0, 0]
    assert m.table.src_items.tolist() == [7]  # the smallest owner bounds the shared list
    with pytest.raises(PageRangeError, match="source"):
        gather_plan(table, [np.array([5, 7])], np.array([1, 2]))  # page 7 is past the second owner
    with pytest.raises(PageRangeError, match="source pages but"):
        gather_plan(table, [np.array([5])], np.array([1, 2]))


def test_the_kernels_task_table_covers_every_word_of_every_item_once():
    from transfer.lanes.cuda_ipc.gather import _meta

    plan = build_gather_plan(
        [_pair(0, 0, item=41984), _pair(1 << 20, 1 << 21, item=8448)], np.array([2]), np.array([5])
    )
    assert plan.word == 16
    meta, n_tasks = _meta(plan.table, block_words=256)  # 4 KiB blocks of 16-byte words
    tasks = meta[-2 * n_tasks :].reshape(2, n_tasks)
    assert meta.size == 4 * plan.buffers + 2 * n_tasks  # the page ids are not in it: uploaded per launch
    assert meta[2 * plan.buffers : 3 * plan.buffers].tolist() == [41984 // 16, 8448 // 16]  # item words
    for b, words in enumerate((41984 // 16, 8448 // 16)):
        firsts = tasks[1][tasks[0] == b]
        covered = np.concatenate([np.arange(f, min(f + 256, words)) for f in firsts])
        assert sorted(covered.tolist()) == list(range(words))  # no word twice, none missed
    assert n_tasks == 11 + 3  # no task without a word to copy


# ---- owners of an engine: checked and paired without processes -------------------------------
def test_owners_must_share_our_geometry_and_item_sizes():
    from pdkv import DSAKVPool, IncompatibleLayoutError
    from tests.wire_helpers import LAYOUT, rank_descriptor
    from transfer.decode.owners import buffer_pairs, check_owners
    from transfer.metadata import EngineDescriptor

    pool = DSAKVPool(LAYOUT)
    engine = EngineDescriptor("e0", 3, [rank_descriptor(r) for r in range(3)])
    check_owners(engine, pool)
    with pytest.raises(IncompatibleLayoutError, match="item_len"):  # these fakes use 192-byte items
        buffer_pairs(engine.ranks[1], pool)
    with pytest.raises(IncompatibleLayoutError, match="page_size"):
        check_owners(engine, DSAKVPool(LAYOUT.replace(page_size=8, size=256)))
