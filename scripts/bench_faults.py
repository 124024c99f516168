"""Failure benchmarks: how fast a fetch fails when an owner dies, and what that costs the
healthy engines.

Two prefill engines (CP=2 each) and one decode. Engine A serves long requests (a stand-in
compute delay per layer keeps them in flight); each repeat SIGKILLs one of A's ranks
mid-request and times kill -> typed error, then restarts A. With tickets (the default) the
decode starts after the prefill, so the kill lands in the prefill and the router sees the
exit; `--overlap` starts both legs at once, so it lands mid-fetch and the decode sees it. Meanwhile a steady
stream of requests runs against engine B; its throughput is reported for a quiet window
and for the window with kills.

    .venv/bin/python scripts/bench_faults.py [--repeats 6] [--preset tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.app.router import Deployment, DeploymentSpec  # noqa: E402


async def healthy_stream(d: Deployment, stop: asyncio.Event, log: list[tuple[float, int]], tokens: int) -> None:
    async def worker() -> None:
        while not stop.is_set():
            out = await d.submit(tokens, engine_id="prefill1")
            if out.ok:
                log.append((time.monotonic(), out.decode.nbytes))

    await asyncio.gather(*(worker() for _ in range(4)))


def rate(log: list[tuple[float, int]], start: float, end: float) -> tuple[float, float]:
    window = [b for t, b in log if start <= t < end]
    span = max(end - start, 1e-9)
    return len(window) / span, sum(window) / span / 1e9


async def bench(args: argparse.Namespace) -> None:
    spec = DeploymentSpec(
        engines=(2, 2),
        decoders=1,
        preset=args.preset,
        prefill_pool_tokens=32768,
        decode_pool_tokens=65536,
        layer_delay=args.layer_delay,
        lease=2.0,
        overlap=args.overlap,
    )
    async with Deployment(spec) as d:
        stop, log = asyncio.Event(), []
        stream = asyncio.create_task(healthy_stream(d, stop, log, args.tokens))
        quiet_start = time.monotonic()
        await asyncio.sleep(args.quiet)
        quiet_end = time.monotonic()
        to_error, kinds = [], []
        for _ in range(args.repeats):
            assert (await d.submit(64, engine_id="prefill0")).ok  # decode has A cached
            victim = asyncio.create_task(d.submit(args.tokens * 4, engine_id="prefill0"))
            await asyncio.sleep(args.layer_delay * 3)
            rank = random.randrange(2)
            child = next(c for c in d.launcher.children if c.name == f"prefill0-cp{rank}")
            t0 = time.monotonic()
            os.kill(child.pid, signal.SIGKILL)
            out = await victim
            to_error.append(time.monotonic() - t0)
            kinds.append(out.error.split(":")[0] if not out.ok else "completed before the kill")
            await d.restart_engine("prefill0")
        faults_end = time.monotonic()
        stop.set()
        await stream
    ms = np.array(to_error) * 1e3
    q_req, q_gb = rate(log, quiet_start, quiet_end)
    f_req, f_gb = rate(log, quiet_end, faults_end)
    where = "mid-fetch (legs overlap)" if args.overlap else "mid-prefill (tickets)"
    print(f"{args.repeats} kills of a CP owner {where} ({args.preset} layout, {args.tokens * 4} tokens)")
    print(
        f"kill -> fetch error: p50 {np.percentile(ms, 50):.1f} ms, p99 {np.percentile(ms, 99):.1f} ms, "
        f"max {ms.max():.1f} ms; errors: {', '.join(sorted(set(kinds)))}"
    )
    print(f"{'healthy engine':<32}{'req/s':>10}{'GB/s':>10}")
    print(f"{'quiet window':<32}{q_req:>10.1f}{q_gb:>10.3f}")
    print(f"{'while the other is killed':<32}{f_req:>10.1f}{f_gb:>10.3f}")
    print(
        f"(the fault window includes restarting the killed engine; mean kill->error "
        f"{statistics.mean(to_error) * 1e3:.1f} ms)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--overlap", action="store_true", help="start the decode with the prefill (no ticket)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layer-delay", type=float, default=0.05)
    ap.add_argument("--quiet", type=float, default=10.0, help="seconds of the no-fault window")
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()
