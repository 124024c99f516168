"""Aborts through pdkv's SGLang classes, against the real `sglang` 0.5.23 package: no byte
lands after an outcome is reported, and each side hears of the other's abort.

SGLang frees a decode request's pages as soon as its receiver's `poll()` says Failed (and
reuses them for the next request), so the receiver may say so only once every READ of its
fetch has ended. The test writes a sentinel over every destination page the moment Failed
is seen, waits, and checks that not one byte changed: on a room of DeepSeek-V3.2's shape
(61 layers of latent and indexer, one-token pages) large enough that the abort lands while
its READs are in flight. The prefill runs in a process of its own, as SGLang's does.

`PDKV_TEST_DEVICE=cuda` (on a GPU machine) puts every buffer on the GPU: the decode then
reads the prefill's per-layer tensors through the same-host GPU lane.
"""

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from tests import children
from tests.sglang_fixtures import _own_environment, bootstrap, sglang_conn  # noqa: F401  (fixtures)

conn = sglang_conn()

LAYERS, PAGES = 61, 8192
ROOM_PAGES = 8000  # 61 x 8,000 x 788 bytes: a 384 MB room
KV_ITEM, INDEX_ITEM = 656, 132  # one-token pages of DeepSeek-V3.2's fp8 latent and indexer
AUX_ITEMS = (32,)
SENTINEL = 0xA5
SETTLE_S = 2.0  # how long the pages are watched after the outcome
DEVICE = os.environ.get("PDKV_TEST_DEVICE", "cpu")


def _src_pages() -> np.ndarray:
    return np.arange(ROOM_PAGES, dtype=np.int64)


def _dst_pages(seed: int) -> np.ndarray:
    """The room's pages on the decode: runs of 16 in a shuffled order (a used allocator;
    short runs make many descriptors, so the READs take long enough to abort them)."""
    runs = np.random.default_rng(seed).permutation(PAGES // 16)[: ROOM_PAGES // 16]
    return (runs[:, None] * 16 + np.arange(16)).reshape(-1)


def _fill(t: torch.Tensor, layer: int, kind: int) -> None:
    rows = np.random.default_rng(1000 * kind + layer).integers(0, 256, tuple(t.shape), np.uint8)
    t.copy_(torch.from_numpy(rows).to(t.device))


def _kv_args(fill: bool) -> tuple[object, list[torch.Tensor]]:
    """SGLang's KVArgs over one tensor per layer and kind, as its DSA pools allocate them."""
    kv = [torch.zeros((PAGES, KV_ITEM), dtype=torch.uint8, device=DEVICE) for _ in range(LAYERS)]
    index = [torch.zeros((PAGES, INDEX_ITEM), dtype=torch.uint8, device=DEVICE) for _ in range(LAYERS)]
    if fill:
        for layer in range(LAYERS):
            _fill(kv[layer], layer, 0)
            _fill(index[layer], layer, 1)
    aux = [torch.zeros((4, n), dtype=torch.uint8) for n in AUX_ITEMS]
    args = conn.KVArgs()
    args.engine_rank, args.gpu_id, args.system_dp_rank, args.pp_rank = 0, 0, 0, 0
    args.page_size, args.num_draft_entries = 1, 0
    args.prefill_start_layer, args.prefill_end_layer = 0, LAYERS
    args.kv_layer_ids = list(range(LAYERS))
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.nbytes for t in kv]
    args.kv_item_lens = [KV_ITEM] * LAYERS
    args.state_types = [conn.StateType.DSA]
    args.state_layer_ids = [list(range(LAYERS))]
    args.state_data_ptrs = [[t.data_ptr() for t in index]]
    args.state_data_lens = [[t.nbytes for t in index]]
    args.state_item_lens = [[INDEX_ITEM] * LAYERS]
    args.aux_data_ptrs = [t.data_ptr() for t in aux]
    args.aux_data_lens = [t.nbytes for t in aux]
    args.aux_item_lens = list(AUX_ITEMS)
    return args, kv + index + aux


def _env(registry: str) -> None:
    from transfer.sglang.topology import environment

    os.environ.update(environment(registry, 0, 1, LAYERS, DEVICE))


