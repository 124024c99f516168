"""The same-host GPU lane over buffers an engine owns (a tensor per layer and kind, as
SGLang's DSA pools allocate them), against a contiguous device copy of as many bytes.

CP=4 owners, each a process holding DeepSeek-V3.2's 61 layers' share as separate CUDA
allocations (latent 656 and indexer 132 bytes a token, pages of 64), a decode in this
process over an `EngineKV` of its own per-layer buffers. Each room is read once with its
ticket, back to back (rooms published beforehand): compare with `bench_fetch.py --device
cuda`'s "b2b" column, the pool lane read the same way. Source and destination pages are
drawn as runs of geometric length (mean 4) in a shuffled order, as in bench_fetch.

    python3 scripts/bench_engine_lane.py [--sizes 8192,32768] [--runs 5] [--vmm]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine_owners import Shape, engine_buffers, engine_kv, start_owners, stop_owners  # noqa: E402
from transfer.app.synthetic import fragmented_page_order  # noqa: E402
from transfer.bootstrap import RegistryServer  # noqa: E402
from transfer.decode import DecodeFetcher  # noqa: E402
from transfer.metadata import RoomTicket  # noqa: E402

LAYERS, PAGE, CP = 61, 64, 4


def contiguous_copy_gbps(nbytes: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize()
    return nbytes * 5 / (time.perf_counter() - t0) / 1e9


async def bench(args: argparse.Namespace) -> None:
    pages = max(args.sizes) // PAGE
    shape = Shape(layers=LAYERS, page_size=PAGE, pages=pages + 8)
    rng = np.random.default_rng(7)
    src = {n: fragmented_page_order(np.arange(pages + 7), rng)[: n // PAGE].tolist() for n in args.sizes}
    dst = {n: fragmented_page_order(np.arange(pages + 7), rng)[: n // PAGE].tolist() for n in args.sizes}
    rooms = {1000 * n + r: src[n] for n in args.sizes for r in range(args.runs + 1)}
    registry = RegistryServer()
    url = await registry.start()
    vmm = tuple(range(CP)) if args.vmm else ()
    procs, stop, reports = await asyncio.to_thread(start_owners, url, "bench", CP, shape, rooms, vmm)
    try:
        bufs = engine_buffers(shape, range(LAYERS), fill=False)
        kv = engine_kv(shape, range(LAYERS), bufs)
        slabs = [reports[r][0] for r in range(CP)]
        print(f"owners: CP={CP}, {LAYERS} layers, exported slabs per owner {slabs} (None: not exportable, UCX)")
        print(f"{'tokens':>8} {'MB':>8} {'path':>9} {'GB/s':>9} {'copy GB/s':>10} {'x copy':>7} {'p50 ms':>8}")
        async with DecodeFetcher(kv, url, path="auto") as fetcher:
            for n in args.sizes:
                seconds, nbytes, paths = [], 0, set()
                for r in range(args.runs + 1):
                    room = 1000 * n + r
                    pins = [reports[c][1][room] for c in range(CP)]
                    ticket = RoomTicket(engine_id="bench", room=room, src_pages=src[n], pins=pins)
                    result = await fetcher.fetch("bench", room, dst[n], ticket=ticket)
                    if r:  # the first is a warm-up
                        seconds.append(result.seconds)
                    nbytes, paths = result.nbytes, {o.path for o in result.owners}
                p50 = statistics.median(seconds)
                copy = contiguous_copy_gbps(nbytes)
                gbps = nbytes / p50 / 1e9
                path = ",".join(sorted(paths))
                row = f"{n:>8} {nbytes / 1e6:>8.0f} {path:>9} {gbps:>9.1f} {copy:>10.1f} {gbps / copy:>7.2f}"
                print(f"{row} {p50 * 1e3:>8.2f}")
    finally:
        await asyncio.to_thread(stop_owners, procs, stop)
        await registry.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vmm", action="store_true", help="owners on expandable segments (VMM memory)")
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()
