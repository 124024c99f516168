"""The same-host GPU lane over buffers an engine owns (a tensor per layer and kind, as
SGLang's DSA pools allocate them), against a contiguous device copy of as many bytes.

CP=4 owners, each a process holding DeepSeek-V3.2's 61 layers' share as separate CUDA
allocations (latent 656 and indexer 132 bytes a token, pages of 64), a decode in this
process over an `EngineKV` of its own per-layer buffers. Each room is read once, back to
back (rooms published beforehand), three ways: with its ticket; by claims (as a decode
that has no ticket, such as SGLang's receiver, fetched before); and claimed ahead, then
read and released (`RoomLease.read_once`, SGLang's receiver now: the claims are taken at
its bootstrap, the read timed from `send_metadata`). Compare the ticket row with
`bench_fetch.py --device cuda`'s "b2b" column, the pool lane read the same way. Source and
destination pages are drawn as runs of geometric length (mean 4) in a shuffled order.

    python3 scripts/bench_engine_lane.py [--sizes 8192,32768] [--runs 5] [--vmm]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine_owners import Shape, engine_buffers, engine_kv, start_owners, stop_owners  # noqa: E402
from transfer.app.synthetic import fragmented_page_order  # noqa: E402
from transfer.decode import DecodeFetcher  # noqa: E402
from transfer.metadata import RoomTicket  # noqa: E402
from transfer.registry.server import RegistryServer  # noqa: E402
from transfer.results import FetchResult  # noqa: E402

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


def _room(mode: str, tokens: int, run: int) -> int:
    return {"ticket": 0, "claims": 1, "ahead": 2}[mode] * 10**7 + 1000 * tokens // PAGE + run


async def _read(fetcher: DecodeFetcher, mode: str, room: int, src: list, dst: list, reports: dict) -> FetchResult:
    """One read of `room` the way `mode` says, timed from the call that starts it."""
    if mode == "ticket":
        pins = [reports[c][1][room] for c in range(CP)]
        ticket = RoomTicket(engine_id="bench", room=room, src_pages=src, pins=pins)
        return await fetcher.fetch("bench", room, dst, ticket=ticket)
    if mode == "claims":
        return await fetcher.fetch("bench", room, dst)
    lease = await fetcher.claim("bench", room)  # at the receiver's bootstrap, before the pages are known
    t0 = time.perf_counter()
    result = await lease.read_once(dst)
    return msgspec.structs.replace(result, seconds=time.perf_counter() - t0)


async def bench(args: argparse.Namespace) -> None:
    pages = max(args.sizes) // PAGE
    shape = Shape(layers=LAYERS, page_size=PAGE, pages=pages + 8)
    rng = np.random.default_rng(7)
    src = {n: fragmented_page_order(np.arange(pages + 7), rng)[: n // PAGE].tolist() for n in args.sizes}
    dst = {n: fragmented_page_order(np.arange(pages + 7), rng)[: n // PAGE].tolist() for n in args.sizes}
    modes = ("ticket", "claims", "ahead")
    rooms = {_room(m, n, r): src[n] for m in modes for n in args.sizes for r in range(args.runs + 1)}
    unpinned = frozenset(room for room in rooms if room // 10**7 != 0)
    registry = RegistryServer()
    url = await registry.start()
    vmm = tuple(range(CP)) if args.vmm else ()
    procs, stop, reports = await asyncio.to_thread(start_owners, url, "bench", CP, shape, rooms, vmm, unpinned)
    try:
        bufs = engine_buffers(shape, range(LAYERS), fill=False)
        kv = engine_kv(shape, range(LAYERS), bufs)
        slabs = [reports[r][0] for r in range(CP)]
        print(f"owners: CP={CP}, {LAYERS} layers, exported slabs per owner {slabs} (None: not exportable, UCX)")
        head = f"{'tokens':>8} {'MB':>8} {'read':>7} {'path':>9} {'GB/s':>9}"
        print(f"{head} {'copy GB/s':>10} {'x copy':>7} {'p50 ms':>8}")
        async with DecodeFetcher(kv, url, path="auto") as fetcher:
            for n in args.sizes:
                copy = contiguous_copy_gbps(n // PAGE * LAYERS * (shape.kv_item + shape.index_item))
                for mode in modes:
                    seconds, nbytes, paths = [], 0, set()
                    for r in range(args.runs + 1):
                        room = _room(mode, n, r)
                        result = await _read(fetcher, mode, room, src[n], dst[n], reports)
                        if r:  # the first is a warm-up
                            seconds.append(result.seconds)
                        nbytes, paths = result.nbytes, {o.path for o in result.owners}
                    p50 = statistics.median(seconds)
                    gbps = nbytes / p50 / 1e9
                    row = f"{n:>8} {nbytes / 1e6:>8.0f} {mode:>7} {','.join(sorted(paths)):>9} {gbps:>9.1f}"
                    print(f"{row} {copy:>10.1f} {gbps / copy:>7.2f} {p50 * 1e3:>8.2f}")
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
