"""Where the time of a same-host GPU lane fetch with a ticket goes (one GPU, CP=4 owners).

Stamps the fetch's steps (entry and exit of the ticket protocol's, the batch's and the
gatherer's methods, where they exist) and prints each one's median time from the fetch's
call, the lane's read (launch to wake, or the kernel's GPU time) and how many callbacks the
loop had queued as the fetch began. Needs a GPU.

    python3 scripts/gpu_profile_ticket.py [--tokens 32768] [--runs 6] [--b2b] [--time-kernels] [--cprofile 25]

`--time-kernels` times the kernel on the GPU (which costs the fetch tens of microseconds);
without it the second row is the lane's read from its launch to its wake-up.

`--cprofile N` also prints the N functions with the most own time over the measured fetches.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import inspect
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from transfer.app.api import PrefillReply, PrefillRequest  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.app.router import Deployment, DeploymentSpec  # noqa: E402
from transfer.app.synthetic import fragmented_allocator  # noqa: E402
from transfer.decode import DecodeFetcher  # noqa: E402


class Stamps:
    """Host times at which wrapped methods were entered and left, by name, for one fetch."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def wrap(self, obj, name: str, label: str = "") -> None:  # type: ignore[no-untyped-def]
        """Stamp `name`'s entry, and its exit once what it returns is awaited where it is an
        awaitable (a coroutine, or the lane's launch handed back by `GatherBatch.read`)."""
        fn, attr = getattr(obj, name), name
        at, name = self.at, label or name

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            # A step called again in one fetch (the context's check, by the prime and the launch)
            # is stamped again as "#2", "#3".
            calls = sum(k.startswith(name) and k.endswith(" in") for k in at)
            label = f"{name} #{calls + 1}" if calls else name
            at[f"{label} in"] = time.perf_counter()
            result = fn(*args, **kwargs)
            if not inspect.isawaitable(result):
                at[f"{label} out"] = time.perf_counter()
                return result

            async def landed():  # type: ignore[no-untyped-def]
                try:
                    return await result
                finally:
                    at[f"{label} out"] = time.perf_counter()

            return landed()

        setattr(obj, attr, timed)


# What is stamped where it exists (a version without one of them still runs): the ticket
# protocol's steps, the batch's and the gatherer's.
WRAPPED = (
    ("tickets", ("launch", "land", "fetch", "read")),
    ("batch", ("start", "read")),
    ("gather", ("prime", "start", "launch_pages", "landed", "run_pages")),
    # The checks before the launch, and each driver call of the prime and the launch.
    ("fetcher", ("page_ids",)),
    ("lane", ("route_pages",)),
    ("kernel", ("enter", "leave", "prime", "launch")),
    ("driver", ("cu_launch", "_cu_launch")),
    ("event", ("record",)),
)


async def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--b2b", action="store_true", help="prefill every room first, then fetch back to back")
    ap.add_argument("--time-kernels", action="store_true", help="time the kernels on the GPU")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    ap.add_argument(
        "--prime-ahead",
        type=float,
        default=0.0,
        metavar="US",
        help="queue the lane's empty kernel this long before each fetch (how much of a fetch is the GPU waking)",
    )
    args = ap.parse_args()
    from transfer.lanes.cuda_ipc.kernel import DriverEvent  # needs CUDA: imported once a GPU run is asked
    from transfer.lanes.cuda_ipc.lane import GatherBatch

    size = max((args.runs + 2) * args.tokens if args.b2b else 3 * args.tokens, 16384)
    spec = DeploymentSpec(engines=(4,), decoders=0, device="cuda", prefill_pool_tokens=size, decode_pool_tokens=size)
    async with Deployment(spec) as d:
        pool = DSAKVPool(dsa_v32(size=size, device="cuda:0"))
        alloc = fragmented_allocator(pool.layout.num_pages, 1)
        async with DecodeFetcher(pool, d.registry_url, lane="cuda_ipc", time_kernels=args.time_kernels) as fetcher:
            stamps = Stamps()
            gather = fetcher._owners.lanes[0]._gather
            objs = {
                "tickets": fetcher._tickets, "batch": GatherBatch, "gather": gather,
                "fetcher": sys.modules["transfer.decode.fetcher"], "lane": sys.modules["transfer.lanes.cuda_ipc.lane"],
                "kernel": gather.kernel, "driver": gather, "event": DriverEvent,
            }  # fmt: skip
            for what, names in WRAPPED:
                for name in names:
                    if hasattr(objs[what], name):
                        stamps.wrap(objs[what], name, f"{what}.{name}")
            rows: list[dict[str, float]] = []
            prof = cProfile.Profile()

            async def prefill(room: int) -> PrefillReply:
                ask = PrefillRequest(room=room, num_tokens=args.tokens)
                return await d.client.request("POST", f"{d.engines[0].intake}/v1/prefill", PrefillReply, ask)

            loop = asyncio.get_running_loop()
            ready = [await prefill(9_000 + i) for i in range(args.runs + 1)] if args.b2b else []
            for i in range(args.runs + 1):
                reply = ready[i] if args.b2b else await prefill(9_000 + i)
                dst = alloc.alloc(len(reply.ticket.src_pages))
                if i and args.cprofile:
                    prof.enable()
                stamps.at.clear()
                if args.prime_ahead:
                    fetcher._owners.lanes[0].prime()
                    until = time.perf_counter() + args.prime_ahead / 1e6
                    while time.perf_counter() < until:
                        pass
                pending = len(getattr(loop, "_ready", ()))  # callbacks the loop runs before this fetch's next turn
                t0 = stamps.at["fetch in"] = time.perf_counter()
                result = await fetcher.fetch("prefill0", reply.ticket.room, dst, ticket=reply.ticket)
                stamps.at["fetch out"] = time.perf_counter()
                prof.disable()
                alloc.free(dst)
                if i:
                    row = {k: 1e6 * (v - t0) for k, v in stamps.at.items()}
                    row["read (GPU)" if args.time_kernels else "read, launch to wake"] = 1e6 * result.read_seconds
                    row["callbacks pending at fetch in"] = pending
                    rows.append(row)
    mode = "back to back, rooms prefilled first" if args.b2b else "each right after its prefill"
    print(f"{args.tokens} tokens, CP=4 owners and the decode on one GPU, ticket fetches through the lane ({mode})")
    print(f"us from the fetch's call, medians of {len(rows)}")
    keys = {k for r in rows for k in r}
    medians = {k: statistics.median(r[k] for r in rows if k in r) for k in keys}
    for k in sorted(keys, key=lambda k: (k.startswith(("read", "callbacks")), medians[k])):
        print(f"{k:<36}{medians[k]:>10.1f}")
    if args.cprofile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)


if __name__ == "__main__":
    asyncio.run(main())