def _prefill(registry: str, rooms: list[int], aborts: mp.Queue, results: mp.Queue) -> None:
    """The prefill's scheduler: each room sent whole, as one chunk; a room named on
    `aborts` while it is live is aborted by the prefill."""
    import queue

    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVManager, PdkvKVSender

    _env(registry)
    args, keep = _kv_args(fill=True)
    mgr = PdkvKVManager(args, "prefill", server_args=None, is_mla_backend=True)
    assert mgr.exporter is not None
    try:
        results.put(("ready", 0, None, None, 0))
        for room in rooms:
            sender = PdkvKVSender(mgr, registry, room)
            sender.init(ROOM_PAGES, aux_index=0)
            sender.should_send_kv_chunk(ROOM_PAGES, True)
            sender.send(_src_pages().astype(np.int32))
            while sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                try:
                    if aborts.get_nowait() == room:
                        sender.abort()
                except queue.Empty:
                    time.sleep(0.0005)
            error, failed_at = None, time.monotonic()
            if sender.poll() == KVPoll.Failed:
                try:
                    sender.failure_exception()
                except Exception as exc:
                    error = type(exc).__name__
            pinned = mgr.exporter.exporter.rooms.pinned_pages
            results.put((room, sender.poll(), error, failed_at, pinned))
    finally:
        mgr.close()


class _Decode:
    """The decode's scheduler side: a manager over SGLang-shaped per-layer buffers."""

    def __init__(self, registry: str) -> None:
        from transfer.sglang.conn import PdkvKVManager

        _env("")
        self.registry = registry
        self.args, self.keep = _kv_args(fill=False)
        self.mgr = PdkvKVManager(self.args, "decode", server_args=None, is_mla_backend=True)
        self.dst = {}

    def receiver(self, room: int, seed: int):
        from sglang.srt.disaggregation.base.conn import KVPoll

        from transfer.sglang.conn import PdkvKVReceiver

        r = PdkvKVReceiver(self.mgr, self.registry.removeprefix("http://"), room)
        r.init(0)
        end = time.monotonic() + 60
        while r.poll() == KVPoll.Bootstrapping and time.monotonic() < end:
            time.sleep(0.002)
        self.dst[room] = _dst_pages(seed)
        r.send_metadata(self.dst[room].astype(np.int32), aux_index=1)
        return r

    def _rows(self, room: int, step: int = 1) -> torch.Tensor:
        return torch.as_tensor(self.dst[room][::step], device=DEVICE)

    def landed(self, room: int) -> bool:
        """Whether any byte of `room` has landed yet (a sample of its pages in a few layers)."""
        rows = self._rows(room, 97)
        return any(bool(self.keep[layer][rows].any()) for layer in (0, 30, 60))

    def overwrite(self, room: int) -> None:
        """What SGLang does once the receiver failed: the pages go to another request."""
        rows = self._rows(room)
        for t in self.keep[: 2 * LAYERS]:
            t[rows] = SENTINEL
        if DEVICE != "cpu":
            torch.cuda.synchronize()

    def changed(self, room: int) -> int:
        rows = self._rows(room)
        return sum(int((t[rows] != SENTINEL).sum()) for t in self.keep[: 2 * LAYERS])

    def matches(self, room: int) -> bool:
        src, rows = torch.as_tensor(_src_pages(), device=DEVICE), self._rows(room)
        for layer in range(LAYERS):
            for kind in (0, 1):
                want = torch.zeros((PAGES, (KV_ITEM, INDEX_ITEM)[kind]), dtype=torch.uint8, device=DEVICE)
                _fill(want, layer, kind)
                if not torch.equal(self.keep[kind * LAYERS + layer][rows], want[src]):
                    return False
        return True

    def clear(self) -> None:
        for t in self.keep[: 2 * LAYERS]:
            t.zero_()

    def close(self) -> None:
        self.mgr.close()


def _until_final(receiver, limit: float = 60.0):
    from sglang.srt.disaggregation.base.conn import KVPoll

    end = time.monotonic() + limit
    while time.monotonic() < end:
        state = receiver.poll()
        if state in (KVPoll.Success, KVPoll.Failed):
            return state
        time.sleep(0.0005)
    raise AssertionError("the receiver never finished")


def _start_prefill(bootstrap, rooms):  # noqa: F811
    ctx = children.context()
    aborts, results = ctx.Queue(), ctx.Queue()
    prefill = ctx.Process(target=_prefill, args=(bootstrap.url, rooms, aborts, results))
    prefill.start()
    assert results.get(timeout=120)[0] == "ready"
    return prefill, aborts, results


