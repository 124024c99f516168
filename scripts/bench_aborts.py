"""How long a prefill's abort takes to reach its decode's receiver, mid-read, and where the
time goes (SGLang's classes, the prefill in a process of its own, CPU over loopback UCX).

Each trial reads a room of DeepSeek-V3.2's shape (61 layers of fp8 latent and indexer,
8,000 one-token pages: 384 MB, `tests/test_sglang_aborts`), and once its first bytes have
landed the prefill's scheduler calls `PdkvKVSender.abort()`. Stamps, from that call: the
prefill's loop ends the room; the decode's readiness stream brings the abort; the decode's
fetch has ended (every READ in flight done); the receiver's `poll()` (every 0.5 ms) says
Failed. Trials whose read ended before the abort are counted apart.

    .venv/bin/python scripts/bench_aborts.py [--trials 30] [--run 16]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_MODULES", "^ib")  # as tests/conftest.py: no InfiniBand here

from tests import test_sglang_aborts as big  # noqa: E402
from tests.test_sglang_layout_abort import (  # noqa: E402
    HeardAborts,
    abort_trial,
    shuffled_runs,
    start_timed_prefill,
    stop_timed_prefill,
)
from transfer.app.options import HelpFormatter  # noqa: E402

STAGES = (("ended", "prefill ended it"), ("heard", "decode heard"), ("stopped", "READs ended"), ("failed", "Failed"))


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--run", type=int, default=16, help="destination pages come in shuffled runs of this many")
    ap.add_argument("--reads", type=int, default=5, help="then this many rooms read whole, not aborted (GB/s)")
    args = ap.parse_args()
    if args.run != 16:
        big._dst_pages = lambda seed: shuffled_runs(seed, args.run)

    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.conn import PdkvKVBootstrapServer

    server = PdkvKVBootstrapServer("127.0.0.1", 0)
    rooms = [9000 + i for i in range(args.trials + 1 + args.reads)]
    prefill, aborts, results = start_timed_prefill(server.url, rooms)
    heard = HeardAborts()
    decode = big._Decode(server.url)
    trials, reads = [], []
    try:
        abort_trial(decode, rooms[0], aborts, results, heard)  # warm-up: connections, tables
        for room in rooms[1 : args.trials + 1]:
            trials.append(abort_trial(decode, room, aborts, results, heard))
            t = trials[-1]
            print(
                f"room {room}: {'Failed' if t.outcome == KVPoll.Failed else 'Success'} {t.error or ''} "
                + " ".join(f"{name}={t.ms(getattr(t, name)):.1f}" for name, _ in STAGES),
                flush=True,
            )
        for room in rooms[args.trials + 1 :]:
            decode.clear()
            receiver = decode.receiver(room, seed=room)
            assert big._until_final(receiver) == KVPoll.Success and results.get(timeout=60)[1] == KVPoll.Success
            reads.append(receiver.get_transfer_metric())
    finally:
        try:
            decode.close()
            heard.close()
        finally:
            stop_timed_prefill(prefill, aborts)
        server.close()
    mid = [t for t in trials if t.outcome == KVPoll.Failed]
    print(f"\n{len(mid)} of {len(trials)} aborts landed mid-read ({len(trials) - len(mid)} rooms read whole first)")
    print(f"{'from abort() to':>22}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, label in STAGES:
        ms = np.array([t.ms(getattr(t, name)) for t in mid])
        ms = ms[~np.isnan(ms)]
        if len(ms):
            p50, p90, p99 = np.percentile(ms, [50, 90, 99])
            print(f"{label:>22}{p50:>10.1f}{p90:>10.1f}{p99:>10.1f}{ms.max():>10.1f}")
    errors = sorted({t.error for t in mid} | {t.sender_error for t in mid}, key=str)
    print(f"errors: {errors}; pages left pinned on the prefill: {max((t.pinned for t in trials), default=0)}")
    if reads:
        seconds = np.array([m.transfer_latency_s for m in reads])
        rate = reads[0].transfer_total_bytes / np.median(seconds) / 1e9
        print(
            f"rooms read whole: median {np.median(seconds) * 1e3:.1f} ms from send_metadata to Success, {rate:.2f} GB/s"
        )


if __name__ == "__main__":
    main()
