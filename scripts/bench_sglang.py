"""pdkv behind SGLang's transfer-backend interface: what the adapter adds, and how long its
calls hold the scheduler's thread.

A CP=4 layer-split prefill (4 processes, DeepSeek-V3.2's 61 layers of latent + indexer,
pages of 64 tokens) and a decode (this process) drive pdkv's SGLang sender and receiver as
SGLang's schedulers do. Per room: the prefill sends it in one chunk; once every rank has,
the decode's receiver gets its pages and is polled until Success (every `--poll-us`, the
scheduler's other work in between). Each run also reads a room of the same size with its
ticket through pdkv's own API (`DecodeFetcher.fetch`, the prefill ranks' pins handed over as
a router would), into the same pages: what the adapter's path is set against. The adapter's
time is split: the read itself (`FetchResult.seconds`: from its start on pdkv's thread to its
proof) and the rest (handing the read over, and the wait for the first `poll()` that says
Success). Needs sglang (scripts/sglang-cpu.txt).

    python3 scripts/bench_sglang.py [--sizes 1024,8192] [--runs 10] [--device cuda] [--poll-us 200] [--early-ms 50]

`--early-ms`: a second table, the decode naming its pages that long before the prefill sends
(the room then read as it is written, by claims): from the prefill's last send to Success.

With `--device cuda` every KV buffer is a CUDA tensor (one per layer and kind, as SGLang's
pools): the decode reads the prefill's through the same-host GPU lane.

`--hosts`: the bootstrap server and the prefill ranks on one stand-in host, the decode on
another (network namespaces, UCX held to `--tls`, default tcp; `scripts/bench_hosts.py`'s
link options), each prefill rank advertising its host's address (`PDKV_SGLANG_HOST`). Needs
root. `--owner-progress-ms` sets the prefill ranks' `PDKV_SGLANG_OWNER_PROGRESS_MS` (which
docs/sglang.md advises at 1 over TCP).

    sudo .venv/bin/python scripts/bench_sglang.py --hosts --sizes 1024,8192,32768 --runs 10
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdkv.sharding import ShardPlan  # noqa: E402
from scripts.bench_hosts import add_link_options, run_on_decode, stand_in_hosts  # noqa: E402
from tests.netns import enter_netns  # noqa: E402
from transfer.app.launcher import Host  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402

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


def _on_host(host: Host) -> None:
    """This fresh process moved onto the stand-in host `host` (its first call), advertising
    its address there; nothing where `host` is this one."""
    if host.netns is not None:
        enter_netns(host.netns)
        os.environ["PDKV_SGLANG_HOST"] = host.address


def _orphaned() -> bool:
    """Whether the process that started this one is gone (the decode, killed: by the OOM killer, say)."""
    parent = mp.parent_process()
    return parent is not None and not parent.is_alive()


def _next_order(orders: mp.Queue):  # type: ignore[no-untyped-def]
    """The next order; None once there are no more, or no decode left to give them."""
    while True:
        try:
            return orders.get(timeout=1)
        except queue.Empty:
            if _orphaned():
                return None


def _prefill_rank(registry: str, rank: int, pages: int, orders: mp.Queue, replies: mp.Queue, host: Host) -> None:
    _on_host(host)
    from sglang.srt.disaggregation.base import conn

    from transfer.sglang.conn import PdkvKVManager, PdkvKVSender

    _env(registry, rank, CP)
    owned = ShardPlan(rank, CP, LAYERS).owned  # SGLang's layer split, which pdkv's plan reproduces
    args, _keep = _kv_args(range(owned.start, owned.stop), pages, conn)
    mgr = PdkvKVManager(args, "prefill", None, True)
    replies.put(("ready", rank))
    holds: list[float] = []
    while (order := _next_order(orders)) is not None:
        room, src, ticket, forward_s = order
        sender = PdkvKVSender(mgr, registry, room)
        _timed(holds, sender.init, len(src), 0)
        time.sleep(forward_s)  # the forward pass, while the decode may already name its pages
        _timed(holds, sender.should_send_kv_chunk, len(src), True)
        sent_at = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
        _timed(holds, sender.send, np.asarray(src, dtype=np.int32), None)
        pin = mgr.exporter.pin(room).result(timeout=60) if ticket else None  # as a router hands it over
        replies.put(("sent", rank, (pin, sent_at)))
        while _timed(holds, sender.poll) not in (conn.KVPoll.Success, conn.KVPoll.Failed):
            time.sleep(0.0002)
        replies.put(("done", rank))
    replies.put(("holds", holds))
    mgr.close()


def _publish(orders: list, replies, room: int, src: np.ndarray, ticket: bool, forward_s: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    """Every prefill rank publishes `room`, then (after `forward_s`) sends it in one chunk."""
    for q in orders:
        q.put((room, src.tolist(), ticket, forward_s))


def _sent(replies) -> tuple[list, float]:  # type: ignore[no-untyped-def]
    """Once every rank has sent: their pins (None unless asked for) and the last send's time."""
    pins, last = {}, 0.0
    for _ in range(CP):
        kind, rank, (pin, sent_at) = replies.get(timeout=120)
        assert kind == "sent", kind
        pins[rank], last = pin, max(last, sent_at)
    return [pins[r] for r in range(CP)], last


