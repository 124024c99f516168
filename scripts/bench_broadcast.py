"""Owner-broadcast reads on a 4-rank gloo group, DSA-shaped layout, with and without prefetch.

Every rank reads all 61 layers in order while a stand-in compute step (a matmul sized to
take about as long as one layer's broadcast) runs per layer; prints ms per layer on a
non-owner rank and the overlap prefetch achieved.

    .venv/bin/python scripts/bench_broadcast.py [--tokens 8192] [--world 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pdkv import LayerSplitDSAKVPool, OwnerBroadcaster, ShardPlan, dsa_v32
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.distributed
from tests.distributed import run_group  # noqa: E402


def _compute(x: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        x = torch.tanh(x @ x)


def _pass(pool: LayerSplitDSAKVPool, prefetch: bool, compute: torch.Tensor, reps: int, read: bool = True,
          pages: torch.Tensor | None = None) -> float:
    for kind in (pool.remote_kv, pool.remote_index):
        kind.valid_layer = None  # start cold: every layer must travel
    dist.barrier()
    t0 = time.perf_counter()
    layers = pool.layout.layer_num
    for layer in range(layers):
        if read:
            pool.prefetch(layer, pages)  # no-op when the previous step prefetched it
            pool.get_key_buffer(layer)
            pool.get_index_buffer(layer)
        if read and prefetch and layer + 1 < layers:
            pool.prefetch(layer + 1, pages)
        _compute(compute, reps)
    return (time.perf_counter() - t0) / layers * 1e3


def _rank(rank: int, world: int, tokens: int, runs: int, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    layout = dsa_v32(size=tokens)
    pool = LayerSplitDSAKVPool(layout, ShardPlan(rank, world, layout.layer_num), OwnerBroadcaster())
    compute = torch.randn(256, 256)
    _pass(pool, False, compute, reps, read=False)  # warm-up
    rows = {"compute_ms": statistics.median(_pass(pool, False, compute, reps, read=False) for _ in range(runs))}
    eighth = torch.arange(1, layout.num_pages, 8)  # a short read: 1/8 of the pages
    for name, prefetch, with_compute, pages in (
        ("broadcast_only", False, 0, None),
        ("no_prefetch", False, reps, None),
        ("prefetch", True, reps, None),
        ("pages_no_prefetch", False, reps, eighth),
        ("pages_prefetch", True, reps, eighth),
    ):
        samples = [_pass(pool, prefetch, compute, with_compute, pages=pages) for _ in range(runs)]
        rows[name] = statistics.median(samples)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compute-reps", type=int, default=8)
    args = ap.parse_args()
    out = run_group(_rank, args.world, args.tokens, args.runs, args.compute_reps)
    r = out[args.world - 1]  # the last rank owns none of layers 0..45
    layout = dsa_v32(size=args.tokens)
    mib = (layout.kv_rows * layout.kv_token_bytes + layout.index_num_pages * layout.index_page_bytes) / 2**20
    hidden = (r["no_prefetch"] - r["prefetch"]) / min(r["broadcast_only"], r["compute_ms"])
    print(f"DSA layout, {args.tokens} tokens/pool, {mib:.1f} MiB per layer broadcast, gloo CP={args.world}")
    print(f"{'case (on the last rank)':<28}{'ms/layer':>10}")
    print(f"{'broadcast only':<28}{r['broadcast_only']:>10.2f}")
    print(f"{'compute only':<28}{r['compute_ms']:>10.2f}")
    print(f"{'read + compute, no prefetch':<28}{r['no_prefetch']:>10.2f}")
    print(f"{'read + compute, prefetch':<28}{r['prefetch']:>10.2f}")
    print(f"{'1/8 of pages, no prefetch':<28}{r['pages_no_prefetch']:>10.2f}")
    print(f"{'1/8 of pages, prefetch':<28}{r['pages_prefetch']:>10.2f}")
    print(f"prefetch hid {100 * max(0.0, hidden):.0f}% of the smaller of broadcast and compute "
          f"({r['no_prefetch'] / r['prefetch']:.2f}x faster per layer); {args.world} ranks share this machine's cores")


if __name__ == "__main__":
    main()
