"""Owner-broadcast reads on a 4-rank gloo group, DSA-shaped layout, with and without prefetch.

Every rank reads all 61 layers in order while a stand-in compute step runs per layer;
prints ms per layer on a non-owner rank and the overlap prefetch achieved. The stand-in is
a matmul a few times as long as one layer's broadcast (fp32 256x256 on the host, bf16
4096x4096 on a GPU, about 0.2 ms on an H200, filling every SM): a longer one would hide the
broadcast in its own run-to-run noise. Every pass is sampled in turn, `--runs` times, so a
drift of the machine hits them alike; medians are printed.

    .venv/bin/python scripts/bench_broadcast.py [--tokens 8192] [--world 4] [--runs 3]
    python3 scripts/bench_broadcast.py --device cuda --world 2   # one GPU per rank, NCCL
    python3 scripts/bench_broadcast.py --device cuda --world 2 --nccl-ctas 0   # NCCL's own choice of SMs

A prefetch hides only where the compute leaves the broadcast SMs to run on (on two H200s
the same matmul through cuBLAS's default kernels let it hide 48-81%, through cuBLASLt
leaving the broadcast's SMs free 91-107%: docs/benchmarks.md). NCCL gets at most
`--nccl-ctas` SMs, the deployment's cap by default (8; 0: NCCL's own choice), and the
stand-in's matmuls leave that many free (cuBLASLt's SM count target, through torch's SM
carve-out), as a prefill that overlaps communication with compute sets its GEMMs up;
`--sm-carveout` overrides that (0: the matmuls take every SM).
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
from pdkv.broadcast import nccl_group_options

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.distributed
from tests.distributed import run_group  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.app.supervisor import BROADCAST_CTAS  # noqa: E402


def _compute(x: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        x = torch.tanh(x @ x)


def _stand_in(device: str) -> torch.Tensor:
    """The compute step's operand: tensor-core work on a GPU, as a model's layers are."""
    if device == "cpu":
        return torch.randn(256, 256)
    return torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) / 64  # tanh keeps it bounded


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
    layout = pool.layout
    group = dist.new_group(list(range(pool.plan.size)), backend="nccl", pg_options=nccl_group_options(ctas))
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
    rank: int,
    world: int,
    tokens: int,
    runs: int,
    reps: int,
    device: str = "cpu",
    ctas: int | None = None,
    carveout: int = 0,
) -> dict[str, float]:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
        torch.backends.cuda.preferred_blas_library("cublaslt")  # the library that honours the SM target
        if carveout:
            torch._C._set_sm_carveout_experimental(carveout)
    layout = dsa_v32(size=tokens, device=device)
    pool = LayerSplitDSAKVPool(
        layout, ShardPlan(rank, world, layout.layer_num), OwnerBroadcaster(device=device, max_ctas=ctas)
    )
    compute = _stand_in(device)
    _pass(pool, False, compute, reps, read=False)  # warm-up
    eighth = torch.arange(1, layout.num_pages, 8)  # a short read: 1/8 of the pages
    passes: dict[str, Callable[[], float]] = {
        "compute_ms": lambda: _pass(pool, False, compute, reps, read=False),
        "no_prefetch": lambda: _pass(pool, False, compute, reps),
        "prefetch": lambda: _pass(pool, True, compute, reps),
        "pages_no_prefetch": lambda: _pass(pool, False, compute, reps, pages=eighth),
        "pages_prefetch": lambda: _pass(pool, True, compute, reps, pages=eighth),
        "broadcast_only": lambda: _pass(pool, False, compute, 0),
    }
    if compute.is_cuda:
        passes.update(_plain_broadcasts(pool, ctas))
    samples: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(runs + 1):  # the first round warms every pass up
        for name, one_pass in passes.items():
            samples[name].append(one_pass())
    rows = {name: statistics.median(taken[1:]) for name, taken in samples.items()}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compute-reps", type=int, default=None, help="matmuls a layer (8 on the host, 1 on a GPU)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (one GPU per rank, NCCL)")
    ap.add_argument("--nccl-ctas", type=int, default=BROADCAST_CTAS, help="cap NCCL's CTAs (SMs); 0: NCCL's own choice")
    ap.add_argument(
        "--sm-carveout", type=int, default=None, help="SMs the stand-in's matmuls leave free (default: --nccl-ctas)"
    )
    args = ap.parse_args()
    reps = args.compute_reps if args.compute_reps is not None else (8 if args.device == "cpu" else 1)
    ctas = args.nccl_ctas  # 0: NCCL's choice
    carveout = args.sm_carveout if args.sm_carveout is not None else (ctas or 0)
    out = run_group(_rank, args.world, args.tokens, args.runs, reps, args.device, ctas, carveout)
    r = out[args.world - 1]  # the last rank owns none of the first layers
    layout = dsa_v32(size=args.tokens)
    mib = (layout.kv_rows * layout.kv_token_bytes + layout.index_num_pages * layout.index_page_bytes) / 2**20
    hidden = (r["no_prefetch"] - r["prefetch"]) / min(r["broadcast_only"], r["compute_ms"])
    exposed = r["no_prefetch"] - r["compute_ms"]  # what reading costs the step without prefetch
    backend = "NCCL, one GPU per rank" if args.device == "cuda" else "gloo"
    if ctas and args.device != "cpu":
        backend += f", at most {ctas} CTAs"
    if carveout and args.device != "cpu":
        backend += f", matmuls leave {carveout} SMs"
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