def _await_senders(replies) -> None:  # type: ignore[no-untyped-def]
    for _ in range(CP):
        assert replies.get(timeout=120)[0] == "done"


def _ticket_fetch(mgr, room: int, src: np.ndarray, dst: np.ndarray, pins: list):  # type: ignore[no-untyped-def]
    """pdkv's own ticket fetch of `room`, on the decode fetcher's loop (`FetchResult`)."""
    from transfer.metadata import RoomTicket

    sync_fetcher = mgr.fetcher(SERVER_URL).result(timeout=60)
    ticket = RoomTicket(engine_id="dp0", room=room, src_pages=src.tolist(), pins=pins)
    coro = sync_fetcher.fetcher.fetch("dp0", room, dst, ticket=ticket)
    return sync_fetcher._bg.run(coro, 60)


def _receive(mgr, conn, room: int, dst: np.ndarray, poll_s: float, holds: list, prefix: int = 0):  # type: ignore[no-untyped-def]
    """SGLang's receiver reads `room`: from its bootstrap, then timed from `send_metadata`
    to the first poll that says Success; (seconds, its `FetchResult`)."""
    from transfer.sglang.conn import PdkvKVReceiver

    receiver = PdkvKVReceiver(mgr, SERVER_URL, room)
    receiver.init(0)
    while receiver.poll() == conn.KVPoll.Bootstrapping:
        time.sleep(0.001)
    t0 = time.perf_counter()
    _timed(holds, receiver.send_metadata, dst, 0, None, prefix)
    fetch = receiver._parts[0].fetch
    while (state := _timed(holds, receiver.poll)) == conn.KVPoll.Transferring:
        time.sleep(poll_s)  # the scheduler's other work between two polls
    seen = time.perf_counter() - t0
    assert state == conn.KVPoll.Success, state
    result = fetch.result()
    return seen, result


def _receive_early(mgr, conn, room: int, dst: np.ndarray, poll_s: float):  # type: ignore[no-untyped-def]
    """SGLang's receiver names its pages as soon as it is bootstrapped, before the prefill
    sends (as a decode with free pages does): when `send_metadata` ran, the first poll
    that said Success (perf_counter), and the read's `FetchResult`."""
    from transfer.sglang.conn import PdkvKVReceiver

    receiver = PdkvKVReceiver(mgr, SERVER_URL, room)
    receiver.init(0)
    while receiver.poll() == conn.KVPoll.Bootstrapping:
        time.sleep(poll_s)
    named = time.perf_counter()
    receiver.send_metadata(dst, 0)
    while (state := receiver.poll()) == conn.KVPoll.Transferring:
        time.sleep(poll_s)
    assert state == conn.KVPoll.Success, state
    return named, time.perf_counter(), receiver._parts[0].fetch.result()


