"""pdkv as SGLang's transfer backend, against the real `sglang` 0.5.23 package.

A prefill (SGLang's plain DSA pool: one rank; or its layer-split pool: two CP ranks, each
a process with its own scheduler-like loop) and a decode (this process) drive pdkv's
SGLang manager, sender and receiver through the `KVPoll` lifecycle, over SGLang's
`KVArgs` built from per-layer tensors, with pdkv's bootstrap server between them.
Bytes are checked page by page, aux rows too.

SGLang's `DisaggregationMode` lives in a module that imports torchvision at import time,
which cannot be installed beside the CPU torch here; the mode is given by its value
("prefill" / "decode"), which the manager accepts as well.
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

LAYERS, PAGE, PAGES, AUX_ROWS = 4, 16, 32, 8
KV_ITEM, INDEX_ITEM = 656 * PAGE, 132 * PAGE  # DeepSeek-V3.2's latent and indexer pages
AUX_ITEMS = (32, 256)  # output ids, a hidden-state row


def _owned(cp_rank: int, cp_size: int) -> range:
    per = LAYERS // cp_size
    return range(cp_rank * per, (cp_rank + 1) * per)


def _pattern(layer: int, kind: int) -> np.ndarray:
    item = (KV_ITEM, INDEX_ITEM)[kind]
    return np.random.default_rng(100 * layer + kind).integers(0, 256, size=(PAGES, item), dtype=np.uint8)


def _aux_row(room: int) -> bytes:
    return b"".join(np.random.default_rng(room).integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in AUX_ITEMS)


DRAFT_BASE = 100  # a draft layer's pattern is that of layer DRAFT_BASE + its index


def _kv_args(layers: range, fill: bool, drafts: int = 0, device: str = "cpu") -> tuple[object, list[torch.Tensor]]:
    """SGLang's KVArgs over a tensor per layer and kind on `device` (and the aux buffers, on
    the host as SGLang keeps them); `drafts`: a draft model's (MTP) layers, appended after the
    target's as SGLang does, with no layer ids (SGLang's DSA pools report none). `keep`:
    latent, then indexer (target, then draft), then aux."""
    every = [*layers, *range(DRAFT_BASE, DRAFT_BASE + drafts)]

    def tensor(x: int, kind: int) -> torch.Tensor:
        item = (KV_ITEM, INDEX_ITEM)[kind]
        return torch.from_numpy(_pattern(x, kind) if fill else np.zeros((PAGES, item), np.uint8)).to(device)

    kv = [tensor(x, 0) for x in every]
    index = [tensor(x, 1) for x in every]
    aux = [torch.zeros((AUX_ROWS, n), dtype=torch.uint8) for n in AUX_ITEMS]
    keep = kv + index + aux
    args = conn.KVArgs()
    args.engine_rank, args.gpu_id, args.system_dp_rank, args.pp_rank = 0, 0, 0, 0
    args.page_size, args.num_draft_entries = PAGE, drafts
    args.prefill_start_layer, args.prefill_end_layer = layers.start, layers.stop
    args.kv_layer_ids = [] if drafts else list(layers)
    args.kv_data_ptrs = [t.data_ptr() for t in kv]
    args.kv_data_lens = [t.nbytes for t in kv]
    args.kv_item_lens = [KV_ITEM] * len(kv)
    args.state_types = [conn.StateType.DSA]
    args.state_layer_ids = [[] if drafts else list(layers)]
    args.state_data_ptrs = [[t.data_ptr() for t in index]]
    args.state_data_lens = [[t.nbytes for t in index]]
    args.state_item_lens = [[INDEX_ITEM] * len(index)]
    args.aux_data_ptrs = [t.data_ptr() for t in aux]
    args.aux_data_lens = [t.nbytes for t in aux]
    args.aux_item_lens = list(AUX_ITEMS)
    return args, keep


def _env(registry: str, cp_rank: int, cp_size: int, tp: tuple = (0, 1), device: str = "cpu") -> None:
    from transfer.sglang.topology import environment

    os.environ.update(environment(registry, cp_rank, cp_size, LAYERS, device, *tp))


def _prefill_rank(
    registry: str,
    cp_rank: int,
    cp_size: int,
    rooms: dict,
    results: mp.Queue,
    drafts: int = 0,
    tp: tuple = (0, 1),
    device: str = "cpu",
) -> None:
    """One CP rank's scheduler: a sender per request, polled once an iteration; the last CP
    rank holds the draft model's `drafts` layers, as under SGLang's layer split."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVManager, PdkvKVSender

    _env(registry, cp_rank, cp_size, tp, device)
    drafts = drafts if cp_rank == cp_size - 1 else 0
    args, keep = _kv_args(_owned(cp_rank, cp_size), fill=True, drafts=drafts, device=device)
    mgr = PdkvKVManager(args, "prefill", server_args=None, is_mla_backend=True)
    aux = keep[-len(AUX_ITEMS) :]
    try:
        for room, (chunks, abort) in rooms.items():
            sender = PdkvKVSender(mgr, registry, room)
            seen = [sender.poll()]
            sender.init(sum(len(c) for c in chunks), aux_index=room % AUX_ROWS)
            seen.append(sender.poll())
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                if last:  # SGLang writes the request's aux row before its last chunk
                    blob, offset = _aux_row(room), 0
                    for t, n in zip(aux, AUX_ITEMS):
                        t[room % AUX_ROWS] = torch.frombuffer(bytearray(blob[offset : offset + n]), dtype=torch.uint8)
                        offset += n
                if abort and i == 1:
                    sender.abort()
                    break
                if sender.should_send_kv_chunk(len(chunk), last):
                    sender.send(np.array(chunk, dtype=np.int32), [np.array(sum(chunks, []))] if last else None)
                seen.append(sender.poll())
                time.sleep(0.02)  # the next chunk's forward pass
            end = time.monotonic() + 60
            while sender.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < end:
                time.sleep(0.002)  # the scheduler's other work
            seen.append(sender.poll())
            metric, error = sender.get_transfer_metric(), None
            if seen[-1] == KVPoll.Failed:  # SGLang asks for the failure only then
                try:
                    sender.failure_exception()
                except Exception as exc:
                    error = type(exc).__name__
            results.put((cp_rank, room, seen, metric.transfer_total_bytes, error))
    finally:
        mgr.close()


