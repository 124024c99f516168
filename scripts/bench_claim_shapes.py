"""What a claim round trip costs by its shape, apart from any read (issue 44, item 3).

One prefill engine of CP=4 (tiny layout, four processes) holds a published room; this process
claims it on the owners' claim channels again and again with one token (a claim is idempotent,
so each call is answered at once and grants nothing new), in four shapes, alternating:

  one        a claim on the arbiter alone (the floor: one call, one owner)
  parallel   a claim on each of the four owners at once
  relayed    a claim on the arbiter, which relays it to the other three (`ClaimAll`, today's)
  two-phase  a claim on the arbiter, then on the other three at once

Prints each shape's p10 / p50 / p90 in ms.

    .venv/bin/python scripts/bench_claim_shapes.py [--runs 60]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import DSAKVPool, tiny  # noqa: E402
from transfer.app.api import PrefillReply, PrefillRequest  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.app.router import Deployment, DeploymentSpec  # noqa: E402
from transfer.control import ControlClient  # noqa: E402
from transfer.decode import DecodeFetcher  # noqa: E402
from transfer.metadata import ClaimAll, ClaimAllReply, ClaimRequest, OwnerRef  # noqa: E402
from transfer.timeouts import Timeouts  # noqa: E402

ROOM = 7


async def bench(runs: int) -> dict[str, list[float]]:
    spec = DeploymentSpec(engines=(4,), decoders=0, preset="tiny", prefill_pool_tokens=4096)
    pool = DSAKVPool(tiny(size=8192))
    async with Deployment(spec) as d, DecodeFetcher(pool, d.registry_url, ucx_workers=1) as fetcher:
        engine = d.engines[0]
        await d.client.request(
            "POST", f"{engine.intake}/v1/prefill", PrefillReply, PrefillRequest(room=ROOM, num_tokens=64, ticket=False)
        )
        ranks = sorted((await fetcher.describe(engine.engine_id)).values(), key=lambda r: r.cp_rank)
        urls = [f"{r.control_url}/v1/claims" for r in ranks]
        others = [OwnerRef(cp_rank=r.cp_rank, incarnation=r.incarnation) for r in ranks[1:]]
        ask = ClaimRequest(room=ROOM, consumer_id="shapes", claim=secrets.token_hex(16))
        client = ControlClient(Timeouts())

        async def claim(url: str, relay_to: list[OwnerRef] | None = None) -> None:
            call = ClaimAll(ask=ask, others=relay_to or [], budget_ms=2000)
            fp = pool.layout.fingerprint
            await client.call(url, call, ClaimAllReply, fingerprint=fp, expect_fingerprint=fp, timeout=5)

        async def parallel() -> None:
            await asyncio.gather(*(claim(u) for u in urls))

        async def two_phase() -> None:
            await claim(urls[0])
            await asyncio.gather(*(claim(u) for u in urls[1:]))

        shapes: dict[str, Callable[[], Awaitable[None]]] = {
            "one": lambda: claim(urls[0]),
            "parallel": parallel,
            "relayed": lambda: claim(urls[0], others),
            "two-phase": two_phase,
        }
        took: dict[str, list[float]] = {name: [] for name in shapes}
        try:
            await parallel()  # channels open, the claim held everywhere
            for _ in range(runs):
                for name, shape in shapes.items():
                    t0 = time.perf_counter()
                    await shape()
                    took[name].append((time.perf_counter() - t0) * 1e3)
        finally:
            await client.aclose()
        return took


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=60, help="rounds of the four shapes, alternating")
    args = ap.parse_args()
    took = asyncio.run(bench(args.runs))
    print("CP=4 owners on this host, one published room, the claim held (idempotent calls); ms")
    print(f"{'shape':>10} {'p10':>7} {'p50':>7} {'p90':>7}")
    for name, ms in took.items():
        q = statistics.quantiles(ms, n=10)
        print(f"{name:>10} {q[0]:7.2f} {statistics.median(ms):7.2f} {q[-1]:7.2f}")


if __name__ == "__main__":
    main()