def _by_ticket(orders, replies, mgr, room: int, src: np.ndarray, dst: np.ndarray):  # type: ignore[no-untyped-def]
    """`room` published, sent and read with its ticket; its `FetchResult`."""
    _publish(orders, replies, room, src, ticket=True)
    pins, _ = _sent(replies)
    result = _ticket_fetch(mgr, room, src, dst, pins)
    assert result.control_messages == 0, "a ticket fetch asked an owner"
    _await_senders(replies)
    return result


def _by_receiver(orders, replies, mgr, conn, room: int, src: np.ndarray, dst: np.ndarray, poll_s: float):  # type: ignore[no-untyped-def]
    """`room` published, sent and read through SGLang's receiver: (seconds from `send_metadata`
    to Success, its `FetchResult`, how long each of its calls held the scheduler's thread)."""
    _publish(orders, replies, room, src, ticket=False)
    _sent(replies)
    holds: list[float] = []
    seen, result = _receive(mgr, conn, room, dst, poll_s, holds)
    _await_senders(replies)
    if result.control_messages:  # not read as a ticket's: the comparison would not hold
        raise SystemExit(f"room {room}: the receiver's read asked the owners ({result.control_messages})")
    return seen, result, holds


SERVER_URL = ""


def _bootstrap(host: Host, ports: mp.Queue, stop) -> None:  # type: ignore[no-untyped-def]
    """SGLang's bootstrap server on `host` (a process of its own there), until `stop`."""
    _on_host(host)
    from transfer.sglang.conn import PdkvKVBootstrapServer

    server = PdkvKVBootstrapServer(host.address, 0)
    ports.put(int(server.url.rsplit(":", 1)[1]))
    while not stop.wait(1) and not _orphaned():
        pass
    server.close()