# Room for the prefill processes to start (torch and SGLang imported) on a loaded 2-core machine:
# not a bound on pdkv, which the tests state apart.
RECEIVE_WAIT_S = 180


def _receive(mgr, url: str, room: int, dst: list[int], aux_index: int):  # type: ignore[no-untyped-def]
    """A decode scheduler's loop for one receiver: bootstrap, send its pages once it waits
    for them, poll until it ends (RECEIVE_WAIT_S at most). Returns the receiver and its last state."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVReceiver

    receiver = PdkvKVReceiver(mgr, url, room)
    receiver.init(0)
    end, state = time.monotonic() + RECEIVE_WAIT_S, KVPoll.Bootstrapping
    while state not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < end:
        state = receiver.poll()
        if state == KVPoll.WaitingForInput:
            receiver.send_metadata(np.array(dst, dtype=np.int32), aux_index=aux_index)
        time.sleep(0.002)
    return receiver, state


ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_GPU)])
@pytest.mark.parametrize("cp_size", [1, 2], ids=["plain-dsa", "layer-split-cp2"])
def test_a_prefill_and_a_decode_drive_pdkv_through_kvpoll(bootstrap, cp_size, device):  # noqa: F811
    """On a GPU every KV buffer is a CUDA tensor: the receiver reads through the same-host lane."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVManager, PdkvKVReceiver

    rooms = {
        101: ([[3, 4, 5], [9], [20, 21]], False),  # three chunks of a chunked prefill
        102: ([[7, 8, 10, 11, 12]], False),  # one chunk
        103: ([[13, 14], [15], [16]], True),  # aborted by the prefill after its first chunk
    }
    dst = {101: [30, 1, 2, 29, 28, 27], 102: [6, 17, 18, 19, 22], 103: [23, 24, 25, 26]}
    ctx = children.context()
    results = ctx.Queue()
    ranks = [
        ctx.Process(target=_prefill_rank, args=(bootstrap.url, r, cp_size, rooms, results, 0, (0, 1), device))
        for r in range(cp_size)
    ]
    for p in ranks:
        p.start()
    _env("", 0, 1, device=device)
    args, keep = _kv_args(range(LAYERS), fill=False, device=device)
    mgr = PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
    try:
        receivers = {room: PdkvKVReceiver(mgr, bootstrap.url.removeprefix("http://"), room) for room in rooms}
        assert {r.poll() for r in receivers.values()} == {KVPoll.Bootstrapping}  # init not called yet
        for r in receivers.values():
            r.init(0)
        lifecycle = {room: [] for room in rooms}
        end = time.monotonic() + 90
        while time.monotonic() < end:  # the decode scheduler's loop: one poll a receiver an iteration
            for room, r in receivers.items():
                state = r.poll()
                if not lifecycle[room] or lifecycle[room][-1] != state:
                    lifecycle[room].append(state)
                if state == KVPoll.WaitingForInput:
                    r.send_metadata(np.array(dst[room], dtype=np.int32), aux_index=room % AUX_ROWS + 0)
            if all(s[-1] in (KVPoll.Success, KVPoll.Failed) for s in lifecycle.values()):
                break
            time.sleep(0.002)
        sent = [results.get(timeout=60) for _ in range(cp_size * len(rooms))]
        for p in ranks:
            p.join(30)

        for room in (101, 102):
            assert lifecycle[room][-1] == KVPoll.Success, lifecycle[room]
            assert KVPoll.WaitingForInput in lifecycle[room]  # bootstrapped before its metadata went
            src = sum(rooms[room][0], [])
            kv, index = keep[:LAYERS], keep[LAYERS : 2 * LAYERS]
            for layer in range(LAYERS):
                assert np.array_equal(kv[layer].cpu().numpy()[dst[room]], _pattern(layer, 0)[src]), (room, layer)
                assert np.array_equal(index[layer].cpu().numpy()[dst[room]], _pattern(layer, 1)[src]), (room, layer)
            aux = keep[2 * LAYERS :]
            got = b"".join(t[room % AUX_ROWS].numpy().tobytes() for t in aux)
            assert got == _aux_row(room)  # the first output token and the like came with the KV
            fetched = receivers[room]._parts[0].fetch.result()
            assert {o.lane for o in fetched.owners} == {"cuda_ipc" if device == "cuda" else "ucx"}
            assert not fetched.freed  # proved by the pin words, released by notifications: no round trip
            assert receivers[room].get_transfer_metric().transfer_total_bytes == len(src) * LAYERS * (
                KV_ITEM + INDEX_ITEM
            )
        assert lifecycle[103][-1] == KVPoll.Failed
        with pytest.raises(Exception) as failure:
            receivers[103].failure_exception()
        assert "pdkv" in type(failure.value).__module__  # a typed pdkv error, not a bare Exception
        never_sent = dst[103][2:]  # the aborted room's chunks after the first never came
        assert all(not keep[x].cpu().numpy()[never_sent].any() for x in range(LAYERS))

        for cp_rank, room, seen, nbytes, error in sent:
            assert seen[0] == seen[1] == KVPoll.WaitingForInput, seen  # a pull needs no handshake: init comes then
            if rooms[room][1]:
                assert seen[-1] == KVPoll.Failed and error == "RoomAbortedError"
            else:
                assert KVPoll.Transferring in seen and seen[-1] == KVPoll.Success and error is None, seen
                per_page = len(_owned(cp_rank, cp_size)) * (KV_ITEM + INDEX_ITEM)
                assert nbytes == len(sum(rooms[room][0], [])) * per_page
    finally:
        mgr.close()
        for p in ranks:
            if p.is_alive():
                p.kill()


