"""How a READ is cut into posts (transfer.lanes.ucx.worker.bounded): every byte once, paired as in the
plan, no post over the bound. Pure: no UCX."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.lanes.ucx.worker import bounded as _bounded


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """The byte ranges `rows` cover, adjacent rows merged."""
    out: list[tuple[int, int]] = []
    for addr, length, _ in rows.tolist():
        if out and out[-1][1] == addr:
            out[-1] = (out[-1][0], addr + length)
        else:
            out.append((addr, addr + length))
    return out


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 10**6), min_size=1, max_size=60),
    limit=st.integers(4096, 5 * 10**6),  # rows split into at most ~500 pieces: the test stays quick
    seed=st.integers(0, 2**32 - 1),
)
def test_parts_cover_the_plan_once_and_stay_under_the_bound(lengths, limit, seed):
    rng = np.random.default_rng(seed)
    n = len(lengths)
    local = np.stack([rng.integers(0, 1 << 40, n), lengths, np.zeros(n, np.int64)], 1).astype(np.int64)
    remote = np.stack([rng.integers(0, 1 << 40, n), lengths, np.zeros(n, np.int64)], 1).astype(np.int64)
    parts = _bounded(local, remote, limit)
    assert all(len(p) and int(p[:, 1].sum()) <= limit for p, _ in parts)
    out_local = np.concatenate([p for p, _ in parts])
    out_remote = np.concatenate([q for _, q in parts])
    assert np.array_equal(out_local[:, 1], out_remote[:, 1])
    assert _runs(out_local) == _runs(local) and _runs(out_remote) == _runs(remote)
    # Each piece keeps its row's pairing: the same offset between local and remote.
    diffs = set((local[:, 0] - remote[:, 0]).tolist())
    assert set((out_local[:, 0] - out_remote[:, 0]).tolist()) <= diffs


def test_a_plan_under_the_bound_is_one_post():
    rows = np.array([[0, 100, 0], [500, 100, 0]], dtype=np.int64)
    assert len(_bounded(rows, rows + [1000, 0, 0], 1000)) == 1


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=400),
    limit=st.integers(4096, 10**6),
    max_rows=st.integers(1, 64),
    seed=st.integers(0, 2**32 - 1),
)
def test_parts_of_small_rows_are_bounded_by_their_count_too(lengths, limit, max_rows, seed):
    """Posting costs per descriptor: a part holds at most `max_rows` rows as well as `limit`
    bytes (one-token pages made parts of ~40,000 descriptors), every byte still once, in order."""
    rng = np.random.default_rng(seed)
    n = len(lengths)
    local = np.stack([rng.integers(0, 1 << 40, n), lengths, np.zeros(n, np.int64)], 1).astype(np.int64)
    remote = local + np.array([1 << 41, 0, 0], dtype=np.int64)
    parts = _bounded(local, remote, limit, max_rows)
    assert all(0 < len(p) <= max_rows and int(p[:, 1].sum()) <= limit for p, _ in parts)
    assert _runs(np.concatenate([p for p, _ in parts])) == _runs(local)
    assert np.array_equal(
        np.concatenate([q for _, q in parts]) - [1 << 41, 0, 0], np.concatenate([p for p, _ in parts])
    )