def _on_hosts(args: argparse.Namespace) -> None:
    """This script again on the decode's stand-in host, its prefill on another (`--hosts`)."""
    with stand_in_hosts(args, "bench_sglang") as net:
        cmd = [str(Path(__file__).resolve()), "--prefill-host", net.where("prefill"), "--runs", str(args.runs)]
        cmd += ["--sizes", ",".join(map(str, args.sizes)), "--poll-us", str(args.poll_us)]
        cmd += ["--early-ms", str(args.early_ms), "--prefix", str(args.prefix)]
        if args.owner_progress_ms is not None:
            cmd += ["--owner-progress-ms", str(args.owner_progress_ms)]
        note = f", owners progress every {args.owner_progress_ms:g} ms" if args.owner_progress_ms else ""
        sys.exit(run_on_decode(net, args, cmd, note))


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,8192", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--poll-us", type=float, default=200.0, help="the scheduler's work between two polls")
    ap.add_argument(
        "--early-ms", type=float, default=0.0, help="also: the decode names its pages this long before the sends"
    )
    ap.add_argument(
        "--prefix", type=float, default=0.0, help="also: the decode's radix cache holds this share of each room"
    )
    ap.add_argument("--owner-progress-ms", type=float, default=None, help="the prefill's PDKV_SGLANG_OWNER_PROGRESS_MS")
    ap.add_argument("--hosts", action="store_true", help="the prefill and the decode on two stand-in hosts (root)")
    ap.add_argument("--prefill-host", type=Host.parse, default="127.0.0.1", help="the prefill's host: NETNS@ADDR")
    add_link_options(ap.add_argument_group("the link between the hosts (with --hosts)"))
    args = ap.parse_args()
    if args.hosts and args.device != "cpu":
        ap.error("--hosts reads CPU pools over the network (on one GPU the same-host lane would serve)")
    if args.hosts:
        _on_hosts(args)
    if args.owner_progress_ms is not None:
        os.environ["PDKV_SGLANG_OWNER_PROGRESS_MS"] = str(args.owner_progress_ms)  # the prefill ranks inherit it
    global DEVICE, SERVER_URL
    DEVICE = os.environ["PDKV_BENCH_DEVICE"] = args.device
    from sglang.srt.disaggregation.base import conn

    from transfer.sglang.conn import PdkvKVBootstrapServer, PdkvKVManager

    pages = 2 * max(args.sizes) // PAGE + 2
    ctx = mp.get_context("spawn")
    host, server, stop = args.prefill_host, None, ctx.Event()
    if host.netns is None:
        server = PdkvKVBootstrapServer(host.address, 0)
        SERVER_URL = server.url
    else:  # on the prefill's host, as SGLang's launcher starts it there
        ports: mp.Queue = ctx.Queue()
        bootstrap = ctx.Process(target=_bootstrap, args=(host, ports, stop), daemon=True)
        bootstrap.start()
        SERVER_URL = f"http://{host.address}:{ports.get(timeout=120)}"
    orders, replies = [ctx.Queue() for _ in range(CP)], ctx.Queue()
    ranks = [
        ctx.Process(target=_prefill_rank, args=(SERVER_URL, r, pages, orders[r], replies, host)) for r in range(CP)
    ]
    for p in ranks:
        p.start()
    _env("", 0, 1)
    kv_args, _keep = _kv_args(range(LAYERS), pages, conn)
    mgr = PdkvKVManager(kv_args, "decode", None, True)
    for _ in range(CP):  # started (SGLang's import and NIXL's registration: minutes on a loaded host)
        assert replies.get(timeout=900)[0] == "ready"
    rows, decode_holds = [], []
    rng = np.random.default_rng(0)
    room = 1
    for n in args.sizes:
        ticket_s, fetch_s, seen_s = [], [], []
        for i in range(args.runs + 1):
            k = n // PAGE
            src, dst = rng.permutation(np.arange(1, pages))[:k], rng.permutation(np.arange(1, pages))[:k]
            ticket = functools.partial(_by_ticket, orders, replies, mgr, room, src, dst)
            receiver = functools.partial(
                _by_receiver, orders, replies, mgr, conn, room + 1, src, dst, args.poll_us / 1e6
            )
            if i % 2 == 0:  # which path reads first alternates: neither gains from the order
                by_ticket, (seen, result, holds) = ticket(), receiver()
            else:
                (seen, result, holds), by_ticket = receiver(), ticket()
            room += 2
            if i:  # the first is a warm-up
                decode_holds += holds
                ticket_s.append(by_ticket.seconds)
                fetch_s.append(result.seconds)
                seen_s.append(seen)
        nbytes = n * LAYERS * (KV_ITEM + INDEX_ITEM) // PAGE
        rows.append((n, nbytes, ticket_s, fetch_s, seen_s))
    early_rows = []
    for n in args.sizes if args.early_ms else []:
        tails, released = [], []
        for i in range(args.runs + 1):
            k = n // PAGE
            src, dst = rng.permutation(np.arange(1, pages))[:k], rng.permutation(np.arange(1, pages))[:k]
            _publish(orders, replies, room, src, ticket=False, forward_s=args.early_ms / 1e3)
            named, seen, result = _receive_early(mgr, conn, room, dst, args.poll_us / 1e6)
            _, last_sent = _sent(replies)
            _await_senders(replies)
            room += 1
            if named > last_sent:
                raise SystemExit(f"room {room - 1}: the pages were named after the send (raise --early-ms)")
            if i:
                tails.append(seen - last_sent)
                released.append("notification" if not result.freed else "request")
        early_rows.append((n, tails, released))
    prefix_rows = []
    for n in args.sizes if args.prefix else []:
        k, times, moved = n // PAGE, [], []
        held = int(k * args.prefix)
        for i in range(args.runs + 1):
            src, dst = rng.permutation(np.arange(1, pages))[:k], rng.permutation(np.arange(1, pages))[:k]
            _publish(orders, replies, room, src, ticket=False)
            _sent(replies)
            seen, result = _receive(mgr, conn, room, dst[held:], args.poll_us / 1e6, [], prefix=held * PAGE)
            _await_senders(replies)
            room += 1
            if i:
                times.append(seen)
                moved.append(result.nbytes)
        prefix_rows.append((n, held, n * LAYERS * (KV_ITEM + INDEX_ITEM) // PAGE, moved, times))
    for q in orders:
        q.put(None)
    prefill_holds = []
    for _ in range(CP):
        kind, holds = replies.get(timeout=60)
        prefill_holds += holds
    for p in ranks:
        p.join(30)
    mgr.close()
    if server is not None:
        server.close()
    stop.set()
    _print(rows, args, decode_holds, prefill_holds)
    if host.netns is not None:  # across hosts: the table of issue 40 (gpu_check.sh reads the tail above)
        _print_paths(rows)
    _print_early(early_rows, args)
    _print_prefix(prefix_rows, args)


def _print_paths(rows) -> None:  # type: ignore[no-untyped-def]
    """Each size's two paths side by side: sglang (send_metadata to the poll that says Success)
    and ticket (its FetchResult.seconds); ratio: the ticket's p50 ms over the path's."""
    print("| tokens | path | GB/s p50 | ms p50 | ms p99 | x ticket |")
    print("|---:|---|---:|---:|---:|---:|")
    for n, nbytes, ticket_s, _, seen_s in rows:
        base = np.percentile(ticket_s, 50)
        for path, times in (("sglang", seen_s), ("ticket", ticket_s)):
            p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
            cells = f"{nbytes / p50 / 1e9:.2f} | {1e3 * p50:.1f} | {1e3 * p99:.1f} | {base / p50:.2f}"
            print(f"| {n} | {path} | {cells} |")


def _print_prefix(rows, args) -> None:  # type: ignore[no-untyped-def]
    if not rows:
        return
    print(f"the decode holds {args.prefix:.0%} of each room (its radix cache): only the pages past it move")
    print("".join(f"{h:>16}" for h in ("tokens", "held pages", "room MB", "moved MB", "via adapter ms")))
    for n, held, whole, moved, times in rows:
        cells = (n, held, whole / 1e6, statistics.median(moved) / 1e6, 1e3 * statistics.median(times))
        print("".join(f"{c:>16.0f}" if j < 2 else f"{c:>16.3f}" for j, c in enumerate(cells)))


def _print_early(rows, args) -> None:  # type: ignore[no-untyped-def]
    if not rows:
        return
    print(f"pages named {args.early_ms:.0f} ms before the prefill sends: from its last send to the first Success")
    print("".join(f"{h:>14}" for h in ("tokens", "p50 ms", "p90 ms", "released by")))
    for n, tails, released in rows:
        p50, p90 = 1e3 * np.percentile(tails, 50), 1e3 * np.percentile(tails, 90)
        how = "/".join(sorted(set(released)))
        print(f"{n:>14}{p50:>14.3f}{p90:>14.3f}{how:>14}")


def _print(rows, args, decode_holds, prefill_holds) -> None:  # type: ignore[no-untyped-def]
    print(
        f"pdkv through SGLang's interface: CP={CP} prefill processes, DSA-61 on {DEVICE}, {args.runs} runs, "
        f"a poll every {args.poll_us:.0f} us; ms, medians"
    )
    head = ("tokens", "MB", "ticket ms", "via adapter", "x ticket", "read", "besides", "ticket GB/s")
    print("".join(f"{h:>12}" for h in head))
    med = statistics.median
    for n, nbytes, ticket_s, fetch_s, seen_s in rows:
        t, s = med(ticket_s), med(seen_s)
        besides = med(seen - read for seen, read in zip(seen_s, fetch_s))
        cells = (n, nbytes / 1e6, 1e3 * t, 1e3 * s, t / s, 1e3 * med(fetch_s), 1e3 * besides)
        cells += (nbytes / t / 1e9,)
        print("".join(f"{c:>12.0f}" if j < 2 else f"{c:>12.3f}" for j, c in enumerate(cells)))
    print(
        "read: its FetchResult.seconds (its start on pdkv's thread to its proof); besides: the rest of "
        "via adapter (the hand-over, the wait for the poll that says Success)"
    )
    for side, holds in (("decode (send_metadata, poll)", decode_holds), ("prefill (init, send, poll)", prefill_holds)):
        us = np.array(holds) * 1e6
        p50, p99, top = np.percentile(us, 50), np.percentile(us, 99), us.max()
        print(f"scheduler thread held by {side}: p50 {p50:.1f} us, p99 {p99:.1f} us, max {top:.0f} us")


if __name__ == "__main__":
    main()