def _prefill_then_stall(registry: str, room: int, started: mp.Queue) -> None:
    """A prefill rank that sends a room's first chunk and then stalls (to be killed)."""
    from transfer.sglang.conn import PdkvKVManager, PdkvKVSender

    _env(registry, 0, 1)
    args, keep = _kv_args(_owned(0, 1), fill=True)
    mgr = PdkvKVManager(args, "prefill", server_args=None, is_mla_backend=True)
    sender = PdkvKVSender(mgr, registry, room)
    sender.init(4, aux_index=0)
    sender.should_send_kv_chunk(2, False)
    sender.send(np.array([5, 6], dtype=np.int32))
    started.put(sender.poll())
    time.sleep(120)


def test_a_prefill_killed_mid_room_fails_the_receiver_with_a_typed_error(bootstrap):  # noqa: F811

    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdkv.errors import PeerLostError
    from transfer.sglang.conn import PdkvKVManager, PdkvKVReceiver

    ctx = children.context()
    started = ctx.Queue()
    prefill = ctx.Process(target=_prefill_then_stall, args=(bootstrap.url, 301, started))
    prefill.start()
    _env("", 0, 1)
    args, keep = _kv_args(range(LAYERS), fill=False)
    mgr = PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
    try:
        assert started.get(timeout=60) == KVPoll.Transferring
        receiver = PdkvKVReceiver(mgr, bootstrap.url, 301)
        receiver.init(0)
        states, end = [], time.monotonic() + 60
        while time.monotonic() < end:
            state = receiver.poll()
            if not states or states[-1] != state:
                states.append(state)
            if state == KVPoll.WaitingForInput:
                receiver.send_metadata(np.array([1, 2, 3, 4], dtype=np.int32), aux_index=1)
            if state == KVPoll.Transferring and prefill.is_alive():
                time.sleep(0.3)  # the first chunk is read; then the prefill dies mid-room
                prefill.kill()
                prefill.join(10)  # a forkserver's child reads alive until the server reports it
            if state in (KVPoll.Success, KVPoll.Failed):
                break
            time.sleep(0.002)
        assert states[-1] == KVPoll.Failed, states
        with pytest.raises(PeerLostError, match="cp rank 0"):  # typed, naming the lost owner
            receiver.failure_exception()
    finally:
        mgr.close()
        prefill.kill()
        prefill.join(10)


