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
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import numpy as np
import pytest

from tests import children

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang.srt.disaggregation.base.conn  # noqa: F401
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")

from tests import test_sglang as small  # noqa: E402
from tests import test_sglang_aborts as big  # noqa: E402
from tests.test_sglang import _own_environment, bootstrap  # noqa: E402,F401  (fixtures)

TOLD_WITHIN_S = 1.0  # a prefill hears of a decode that cannot read its room within this
ABORT_BOUND_S = 0.1  # docs/protocol.md: a prefill's abort reaches its decode's receiver within this


def _start_small_prefill(url: str, rooms: dict, cp_size: int = 2) -> tuple[list, mp.Queue]:
    ctx = children.context()
    results = ctx.Queue()
    ranks = [ctx.Process(target=small._prefill_rank, args=(url, r, cp_size, rooms, results)) for r in range(cp_size)]
    for p in ranks:
        p.start()
    return ranks, results


def _until_registered(url: str, engine: str = "dp0", limit: float = 120.0) -> None:
    """Wait until every rank of `engine` is in the registry: a spawned prefill takes seconds to
    start on a busy host, longer than a decode's lookup waits (a test of the layout check must
    not fail on that instead)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"{url}/v1/engines/{engine}", timeout=5):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise AssertionError(f"{engine} never registered")


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
    ended). Not a byte of the decode's pages moved. Then a decode of the right layout claims
    the next room (603), one of the wrong layout fails on it without taking it away (its
    give-up is refused: every claim is held), and the first reads it whole, aux row too."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdkv.errors import IncompatibleLayoutError
    from transfer.sglang.conn import PdkvKVManager, PdkvKVReceiver
    from transfer.sync import HandleStatus

    rooms = {601: ([[3, 4, 5], [9, 20]], False), 602: ([[1, 2]], False), 603: ([[7, 8, 10], [11]], False)}
    ranks, results = _start_small_prefill(bootstrap.url, rooms)
    _until_registered(bootstrap.url)
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
            assert claim is not None and claim.poll() is HandleStatus.FAILED  # refused before a claim was granted
            assert receiver._parts[0].fetch is None
            receiver.send_metadata(np.array([1, 2, 3], dtype=np.int32), aux_index=1)  # SGLang may still call it
            assert receiver.poll() == KVPoll.Failed
        heard: dict[tuple[int, int], float] = {}  # (rank, room) -> when its sender's end was heard
        for _ in range(2 * len(ranks)):  # the ranks' ends come in any order (a rank may end 602 before another 601)
            rank, room, seen, _, error = told = results.get(timeout=30)
            heard[rank, room] = time.monotonic()
            assert seen[-1] == KVPoll.Failed and error in ("RoomAbortedError", "ConflictError"), told
        assert set(heard) == {(rank, room) for rank in range(len(ranks)) for room in (601, 602)}, heard
        assert all(at - failed_at[room] < TOLD_WITHIN_S for (_, room), at in heard.items()), (heard, failed_at)
        assert all(not t.any() for t in wrong_keep)  # nothing landed in the wrong decode's buffers

        # The give-up in the owner's envelope opens no hole: with the room claimed by a decode
        # that can read it, a decode of the wrong layout fails and its give-up is refused.
        dst = [30, 1, 2, 29]
        receiver = PdkvKVReceiver(right, bootstrap.url, 603)
        receiver.init(0)
        assert _bootstrap_until_final(receiver) == KVPoll.WaitingForInput  # it holds the room's one claim
        intruder = PdkvKVReceiver(wrong, bootstrap.url, 603)
        intruder.init(0)
        assert _bootstrap_until_final(intruder) == KVPoll.Failed
        with pytest.raises(IncompatibleLayoutError):
            intruder.failure_exception()
        receiver.send_metadata(np.array(dst, dtype=np.int32), aux_index=603 % small.AUX_ROWS)
        assert big._until_final(receiver) == KVPoll.Success
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


# ---- a prefill's abort while its decode reads (item 4) --------------------------------------
def _timed_prefill(registry: str, rooms: list[int], aborts: mp.Queue, results: mp.Queue) -> None:
    """`test_sglang_aborts`' prefill scheduler (each room sent whole, aborted when named on
    `aborts`), stamping the abort: when its scheduler called `abort()` and when pdkv's loop
    ended the room (`time.monotonic`, one clock for every process on the host)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVManager, PdkvKVSender

    big._env(registry)
    args, keep = big._kv_args(fill=True)
    mgr = PdkvKVManager(args, "prefill", server_args=None, is_mla_backend=True)
    assert mgr.exporter is not None
    exporter = mgr.exporter.exporter
    ended: dict[int, float] = {}
    abort_room = exporter.abort_room

    def stamped(room: int, *args: object, **kwargs: object) -> bool:  # on pdkv's loop: pages freed, claimants told
        done = abort_room(room, *args, **kwargs)
        ended[room] = time.monotonic()
        return done

    exporter.abort_room = stamped  # type: ignore[method-assign]
    let_go = False  # the decode has put None: it is done with this prefill
    try:
        results.put(("ready", None, None, None, None, None))
        for room in rooms:
            sender = PdkvKVSender(mgr, registry, room)
            sender.init(big.ROOM_PAGES, aux_index=0)
            sender.should_send_kv_chunk(big.ROOM_PAGES, True)
            sender.send(big._src_pages().astype(np.int32))
            called = None
            while sender.poll() not in (KVPoll.Success, KVPoll.Failed) and not let_go:
                try:
                    asked = aborts.get_nowait()
                except queue.Empty:
                    time.sleep(0.0005)
                    continue
                let_go = asked is None  # the decode gave up on this prefill
                if asked == room:
                    called = time.monotonic()
                    sender.abort()
            if let_go:
                break
            error = None
            if sender.poll() == KVPoll.Failed:
                try:
                    sender.failure_exception()
                except Exception as exc:
                    error = type(exc).__name__
            end = time.monotonic() + 5
            while called is not None and room not in ended and time.monotonic() < end:
                time.sleep(0.001)
            results.put((room, sender.poll(), error, called, ended.get(room), exporter.rooms.pinned_pages))
        # Up until the decode is done with the last room too: an owner gone while a READ of its
        # is still in flight would fail that READ as a lost peer before the abort is heard.
        while not let_go:
            let_go = aborts.get(timeout=120) is None
    finally:
        mgr.close()


