"""Where the time of a same-host GPU lane fetch with a ticket goes (one GPU, CP=4 owners).

Wraps the fetch's steps with timers and prints, per fetch: the whole fetch, each owner's
time and GPU copy time, the pin READs and the kernel launch wait. Needs a GPU.

    python3 scripts/gpu_profile_ticket.py [--tokens 32768] [--runs 6] [--cprofile 25]

`--cprofile N` also prints the N functions with the most own time over the measured fetches.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from transfer.app.api import PrefillReply, PrefillRequest  # noqa: E402
from transfer.app.router import Deployment, DeploymentSpec  # noqa: E402
from transfer.app.synthetic import fragmented_allocator  # noqa: E402
from transfer.decode import DecodeFetcher  # noqa: E402


def timed(store: list[float], fn):  # type: ignore[no-untyped-def]
    async def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            store.append(time.perf_counter() - t0)

    return wrapper


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    args = ap.parse_args()
    size = max(3 * args.tokens, 16384)
    spec = DeploymentSpec(engines=(4,), decoders=0, device="cuda", prefill_pool_tokens=size, decode_pool_tokens=size)
    async with Deployment(spec) as d:
        pool = DSAKVPool(dsa_v32(size=size, device="cuda:0"))
        alloc = fragmented_allocator(pool.layout.num_pages, 1)
        async with DecodeFetcher(pool, d.registry_url, path="cuda_ipc") as fetcher:
            pins: list[float] = []
            launches: list[float] = []
            fetcher.transport.read_host = timed(pins, fetcher.transport.read_host)
            fetcher._gpu.run = timed(launches, fetcher._gpu.run)
            rows = []
            prof = cProfile.Profile()
            for i in range(args.runs + 1):
                room = 9_000 + i
                ask = PrefillRequest(room=room, num_tokens=args.tokens)
                reply = await d.client.request("POST", f"{d.engines[0].intake}/v1/prefill", PrefillReply, ask)
                dst = alloc.alloc(len(reply.ticket.src_pages))
                pins.clear()
                launches.clear()
                if i and args.cprofile:
                    prof.enable()
                t0 = time.perf_counter()
                result = await fetcher.fetch("prefill0", room, dst, ticket=reply.ticket)
                total = time.perf_counter() - t0
                prof.disable()
                alloc.free(dst)
                if i:
                    gpu = max(o.read_seconds for o in result.owners)
                    rows.append((total, gpu, max(launches, default=0), max(pins, default=0), sum(pins)))
    print(f"{args.tokens} tokens, CP=4 owners and the decode on one GPU, ticket fetch through the lane; ms, medians")
    names = ("fetch", "kernel (GPU)", "launch+wait", "slowest pin READ", "pin READs summed")
    for k, name in enumerate(names):
        print(f"{name:<20}{1e3 * statistics.median(r[k] for r in rows):>10.3f}")
    if args.cprofile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)


if __name__ == "__main__":
    asyncio.run(main())