def test_layouts_the_backend_does_not_serve_are_refused_at_start(monkeypatch):
    from pdkv.errors import LayoutError
    from transfer.sglang.conn import PdkvKVManager

    _env("http://127.0.0.1:9", 0, 1)
    args, keep = _kv_args(range(LAYERS), fill=False)
    args.pp_rank = 1
    with pytest.raises(LayoutError, match="pipeline"):
        PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
    args, keep = _kv_args(range(LAYERS), fill=False, drafts=1)
    for listed in (args.state_data_ptrs, args.state_data_lens, args.state_item_lens):
        listed[0].pop()  # a draft model without a DSA indexer state
    with pytest.raises(LayoutError, match="draft"):
        PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
    args, keep = _kv_args(range(LAYERS), fill=False)
    args.state_types = []  # not a DSA pool
    with pytest.raises(LayoutError, match="DSA"):
        PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
    monkeypatch.setenv("PDKV_SGLANG_CP_SIZE", "2")
    monkeypatch.delenv("PDKV_SGLANG_LAYERS")
    with pytest.raises(LayoutError, match="layer count"):
        PdkvKVManager(_kv_args(range(2), fill=True)[0], "prefill", server_args=None, is_mla_backend=True)


def test_the_secret_guards_every_service_sglang_starts(monkeypatch):
    """PDKV_SECRET reaches the bootstrap server, the prefill's exporter and the decode's
    fetcher: a decode with another secret fails with AuthError and reads nothing; one with
    the right secret reads the room whole. PDKV_REQUIRE_SECRET refuses to start without one."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from pdkv.errors import AuthError
    from transfer.sglang.conn import PdkvKVBootstrapServer, PdkvKVManager

    monkeypatch.setenv("PDKV_SECRET", "right-secret")
    server = PdkvKVBootstrapServer("127.0.0.1", 0)
    rooms = {401: ([[3, 4, 5]], False)}
    ctx = children.context()
    results = ctx.Queue()
    prefill = ctx.Process(target=_prefill_rank, args=(server.url, 0, 1, rooms, results))
    prefill.start()
    _env("", 0, 1)
    managers = []
    try:
        for secret in ("wrong-secret", "right-secret"):
            monkeypatch.setenv("PDKV_SECRET", secret)
            args, keep = _kv_args(range(LAYERS), fill=False)
            mgr = PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
            managers.append(mgr)
            receiver, state = _receive(mgr, server.url, 401, [1, 2, 9], aux_index=1)
            if secret == "wrong-secret":
                assert state == KVPoll.Failed
                with pytest.raises(AuthError):
                    receiver.failure_exception()
                assert not any(t.numpy().any() for t in keep[: 2 * LAYERS])  # nothing read
            else:
                assert state == KVPoll.Success
                for layer in range(LAYERS):
                    assert np.array_equal(keep[layer].numpy()[[1, 2, 9]], _pattern(layer, 0)[[3, 4, 5]])
        assert results.get(timeout=60)[2][-1] == KVPoll.Success
        monkeypatch.delenv("PDKV_SECRET")
        monkeypatch.setenv("PDKV_REQUIRE_SECRET", "1")
        with pytest.raises(AuthError, match="PDKV_SECRET"):
            PdkvKVManager(_kv_args(range(LAYERS), fill=False)[0], "decode", server_args=None, is_mla_backend=True)
    finally:
        for mgr in managers:
            mgr.close()
        server.close()
        prefill.join(30)
        if prefill.is_alive():
            prefill.kill()


def test_sglang_settings_become_pdkvs_bounds(monkeypatch):
    """SGLang's bootstrap and waiting timeouts and its heartbeat settings, read as SGLang
    reads them (its defaults where unset), become pdkv's Timeouts (the README's table)."""
    from transfer.sglang.topology import sglang_timeouts

    t = sglang_timeouts()
    # The readiness stream's heartbeat is at most a second: three silent ones and the owner is lost.
    assert (t.pin, t.lookup, t.fetch, t.publish, t.heartbeat, t.lease) == (300, 300, 300, 300, 1.0, 10.0)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "40")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "600")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "1.5")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "4")
    t = sglang_timeouts()
    assert (t.pin, t.lookup, t.fetch, t.publish, t.heartbeat, t.lease) == (40, 40, 600, 600, 1.0, 6.0)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "0.5")
    assert sglang_timeouts().heartbeat == 0.5


def test_a_layer_split_prefill_reads_the_layer_count_from_the_model_config(tmp_path, monkeypatch):
    """No PDKV_SGLANG_LAYERS: the count comes from config.json at SGLang's --model-path."""
    import json
    import types

    from transfer.sglang.topology import topology

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 61}))
    monkeypatch.setenv("PDKV_SGLANG_REGISTRY", "http://127.0.0.1:9")
    monkeypatch.setenv("PDKV_SGLANG_CP_RANK", "3")
    monkeypatch.setenv("PDKV_SGLANG_CP_SIZE", "4")
    monkeypatch.setenv("PDKV_SGLANG_DEVICE", "cpu")
    monkeypatch.delenv("PDKV_SGLANG_LAYERS", raising=False)
    args, _ = _kv_args(range(2), fill=False)
    server_args = types.SimpleNamespace(model_path=str(tmp_path), revision=None)
    assert topology(args, True, server_args).layer_num == 61
    monkeypatch.setenv("PDKV_SGLANG_LAYERS", "7")  # the variable stays an override
    assert topology(args, True, server_args).layer_num == 7