def start_timed_prefill(url: str, rooms: list[int]) -> tuple[mp.Process, mp.Queue, mp.Queue]:
    ctx = children.context()
    aborts, results = ctx.Queue(), ctx.Queue()
    prefill = ctx.Process(target=_timed_prefill, args=(url, rooms, aborts, results))
    prefill.start()
    assert results.get(timeout=120)[0] == "ready"
    return prefill, aborts, results


def stop_timed_prefill(prefill: mp.Process, aborts: mp.Queue) -> None:
    """Let the prefill go (the decode is done with it), then wait for it to end."""
    aborts.put(None)
    prefill.join(60)
    if prefill.is_alive():
        prefill.kill()


@dataclass
class AbortTrial:
    """One prefill abort while its decode read (seconds on the host's monotonic clock)."""

    room: int
    outcome: int  # the receiver's final KVPoll
    error: str | None  # its failure's type
    sender_error: str | None
    called: float | None  # the prefill's scheduler called abort()
    ended: float | None  # the prefill's loop ended the room
    heard: float | None  # the decode's readiness stream brought the abort
    stopped: float | None  # the decode's fetch ended (every READ done)
    failed: float  # the receiver's poll said Failed (or Success)
    pinned: int  # pages still pinned on the prefill after the room

    def ms(self, stamp: float | None) -> float:
        return float("nan") if stamp is None or self.called is None else (stamp - self.called) * 1e3


