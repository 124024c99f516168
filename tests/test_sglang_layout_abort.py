"""A decode of the wrong layout, and a prefill's abort mid-read, through pdkv's SGLang
classes against the real `sglang` 0.5.23 package (issue 39, items 3 and 4).

* A decode whose KV layout differs from the prefill's learns so at bootstrap, from the
  layouts in the registry, before it claims anything: its receiver fails with
  `IncompatibleLayoutError`, and it gives the room up on every owner (in the owner's own
  envelope: its layout is not ours), so the prefill's sender fails at once instead of
  holding its pages until their pin expires.
* A prefill's `abort()` while its decode reads reaches the receiver as Failed within the
  bound `docs/protocol.md` states, and no byte lands after Failed.

The prefill runs in processes of its own, as SGLang's does; the harnesses are those of
`test_sglang` (a small layer-split room) and `test_sglang_aborts` (a room of DeepSeek-V3.2's
shape, large enough that the abort lands while its READs are in flight).
"""

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang.srt.disaggregation.base.conn  # noqa: F401
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")

from tests import test_sglang as small  # noqa: E402
from tests.test_sglang import _own_environment, bootstrap  # noqa: E402,F401  (fixtures)

TOLD_WITHIN_S = 1.0  # a prefill hears of a decode that cannot read its room within this
ABORT_BOUND_S = 0.1  # docs/protocol.md: a prefill's abort reaches its decode's receiver within this


def _start_small_prefill(url: str, rooms: dict, cp_size: int = 2) -> tuple[list, mp.Queue]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=small._prefill_rank, args=(url, r, cp_size, rooms, results)) for r in range(cp_size)]
    for p in ranks:
        p.start()
    return ranks, results


def _stop(processes: list) -> None:
    for p in processes:
        p.join(30)
        if p.is_alive():
            p.kill()


def _bootstrap_until_final(receiver, limit: float = 60.0) -> int:  # type: ignore[no-untyped-def]
    """Poll a receiver as SGLang's prealloc queue does until it leaves Bootstrapping."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    end = time.monotonic() + limit
    while time.monotonic() < end:
        state = receiver.poll()
        if state != KVPoll.Bootstrapping:
            return state
        time.sleep(0.002)
    raise AssertionError("the receiver never left Bootstrapping")


def test_a_decode_of_another_layout_fails_at_bootstrap_and_frees_the_prefills_room(bootstrap):  # noqa: F811
    """A decode with half the prefill's page size (its own pool is sound; the two differ):
    its receiver fails at bootstrap with `IncompatibleLayoutError`, never claiming, and both
    CP ranks' senders fail within a second (not at the pin's expiry), whether the room was
    published before the decode gave it up (601) or after (602, published only once 601
    ended). Not a byte of the decode's pages moved; then a decode of the right layout reads
    the next room (603) whole, aux row too."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdkv.errors import IncompatibleLayoutError
    from transfer.sglang.conn import PdkvKVManager, PdkvKVReceiver
    from transfer.sync import FetchStatus

    rooms = {601: ([[3, 4, 5], [9, 20]], False), 602: ([[1, 2]], False), 603: ([[7, 8, 10], [11]], False)}
    ranks, results = _start_small_prefill(bootstrap.url, rooms)
    small._env("", 0, 1)
    wrong_args, wrong_keep = small._kv_args(range(small.LAYERS), fill=False)
    wrong_args.page_size = small.PAGE // 2  # the same bytes seen as pages of 8 tokens
    wrong = PdkvKVManager(wrong_args, "decode", server_args=None, is_mla_backend=True)
    right_args, right_keep = small._kv_args(range(small.LAYERS), fill=False)
    right = PdkvKVManager(right_args, "decode", server_args=None, is_mla_backend=True)
    try:
        receivers = {room: PdkvKVReceiver(wrong, bootstrap.url, room) for room in (601, 602)}
        failed_at = {}
        for receiver in receivers.values():
            receiver.init(0)
        for room, receiver in receivers.items():
            assert _bootstrap_until_final(receiver) == KVPoll.Failed
            failed_at[room] = time.monotonic()
            with pytest.raises(IncompatibleLayoutError, match="page_size"):
                receiver.failure_exception()
            claim = receiver._parts[0].claim
            assert claim is not None and claim.poll() is FetchStatus.FAILED  # refused before a claim was granted
            assert receiver._parts[0].fetch is None
            receiver.send_metadata(np.array([1, 2, 3], dtype=np.int32), aux_index=1)  # SGLang may still call it
            assert receiver.poll() == KVPoll.Failed
        for room in (601, 602):
            told = [results.get(timeout=30) for _ in ranks]
            heard = time.monotonic()
            assert {(r, seen[-1]) for _, r, seen, _, _ in told} == {(room, KVPoll.Failed)}, told
            assert {error for *_, error in told} <= {"RoomAbortedError", "ConflictError"}, told
            assert heard - failed_at[room] < TOLD_WITHIN_S
        assert all(not t.any() for t in wrong_keep)  # nothing landed in the wrong decode's buffers

        dst = [30, 1, 2, 29]
        receiver, state = small._receive(right, bootstrap.url, 603, dst, aux_index=603 % small.AUX_ROWS)
        assert state == KVPoll.Success, state
        src = sum(rooms[603][0], [])
        kv, index = right_keep[: small.LAYERS], right_keep[small.LAYERS : 2 * small.LAYERS]
        for layer in range(small.LAYERS):
            assert np.array_equal(kv[layer].numpy()[dst], small._pattern(layer, 0)[src]), layer
            assert np.array_equal(index[layer].numpy()[dst], small._pattern(layer, 1)[src]), layer
        got = b"".join(t[603 % small.AUX_ROWS].numpy().tobytes() for t in right_keep[2 * small.LAYERS :])
        assert got == small._aux_row(603)
        sent = [results.get(timeout=60) for _ in ranks]
        assert {(r, seen[-1]) for _, r, seen, _, _ in sent} == {(603, KVPoll.Success)}, sent
    finally:
        wrong.close()
        right.close()
        _stop(ranks)
