"""Owner-broadcast reads on a 4-rank gloo group, DSA-shaped layout, with and without prefetch.

Every rank reads all 61 layers in order while a stand-in compute step (a matmul sized to
take about as long as one layer's broadcast) runs per layer; prints ms per layer on a
non-owner rank and the overlap prefetch achieved.

    .venv/bin/python scripts/bench_broadcast.py [--tokens 8192] [--world 4] [--runs 3]
    python3 scripts/bench_broadcast.py --device cuda --world 2   # one GPU per rank, NCCL
    python3 scripts/bench_broadcast.py --device cuda --world 2 --nccl-ctas 4   # NCCL on at most 4 SMs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from pdkv import LayerSplitDSAKVPool, OwnerBroadcaster, ShardPlan, dsa_v32

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.distributed
from tests.distributed import run_group  # noqa: E402


def _compute(x: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        x = torch.tanh(x @ x)


def _pass(
    pool: LayerSplitDSAKVPool,
    prefetch: bool,
    compute: torch.Tensor,
    reps: int,
    read: bool = True,
    pages: torch.Tensor | None = None,
) -> float:
    for kind in (pool.remote_kv, pool.remote_index):
        kind.clear()  # start cold: every layer must travel
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
    if compute.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / layers * 1e3


def _plain_broadcasts(pool: LayerSplitDSAKVPool, ctas: int | None) -> dict[str, Callable[[], float]]:
    """Plain broadcasts of the same bytes per layer on a torch NCCL group set up as pdkv's
    (a high-priority stream, the same SM cap), each a pass timed in ms a layer: the latent
    then the indexer (two buffers, as the reference pool keeps them), and both as one
    buffer (the link's limit)."""
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    if ctas is not None:
        options.config.max_ctas = ctas
    layout = pool.layout
    group = dist.new_group(list(range(pool.plan.size)), backend="nccl", pg_options=options)
    kv = torch.empty(layout.kv_rows * layout.kv_token_bytes, dtype=torch.uint8, device=layout.device)
    idx = torch.empty(layout.index_num_pages * layout.index_page_bytes, dtype=torch.uint8, device=layout.device)
    joint = torch.empty(kv.numel() + idx.numel(), dtype=torch.uint8, device=layout.device)

    def per_layer(buffers: tuple[torch.Tensor, ...]) -> float:
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(layout.layer_num):
            for buf in buffers:
                dist.broadcast(buf, group_src=pool.plan.owner_of(layer), group=group)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / layout.layer_num * 1e3

    return {"nccl_two": lambda: per_layer((kv, idx)), "nccl_limit": lambda: per_layer((joint,))}


def _rank(
    rank: int, world: int, tokens: int, runs: int, reps: int, device: str = "cpu", ctas: int | None = None
) -> dict[str, float]:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    layout = dsa_v32(size=tokens, device=device)
    pool = LayerSplitDSAKVPool(
        layout, ShardPlan(rank, world, layout.layer_num), OwnerBroadcaster(device=device, max_ctas=ctas)
    )
    compute = torch.randn(256, 256) if device == "cpu" else torch.randn(4096, 4096, device=device)
    _pass(pool, False, compute, reps, read=False)  # warm-up
    rows = {"compute_ms": statistics.median(_pass(pool, False, compute, reps, read=False) for _ in range(runs))}
    eighth = torch.arange(1, layout.num_pages, 8)  # a short read: 1/8 of the pages
    for name, prefetch, with_compute, pages in (
        ("no_prefetch", False, reps, None),
        ("prefetch", True, reps, None),
        ("pages_no_prefetch", False, reps, eighth),
        ("pages_prefetch", True, reps, eighth),
    ):
        samples = [_pass(pool, prefetch, compute, with_compute, pages=pages) for _ in range(runs)]
        rows[name] = statistics.median(samples)
    # pdkv's broadcast and the plain ones in turn, so a drift of the machine hits them alike.
    passes: dict[str, Callable[[], float]] = {"broadcast_only": lambda: _pass(pool, False, compute, 0)}
    if compute.is_cuda:
        passes.update(_plain_broadcasts(pool, ctas))
    samples = {name: [] for name in passes}
    for _ in range(runs + 1):
        for name, one_pass in passes.items():
            samples[name].append(one_pass())
    rows.update({name: statistics.median(taken[1:]) for name, taken in samples.items()})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compute-reps", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (one GPU per rank, NCCL)")
    ap.add_argument("--nccl-ctas", type=int, default=None, help="cap NCCL's CTAs (SMs) for the broadcast group")
    args = ap.parse_args()
    out = run_group(_rank, args.world, args.tokens, args.runs, args.compute_reps, args.device, args.nccl_ctas)
    r = out[args.world - 1]  # the last rank owns none of the first layers
    layout = dsa_v32(size=args.tokens)
    mib = (layout.kv_rows * layout.kv_token_bytes + layout.index_num_pages * layout.index_page_bytes) / 2**20
    hidden = (r["no_prefetch"] - r["prefetch"]) / min(r["broadcast_only"], r["compute_ms"])
    exposed = r["no_prefetch"] - r["compute_ms"]  # what reading costs the step without prefetch
    backend = "NCCL, one GPU per rank" if args.device == "cuda" else "gloo"
    if args.nccl_ctas:
        backend += f", at most {args.nccl_ctas} CTAs"
    print(f"DSA layout, {args.tokens} tokens/pool, {mib:.1f} MiB per layer broadcast, {backend}, CP={args.world}")
    print(f"{'case (on the last rank)':<28}{'ms/layer':>10}")  # 3 decimals: a broadcast takes tens of us
    print(f"{'broadcast only':<28}{r['broadcast_only']:>10.3f}")
    print(f"{'compute only':<28}{r['compute_ms']:>10.3f}")
    print(f"{'read + compute, no prefetch':<28}{r['no_prefetch']:>10.3f}")
    print(f"{'read + compute, prefetch':<28}{r['prefetch']:>10.3f}")
    print(f"{'1/8 of pages, no prefetch':<28}{r['pages_no_prefetch']:>10.3f}")
    print(f"{'1/8 of pages, prefetch':<28}{r['pages_prefetch']:>10.3f}")
    if "nccl_limit" in r:
        print(f"{'plain NCCL, two buffers':<28}{r['nccl_two']:>10.3f}")
        print(f"{'plain NCCL, one (limit)':<28}{r['nccl_limit']:>10.3f}")
        print(
            f"broadcast vs plain NCCL of latent then indexer: {r['nccl_two'] / r['broadcast_only']:.2f}x; "
            f"vs one plain broadcast of the layer (the link's limit): {r['nccl_limit'] / r['broadcast_only']:.2f}x, "
            f"{mib / r['nccl_limit'] * 1000 / 1024:.1f} GiB/s"
        )
    print(
        f"prefetch hid {100 * max(0.0, hidden):.0f}% of the smaller of broadcast and compute "
        f"({r['no_prefetch'] / r['prefetch']:.2f}x faster per layer); {args.world} ranks share this machine's cores"
    )
    if exposed > 0:
        print(
            f"of the {exposed:.3f} ms a layer that reading added to compute without prefetch, prefetch hid "
            f"{100 * (r['no_prefetch'] - r['prefetch']) / exposed:.0f}%"
        )


if __name__ == "__main__":
    main()
