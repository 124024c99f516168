"""What SGLang's Mooncake backend serves, through pdkv's classes: the decode's radix-cache
prefix, and a prefill split into pipeline stages.

Driven as SGLang's schedulers drive the classes (prefill ranks in processes of their own,
the decode's receivers polled here), real UCX between them, bytes checked page by page.
"""

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
import torch

from tests import children
from tests.test_sglang import (  # noqa: F401  (fixtures: the bootstrap server, a clean environment)
    AUX_ITEMS,
    AUX_ROWS,
    INDEX_ITEM,
    KV_ITEM,
    LAYERS,
    _aux_row,
    _env,
    _kv_args,
    _own_environment,
    _pattern,
    _prefill_rank,
    bootstrap,
)

SENTINEL = 0x5A


def _decode(url: str):  # type: ignore[no-untyped-def]
    from transfer.sglang.conn import PdkvKVManager

    _env("", 0, 1)
    args, keep = _kv_args(range(LAYERS), fill=False)
    for t in keep[: 2 * LAYERS]:
        t.fill_(SENTINEL)  # pages the decode holds: a read may change only the pages it names
    return PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True), keep


def _drive(receivers: dict, dst: dict, prefix: dict, hold: dict, seconds: float = 60.0) -> dict:  # type: ignore[no-untyped-def]
    """A decode scheduler's loop: send each receiver's metadata once it waits for it (after
    `hold[room]` seconds: a room then whole is read as a ticket's), until all have ended."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    waiting: dict[int, float] = {}
    states = {room: KVPoll.Bootstrapping for room in receivers}
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(s not in (KVPoll.Success, KVPoll.Failed) for s in states.values()):
        for room, r in receivers.items():
            states[room] = r.poll()
            if states[room] == KVPoll.WaitingForInput:
                since = waiting.setdefault(room, time.monotonic())
                if time.monotonic() - since >= hold.get(room, 0.0):
                    pages = np.array(dst[room], dtype=np.int32)
                    r.send_metadata(pages, room % AUX_ROWS, decode_prefix_len=prefix[room])
        time.sleep(0.002)
    return states


def test_a_decode_with_a_prefix_reads_only_the_pages_past_it(bootstrap):  # noqa: F811
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVReceiver

    page = 16  # test_sglang's page size, in tokens
    rooms = {
        201: ([[3, 4, 5], [9], [20, 21]], False),  # read chunk by chunk as it is sent
        202: ([[7, 8, 10, 11, 12]], False),  # whole before the decode names its pages: read as a ticket's
    }
    prefix = {201: 2 * page, 202: 3 * page}  # the decode's radix cache holds these tokens
    dst = {201: [30, 1, 2, 29], 202: [6, 17]}  # the pages past the prefix
    ctx = children.context()
    results = ctx.Queue()
    prefill = ctx.Process(target=_prefill_rank, args=(bootstrap.url, 0, 1, rooms, results))
    prefill.start()
    mgr, keep = _decode(bootstrap.url)
    try:
        receivers = {room: PdkvKVReceiver(mgr, bootstrap.url.removeprefix("http://"), room) for room in rooms}
        for r in receivers.values():
            r.init(0)
        states = _drive(receivers, dst, prefix, hold={202: 1.5})
        sent = [results.get(timeout=60) for _ in rooms]
        prefill.join(30)
        assert states == {201: KVPoll.Success, 202: KVPoll.Success}
        assert all(seen[-1] == KVPoll.Success for _, _, seen, _, _ in sent)  # released: the prefill is done
        named = sorted(sum(dst.values(), []))
        others = np.setdiff1d(np.arange(keep[0].shape[0]), named)
        for room in rooms:
            src = sum(rooms[room][0], [])[prefix[room] // page :]
            for layer in range(LAYERS):
                assert np.array_equal(keep[layer].numpy()[dst[room]], _pattern(layer, 0)[src]), (room, layer)
                assert np.array_equal(keep[LAYERS + layer].numpy()[dst[room]], _pattern(layer, 1)[src])
            moved = receivers[room].get_transfer_metric().transfer_total_bytes
            assert moved == len(src) * LAYERS * (KV_ITEM + INDEX_ITEM)  # fewer bytes: the prefix stays
            aux = keep[2 * LAYERS :]
            assert b"".join(t[room % AUX_ROWS].numpy().tobytes() for t in aux) == _aux_row(room)
        for t in keep[: 2 * LAYERS]:  # the prefix's pages (and every other) untouched
            assert (t.numpy()[others] == SENTINEL).all()
    finally:
        mgr.close()
        if prefill.is_alive():
            prefill.kill()


def test_a_prefix_that_is_not_whole_pages_fails_typed(bootstrap):  # noqa: F811
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVReceiver

    rooms = {211: ([[3, 4, 5]], False)}
    ctx = children.context()
    results = ctx.Queue()
    prefill = ctx.Process(target=_prefill_rank, args=(bootstrap.url, 0, 1, rooms, results))
    prefill.start()
    mgr, keep = _decode(bootstrap.url)
    try:
        receiver = PdkvKVReceiver(mgr, bootstrap.url.removeprefix("http://"), 211)
        receiver.init(0)
        states = _drive({211: receiver}, {211: [1, 2]}, {211: 17}, hold={})
        assert states[211] == KVPoll.Failed
        with pytest.raises(Exception, match="not whole") as failure:
            receiver.failure_exception()
        assert type(failure.value).__name__ == "LayoutError"
        _, _, seen, _, error = results.get(timeout=60)
        assert seen[-1] == KVPoll.Failed and error == "RoomAbortedError"  # the claim given up: not pinned
        assert all((t.numpy() == SENTINEL).all() for t in keep[: 2 * LAYERS])
    finally:
        mgr.close()
        prefill.join(30)
        if prefill.is_alive():
            prefill.kill()


def _stage_rank(registry: str, pp_rank: int, cp_rank: int, rooms: dict, results: mp.Queue) -> None:
    """One prefill rank of PP 2 x CP 2: its stage's layers split between the stage's CP ranks."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVManager, PdkvKVSender
    from transfer.sglang.topology import environment

    os.environ.update(environment(registry, cp_rank, 2, LAYERS, "cpu", pp_rank=pp_rank, pp_size=2))
    per_stage = LAYERS // 2
    first = pp_rank * per_stage + cp_rank * (per_stage // 2)
    args, keep = _kv_args(range(first, first + per_stage // 2), fill=True)
    args.pp_rank = pp_rank
    mgr = PdkvKVManager(args, "prefill", server_args=None, is_mla_backend=True)
    aux = keep[-len(AUX_ITEMS) :]
    try:
        for room, pages in rooms.items():
            blob, offset = _aux_row(room), 0
            for t, n in zip(aux, AUX_ITEMS):
                t[room % AUX_ROWS] = torch.frombuffer(bytearray(blob[offset : offset + n]), dtype=torch.uint8)
                offset += n
            sender = PdkvKVSender(mgr, registry, room)
            sender.init(len(pages), aux_index=room % AUX_ROWS)
            sender.should_send_kv_chunk(len(pages), True)
            sender.send(np.array(pages, dtype=np.int32), [np.array(pages)])
            end = time.monotonic() + 60
            while sender.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < end:
                time.sleep(0.002)
            results.put((pp_rank, cp_rank, room, sender.poll()))
    finally:
        mgr.close()


def test_pp2_by_cp2_prefill_to_one_decode_byte_exact(bootstrap):  # noqa: F811
    """PP 2 x CP 2: four owners, a (stage, CP rank) pair each, one layer each of four."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVReceiver

    rooms = {221: [3, 4, 9], 222: [12, 13, 14, 15]}
    dst = {221: [20, 1, 2], 222: [6, 7, 30, 31]}
    ctx = children.context()
    results = ctx.Queue()
    ranks = [
        ctx.Process(target=_stage_rank, args=(bootstrap.url, pp, cp, rooms, results)) for pp in (0, 1) for cp in (0, 1)
    ]
    for p in ranks:
        p.start()
    mgr, keep = _decode(bootstrap.url)
    try:
        receivers = {room: PdkvKVReceiver(mgr, bootstrap.url.removeprefix("http://"), room) for room in rooms}
        for r in receivers.values():
            r.init(0)
        states = _drive(receivers, dst, {room: 0 for room in rooms}, hold={})
        sent = [results.get(timeout=60) for _ in range(4 * len(rooms))]
        assert states == {221: KVPoll.Success, 222: KVPoll.Success}
        assert {s for *_, s in sent} == {KVPoll.Success}
        for room, src in rooms.items():
            for layer in range(LAYERS):
                assert np.array_equal(keep[layer].numpy()[dst[room]], _pattern(layer, 0)[src]), (room, layer)
                assert np.array_equal(keep[LAYERS + layer].numpy()[dst[room]], _pattern(layer, 1)[src])
            aux = keep[2 * LAYERS :]
            assert b"".join(t[room % AUX_ROWS].numpy().tobytes() for t in aux) == _aux_row(room)
            owners = receivers[room]._parts[0].fetch.result().owners
            assert sorted(o.cp_rank for o in owners) == [0, 1, 2, 3]  # every (stage, CP rank) read
    finally:
        mgr.close()
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_a_decode_split_into_stages_is_refused(monkeypatch):
    from pdkv.errors import LayoutError
    from transfer.sglang.conn import PdkvKVManager

    _env("", 0, 1)
    monkeypatch.setenv("PDKV_SGLANG_PP_SIZE", "2")
    args, _ = _kv_args(range(LAYERS), fill=False)
    with pytest.raises(LayoutError, match="PP > 1"):
        PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