class HeardAborts:
    """Stamps when the decode's readiness feed first holds an aborted state of each room."""

    def __init__(self) -> None:
        from transfer.metadata import RoomStatus
        from transfer.readiness import ReadinessFeed

        self.at: dict[int, float] = {}
        wake = ReadinessFeed._wake

        def stamping(feed: ReadinessFeed, url: str) -> None:
            for (_, room), state in list(feed._wanted.items()):
                if state is not None and state.status is RoomStatus.ABORTED and room not in self.at:
                    self.at[room] = time.monotonic()
            wake(feed, url)

        self._restore = lambda: setattr(ReadinessFeed, "_wake", wake)
        ReadinessFeed._wake = stamping  # type: ignore[method-assign]

    def close(self) -> None:
        self._restore()


def shuffled_runs(seed: int, run: int) -> np.ndarray:
    """The room's pages on the decode as shuffled runs of `run` pages (`test_sglang_aborts`
    takes runs of 16; runs of 1 make a descriptor of every page of every layer)."""
    runs = np.random.default_rng(seed).permutation(big.PAGES // run)[: -(-big.ROOM_PAGES // run)]
    return (runs[:, None] * run + np.arange(run)).reshape(-1)[: big.ROOM_PAGES]


def abort_trial(
    decode: "big._Decode",
    room: int,
    aborts: mp.Queue,
    results: mp.Queue,
    heard: HeardAborts,
    sentinel: bool = False,
) -> AbortTrial:
    """The decode reads `room` as SGLang's scheduler drives its receiver; once its first
    bytes have landed the prefill aborts it; the receiver is polled every 0.5 ms to its end.
    `sentinel`: the moment it says Failed, its pages are overwritten, as SGLang reuses them."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    decode.clear()
    receiver = decode.receiver(room, seed=room)
    stopped: list[float] = []
    fetch = receiver._parts[0].fetch
    assert fetch is not None
    fetch.on_done(lambda _: stopped.append(time.monotonic()))
    end = time.monotonic() + 30
    while not decode.landed(room) and time.monotonic() < end:
        time.sleep(0.0002)
    aborts.put(room)
    outcome = big._until_final(receiver)
    failed = time.monotonic()
    if sentinel and outcome == KVPoll.Failed:
        decode.overwrite(room)
    error = None
    if outcome == KVPoll.Failed:
        try:
            receiver.failure_exception()
        except Exception as exc:
            error = type(exc).__name__
    got, state, sender_error, called, ended, pinned = results.get(timeout=60)
    assert got == room, (got, room)
    return AbortTrial(
        room, outcome, error, sender_error, called, ended, heard.at.get(room), (stopped or [None])[0], failed, pinned
    )


def test_a_prefill_abort_mid_read_reaches_the_receiver_within_the_bound_and_lands_no_byte_after(
    bootstrap,  # noqa: F811
    monkeypatch,
):
    """The prefill aborts while the decode reads a 384 MB room whose destination pages are
    one-token runs (a descriptor each: the READs' slowest shape to stop): each time the
    decode hears it on its readiness stream, the receiver says Failed with `RoomAbortedError`
    within the bound (generously: twice it, on a shared CI host), not one byte lands in its
    pages after that, and the prefill's sender fails too with nothing left pinned."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    monkeypatch.setattr(big, "_dst_pages", lambda seed: shuffled_runs(seed, 1))
    rooms = [9100 + i for i in range(5)]
    prefill, aborts, results = start_timed_prefill(bootstrap.url, rooms)
    heard = HeardAborts()
    decode = big._Decode(bootstrap.url)
    try:
        abort_trial(decode, rooms[0], aborts, results, heard)  # warm-up: connections, READ tables
        for room in rooms[1:]:
            t = abort_trial(decode, room, aborts, results, heard, sentinel=True)
            assert t.outcome == KVPoll.Failed, "the room was read whole before the abort: 2.5 s of READs ended first?"
            assert (t.error, t.sender_error, t.pinned) == ("RoomAbortedError", "RoomAbortedError", 0)
            assert t.heard is not None  # pushed, not found by the pin word after the whole read
            assert t.failed - t.called <= 2 * ABORT_BOUND_S, f"{t.ms(t.failed):.0f} ms: {t}"
            time.sleep(big.SETTLE_S)
            assert decode.changed(room) == 0  # not one late byte in pages SGLang has reused
    finally:
        try:
            decode.close()
            heard.close()
        finally:
            stop_timed_prefill(prefill, aborts)
