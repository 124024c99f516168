"""pdkv behind SGLang's transfer-backend interface: what the adapter adds, and how long its
calls hold the scheduler's thread.

A CP=4 layer-split prefill (4 processes, DeepSeek-V3.2's 61 layers of latent + indexer,
pages of 64 tokens) and a decode (this process) drive pdkv's SGLang sender and receiver as
SGLang's schedulers do. Per room: the prefill sends it in one chunk; once every rank has,
the decode's receiver gets its pages and is polled until Success. The fetch's own time
(`FetchResult.seconds`) is set against what the polling scheduler sees. Needs sglang
(scripts/sglang-cpu.txt).

    python3 scripts/bench_sglang.py [--sizes 1024,8192] [--runs 10] [--device cuda]

With `--device cuda` every KV buffer is a CUDA tensor (one per layer and kind, as SGLang's
pools): the decode reads the prefill's through the same-host GPU lane.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv.sharding import ShardPlan  # noqa: E402

LAYERS, PAGE, CP = 61, 64, 4
DEVICE = os.environ.get("PDKV_BENCH_DEVICE", "cpu")  # set by --device, for the prefill processes too
KV_ITEM, INDEX_ITEM, AUX_ITEMS = 656 * PAGE, 132 * PAGE, (64, 64)


def _kv_args(layers: range, pages: int, conn) -> tuple[object, list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    kv = [torch.ones((pages, KV_ITEM), dtype=torch.uint8, device=DEVICE) for _ in layers]
    index = [torch.ones((pages, INDEX_ITEM), dtype=torch.uint8, device=DEVICE) for _ in layers]
    aux = [torch.zeros((16, n), dtype=torch.uint8) for n in AUX_ITEMS]
    a = conn.KVArgs()
    a.gpu_id, a.system_dp_rank, a.page_size, a.num_draft_entries = 0, 0, PAGE, 0
    a.prefill_start_layer, a.kv_layer_ids = layers.start, list(layers)
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = (
        [t.data_ptr() for t in kv],
        [t.nbytes for t in kv],
        [KV_ITEM] * len(kv),
    )
    a.state_types, a.state_layer_ids = [conn.StateType.DSA], [list(layers)]
    a.state_data_ptrs, a.state_data_lens = [[t.data_ptr() for t in index]], [[t.nbytes for t in index]]
    a.state_item_lens = [[INDEX_ITEM] * len(index)]
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = (
        [t.data_ptr() for t in aux],
        [t.nbytes for t in aux],
        list(AUX_ITEMS),
    )
    return a, kv + index + aux


def _env(registry: str, cp_rank: int, cp_size: int) -> None:
    from transfer.sglang.topology import environment

    os.environ.update(environment(registry, cp_rank, cp_size, LAYERS, DEVICE))


def _timed(holds: list[float], fn, *args):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn(*args)
    holds.append(time.perf_counter() - t0)
    return out


def _prefill_rank(registry: str, rank: int, pages: int, orders: mp.Queue, replies: mp.Queue) -> None:
    from sglang.srt.disaggregation.base import conn

    from transfer.sglang.conn import PdkvKVManager, PdkvKVSender

    _env(registry, rank, CP)
    owned = ShardPlan(rank, CP, LAYERS).owned  # SGLang's layer split, which pdkv's plan reproduces
    args, _keep = _kv_args(range(owned.start, owned.stop), pages, conn)
    mgr = PdkvKVManager(args, "prefill", None, True)
    holds: list[float] = []
    while (order := orders.get()) is not None:
        room, src = order
        sender = PdkvKVSender(mgr, registry, room)
        _timed(holds, sender.init, len(src), 0)
        _timed(holds, sender.should_send_kv_chunk, len(src), True)
        _timed(holds, sender.send, np.asarray(src, dtype=np.int32), None)
        replies.put(("sent", rank))
        while _timed(holds, sender.poll) not in (conn.KVPoll.Success, conn.KVPoll.Failed):
            time.sleep(0.0002)
        replies.put(("done", rank))
    replies.put(("holds", holds))
    mgr.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,8192", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    global DEVICE
    DEVICE = os.environ["PDKV_BENCH_DEVICE"] = args.device
    from sglang.srt.disaggregation.base import conn

    from transfer.sglang.conn import PdkvKVBootstrapServer, PdkvKVManager, PdkvKVReceiver

    pages = 2 * max(args.sizes) // PAGE + 2
    server = PdkvKVBootstrapServer("127.0.0.1", 0)
    ctx = mp.get_context("spawn")
    orders, replies = [ctx.Queue() for _ in range(CP)], ctx.Queue()
    ranks = [ctx.Process(target=_prefill_rank, args=(server.url, r, pages, orders[r], replies)) for r in range(CP)]
    for p in ranks:
        p.start()
    _env("", 0, 1)
    kv_args, _keep = _kv_args(range(LAYERS), pages, conn)
    mgr = PdkvKVManager(kv_args, "decode", None, True)
    rows, decode_holds = [], []
    rng = np.random.default_rng(0)
    room = 1
    for n in args.sizes:
        fetch_s, seen_s = [], []
        for i in range(args.runs + 1):
            k = n // PAGE
            src, dst = rng.permutation(np.arange(1, pages))[:k], rng.permutation(np.arange(1, pages))[:k]
            for q in orders:
                q.put((room, src.tolist()))
            for _ in range(CP):
                assert replies.get(timeout=120)[0] == "sent"
            receiver = PdkvKVReceiver(mgr, server.url, room)
            receiver.init(0)
            while receiver.poll() == conn.KVPoll.Bootstrapping:
                time.sleep(0.001)
            holds = decode_holds if i else []
            t0 = time.perf_counter()
            _timed(holds, receiver.send_metadata, dst, 0)
            while (state := _timed(holds, receiver.poll)) == conn.KVPoll.Transferring:
                time.sleep(0.0002)  # the scheduler's other work between two polls
            seen = time.perf_counter() - t0
            assert state == conn.KVPoll.Success, state
            for _ in range(CP):
                assert replies.get(timeout=120)[0] == "done"
            if i:
                fetch_s.append(receiver._parts[0].fetch.result().seconds)  # type: ignore[union-attr]
                seen_s.append(seen)
            room += 1
        nbytes = n * LAYERS * (KV_ITEM + INDEX_ITEM) // PAGE
        rows.append((n, nbytes, fetch_s, seen_s))
    for q in orders:
        q.put(None)
    prefill_holds = []
    for _ in range(CP):
        kind, holds = replies.get(timeout=60)
        prefill_holds += holds
    for p in ranks:
        p.join(30)
    mgr.close()
    server.close()

    print(f"pdkv through SGLang's interface: CP={CP} prefill processes, DSA-61 on {DEVICE}, {args.runs} runs")
    head = ("tokens", "MB", "fetch ms", "via adapter", "added ms", "fetch GB/s", "adapter GB/s")
    print("".join(f"{h:>13}" for h in head))
    for n, nbytes, fetch_s, seen_s in rows:
        f, s = statistics.median(fetch_s), statistics.median(seen_s)
        cells = (n, nbytes / 1e6, 1e3 * f, 1e3 * s, 1e3 * (s - f), nbytes / f / 1e9, nbytes / s / 1e9)
        print("".join(f"{c:>13.0f}" if j < 2 else f"{c:>13.2f}" for j, c in enumerate(cells)))
    for side, holds in (("decode (send_metadata, poll)", decode_holds), ("prefill (init, send, poll)", prefill_holds)):
        us = np.array(holds) * 1e6
        p50, p99, top = np.percentile(us, 50), np.percentile(us, 99), us.max()
        print(f"scheduler thread held by {side}: p50 {p50:.1f} us, p99 {p99:.1f} us, max {top:.0f} us")


if __name__ == "__main__":
    main()
