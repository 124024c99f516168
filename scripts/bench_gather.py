"""The same-host GPU lane's kernel alone, on local memory: GB/s against a contiguous copy.

DSA layout (61 layers, latent and indexer), fragmented source and destination pages as in
bench_fetch; one gather plan over every layer, timed with CUDA events, for a few block
sizes and warp counts, with the host time of queueing a launch. Needs a GPU.

    python3 scripts/bench_gather.py [--tokens 1024,8192,32768] [--runs 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from transfer.app.synthetic import fragmented_page_order  # noqa: E402
from transfer.lanes.cuda_ipc.gather import Gatherer  # noqa: E402
from transfer.lanes.cuda_ipc.plan import build_gather_plan
from transfer.lanes.pages import BufferPair  # noqa: E402


def pairs(dst: DSAKVPool, src: DSAKVPool) -> list[BufferPair]:
    out = []
    for layer in range(dst.layout.layer_num):
        for d, s in ((dst.kv_buffer[layer], src.kv_buffer[layer]), (dst.index_buffer[layer], src.index_buffer[layer])):
            item = dst.layout.kv_page_bytes if d is dst.kv_buffer[layer] else dst.layout.index_page_bytes
            out.append(BufferPair(d.data_ptr(), s.data_ptr(), item, d.nbytes // item, s.nbytes // item))
    return out


class _TorchCopy:
    """A contiguous copy queued with torch, timed like a lane's `Launch`."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.a, self.b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.a.record()
        dst.copy_(src)
        self.b.record()

    def wait(self) -> None:
        self.b.synchronize()

    def seconds(self) -> float:
        return self.a.elapsed_time(self.b) / 1e3


def timed(fn, runs: int) -> tuple[float, float]:
    """Median seconds on the GPU of what `fn` queues, and median host seconds of queueing it."""
    fn().wait()
    gpu, host = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        launch = fn()
        host.append(time.perf_counter() - t0)
        launch.wait()
        gpu.append(launch.seconds())
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    layout = dsa_v32(size=max(args.tokens) * 2 + 4096, device="cuda")
    dst, src = DSAKVPool(layout), DSAKVPool(layout)
    rng = np.random.default_rng(7)
    bufs = pairs(dst, src)
    head = ("tokens", "MB", "block", "warps", "kernel GB/s", "contig GB/s", "ratio", "launch us")
    print("".join(f"{h:>12}" for h in head))
    for n in args.tokens:
        k = n // layout.page_size
        s_pages = fragmented_page_order(np.arange(1, layout.num_pages), rng)[:k]
        d_pages = fragmented_page_order(np.arange(1, layout.num_pages), rng)[:k]
        plan = build_gather_plan(bufs, s_pages, d_pages)
        flat_d, flat_s = dst.slab.view(-1), src.slab.view(-1)
        n_bytes = plan.nbytes
        contig = n_bytes / timed(lambda d=flat_d[:n_bytes], s=flat_s[:n_bytes]: _TorchCopy(d, s), args.runs)[0] / 1e9
        for block in (2048, 4096, 8192):  # the lane picks 4096 x 4 warps, or 8192 x 8 from 1 GiB
            for warps in (4, 8):
                lane = Gatherer(torch.device("cuda:0"), (block, warps), timed=True)
                t, host = timed(lambda lane=lane, plan=plan: lane.launch(plan), args.runs)
                gbps = plan.nbytes / t / 1e9
                cells = (n, plan.nbytes / 1e6, block, warps, gbps, contig)
                print("".join(f"{c:>12.0f}" for c in cells) + f"{gbps / contig:>12.2f}{host * 1e6:>12.1f}")


if __name__ == "__main__":
    main()