def test_mtp_a_draft_models_layers_travel_with_the_room(bootstrap):  # noqa: F811
    """MTP under the layer split: the last of two CP ranks also holds the draft model's
    layer; the decode's receiver reads the target's layers from both ranks and the draft's
    from the draft engine, into its own buffers, byte for byte; both senders succeed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVManager

    rooms = {501: ([[3, 4, 5], [9, 20]], False)}
    dst = [30, 1, 2, 29, 28]
    ctx = children.context()
    results = ctx.Queue()
    ranks = [ctx.Process(target=_prefill_rank, args=(bootstrap.url, r, 2, rooms, results, 1)) for r in range(2)]
    for p in ranks:
        p.start()
    _env("", 0, 1)
    args, keep = _kv_args(range(LAYERS), fill=False, drafts=1)
    mgr = PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
    try:
        receiver, state = _receive(mgr, bootstrap.url, 501, dst, aux_index=501 % AUX_ROWS)
        assert state == KVPoll.Success, state
        src = sum(rooms[501][0], [])
        layers = [*range(LAYERS), DRAFT_BASE]
        kv, index = keep[: LAYERS + 1], keep[LAYERS + 1 : 2 * (LAYERS + 1)]
        for i, layer in enumerate(layers):
            assert np.array_equal(kv[i].numpy()[dst], _pattern(layer, 0)[src]), layer
            assert np.array_equal(index[i].numpy()[dst], _pattern(layer, 1)[src]), layer
        got = b"".join(t[501 % AUX_ROWS].numpy().tobytes() for t in keep[2 * (LAYERS + 1) :])
        assert got == _aux_row(501)
        per_page = KV_ITEM + INDEX_ITEM
        assert receiver.get_transfer_metric().transfer_total_bytes == len(src) * (LAYERS + 1) * per_page
        sent = [results.get(timeout=60) for _ in ranks]
        assert all(seen[-1] == KVPoll.Success for _, _, seen, _, _ in sent), sent
        by_rank = {cp_rank: nbytes for cp_rank, _, _, nbytes, _ in sent}
        assert by_rank == {0: len(src) * 2 * per_page, 1: len(src) * 3 * per_page}  # rank 1: its layers and the draft
    finally:
        mgr.close()
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (2, 1), (2, 2)])
def test_attention_tp_on_either_side_every_decode_rank_reads_the_whole_room(bootstrap, prefill_tp, decode_tp):  # noqa: F811
    """Prefill CP=2 x TP, decode TP: MLA keeps the whole latent on every attention-TP rank,
    so each prefill CP rank's TP rank 0 exports (the others' senders succeed with it, as
    SGLang takes the lowest state of a TP group), and every decode TP rank reads the whole
    room into its own buffers (the room grants one claim per decode TP rank)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVManager, PdkvKVReceiver

    room = 600 + 10 * prefill_tp + decode_tp
    rooms = {room: ([[3, 4], [5, 9]], False)}
    dst = [7, 1, 30, 2]
    ctx = children.context()
    results = ctx.Queue()
    ranks = [
        ctx.Process(target=_prefill_rank, args=(bootstrap.url, cp, 2, rooms, results, 0, (tp, prefill_tp)))
        for cp in range(2)
        for tp in range(prefill_tp)
    ]
    for p in ranks:
        p.start()
    decodes = []
    try:
        for tp in range(decode_tp):
            _env("", 0, 1, (tp, decode_tp))
            args, keep = _kv_args(range(LAYERS), fill=False)
            mgr = PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
            receiver = PdkvKVReceiver(mgr, bootstrap.url, room)
            receiver.init(0)
            decodes.append((mgr, receiver, keep))
        states = [KVPoll.Bootstrapping] * decode_tp
        end = time.monotonic() + 60
        while any(s not in (KVPoll.Success, KVPoll.Failed) for s in states) and time.monotonic() < end:
            for i, (_, receiver, _) in enumerate(decodes):
                states[i] = receiver.poll()
                if states[i] == KVPoll.WaitingForInput:
                    receiver.send_metadata(np.array(dst, dtype=np.int32), aux_index=room % AUX_ROWS)
            time.sleep(0.002)
        assert states == [KVPoll.Success] * decode_tp, states
        src = sum(rooms[room][0], [])
        for _, _, keep in decodes:  # every decode TP rank holds the whole room
            for layer in range(LAYERS):
                assert np.array_equal(keep[layer].numpy()[dst], _pattern(layer, 0)[src]), layer
                assert np.array_equal(keep[LAYERS + layer].numpy()[dst], _pattern(layer, 1)[src]), layer
        sent = [results.get(timeout=60) for _ in ranks]
        assert all(seen[-1] == KVPoll.Success for _, _, seen, _, _ in sent), sent
    finally:
        for mgr, _, _ in decodes:
            mgr.close()
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