def test_a_decode_abort_lands_no_byte_after_failed_and_frees_the_prefill(bootstrap):  # noqa: F811
    """The receiver is aborted while its READs are in flight: no byte lands after `poll()`
    says Failed, the prefill's sender fails with `RoomAbortedError` long before its pin
    would expire (its pages freed), and the next room on the same decode arrives whole."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdkv.errors import RoomAbortedError
    from transfer.sync import HandleStatus

    prefill, _, results = _start_prefill(bootstrap, [701, 702])
    decode = _Decode(bootstrap.url)
    try:
        receiver = decode.receiver(701, seed=1)
        end = time.monotonic() + 30
        while not decode.landed(701) and time.monotonic() < end:
            time.sleep(0.0002)
        aborted_at = time.monotonic()
        read_first = receiver._parts[0].fetch.poll() is HandleStatus.DONE  # a GPU lane may finish first
        receiver.abort()
        assert _until_final(receiver) == KVPoll.Failed
        decode.overwrite(701)
        time.sleep(SETTLE_S)
        assert decode.changed(701) == 0  # not one late byte in pages SGLang has reused
        with pytest.raises(RoomAbortedError):
            receiver.failure_exception()

        room, state, error, failed_at, pinned = results.get(timeout=60)
        if read_first:  # the room was read and released before the abort: the prefill is done
            assert (room, state, error, pinned) == (701, KVPoll.Success, None, 0)
        else:
            assert (room, state, error, pinned) == (701, KVPoll.Failed, "RoomAbortedError", 0)
            assert failed_at - aborted_at < 10  # told, not the 120 s pin expiring

        decode.clear()
        receiver = decode.receiver(702, seed=2)
        assert _until_final(receiver) == KVPoll.Success
        assert decode.matches(702)
        lane = {"cpu": "ucx", "cuda": "cuda_ipc"}[DEVICE]  # on a GPU: per-layer tensors by the lane
        assert {o.lane for o in receiver._parts[0].fetch.result().owners} == {lane}
        assert results.get(timeout=60)[:3] == (702, KVPoll.Success, None)
    finally:
        decode.close()
        prefill.join(30)
        if prefill.is_alive():
            prefill.kill()


def test_a_prefill_abort_stops_the_decode_with_its_own_error_and_no_late_byte(bootstrap):  # noqa: F811
    """The prefill aborts a room while the decode reads it: the decode fails with
    `RoomAbortedError` (not a lost peer), and nothing lands after it says so. A room whose
    READs all ended before the abort reached the prefill is read whole; the next is tried."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdkv.errors import RoomAbortedError

    tries = [801, 802, 803]
    prefill, aborts, results = _start_prefill(bootstrap, [*tries, 804])
    decode = _Decode(bootstrap.url)
    try:
        aborted_mid_read = 0
        for room in tries:
            decode.clear()
            receiver = decode.receiver(room, seed=room)
            end = time.monotonic() + 30
            while not decode.landed(room) and time.monotonic() < end:
                time.sleep(0.0002)
            aborts.put(room)
            outcome = _until_final(receiver)
            sent = results.get(timeout=60)
            if outcome == KVPoll.Success:  # every READ ended first: the room is whole
                assert decode.matches(room) and sent[:3] == (room, KVPoll.Success, None)
                continue
            decode.overwrite(room)
            time.sleep(SETTLE_S)
            assert decode.changed(room) == 0
            with pytest.raises(RoomAbortedError):
                receiver.failure_exception()
            assert sent[:3] == (room, KVPoll.Failed, "RoomAbortedError")
            aborted_mid_read += 1
            break
        for untried in tries[tries.index(room) + 1 :]:
            aborts.put(untried)  # the rooms not tried end aborted
            results.get(timeout=60)

        decode.clear()
        receiver = decode.receiver(804, seed=4)
        assert _until_final(receiver) == KVPoll.Success
        assert decode.matches(804)
        if DEVICE != "cpu" and not aborted_mid_read:  # the lane reads a room in about a millisecond
            pytest.skip("every room was read whole before its abort reached the prefill")
        assert aborted_mid_read == 1, "no abort reached the prefill while the decode read"
    finally:
        decode.close()
        prefill.join(30)
        if prefill.is_alive():
            prefill.kill()
