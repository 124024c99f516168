"""The same-host GPU lane's kernel alone, on local memory: GB/s against a contiguous copy.

DSA layout (61 layers, latent and indexer), fragmented source and destination pages as in
bench_fetch; one gather plan over every layer, timed with CUDA events, for a few block
sizes and warp counts. Needs a GPU.

    python3 scripts/bench_gather.py [--tokens 1024,8192,32768] [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from transfer.app.synthetic import fragmented_page_order  # noqa: E402
from transfer.gather import GatherLane  # noqa: E402
from transfer.plan import BufferPair, build_gather_plan  # noqa: E402


def pairs(dst: DSAKVPool, src: DSAKVPool) -> list[BufferPair]:
    out = []
    for layer in range(dst.layout.layer_num):
        for d, s in ((dst.kv_buffer[layer], src.kv_buffer[layer]), (dst.index_buffer[layer], src.index_buffer[layer])):
            item = dst.layout.kv_page_bytes if d is dst.kv_buffer[layer] else dst.layout.index_page_bytes
            out.append(BufferPair(d.data_ptr(), s.data_ptr(), item, d.nbytes // item, s.nbytes // item))
    return out


def timed(fn, runs: int) -> float:
    """Median seconds of `fn`, which queues work and returns (start, end) CUDA events."""
    fn()[1].synchronize()
    samples = []
    for _ in range(runs):
        a, b = fn()
        b.synchronize()
        samples.append(a.elapsed_time(b) / 1e3)
    return statistics.median(samples)


def copy(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    dst.copy_(src)
    b.record()
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    layout = dsa_v32(size=max(args.tokens) * 2 + 4096, device="cuda")
    dst, src = DSAKVPool(layout), DSAKVPool(layout)
    rng = np.random.default_rng(7)
    bufs = pairs(dst, src)
    print(f"{'tokens':>8}{'MB':>8}{'block':>8}{'warps':>8}{'kernel GB/s':>14}{'contig GB/s':>14}{'ratio':>8}")
    for n in args.tokens:
        k = n // layout.page_size
        s_pages = fragmented_page_order(np.arange(1, layout.num_pages), rng)[:k]
        d_pages = fragmented_page_order(np.arange(1, layout.num_pages), rng)[:k]
        plan = build_gather_plan(bufs, s_pages, d_pages)
        flat_d, flat_s = dst.kv_slab.view(torch.uint8).view(-1), src.kv_slab.view(torch.uint8).view(-1)
        n_bytes = plan.nbytes
        contig = n_bytes / timed(lambda d=flat_d[:n_bytes], s=flat_s[:n_bytes]: copy(d, s), args.runs) / 1e9
        for block in (2048, 4096, 8192):  # the lane picks 4096 x 4 warps, or 8192 x 8 from 1 GiB
            for warps in (4, 8):
                lane = GatherLane(torch.device("cuda:0"), (block, warps))
                t = timed(lambda lane=lane, plan=plan: lane.launch(plan), args.runs)
                gbps = plan.nbytes / t / 1e9
                row = (f"{n:>8}{plan.nbytes / 1e6:>8.0f}{block:>8}{warps:>8}", f"{gbps:>14.0f}{contig:>14.0f}")
                print("".join(row) + f"{gbps / contig:>8.2f}")


if __name__ == "__main__":
    main()
