"""A fetch by claims against one by ticket: what a decode without a router pays (issue 44).

DSA-shaped layout, one prefill engine of CP=4 (four processes) and the decode in this
process, as `scripts/bench_fetch.py`. For each size and run, two rooms are prefilled, then
one is fetched with its ticket and the other by claims (no ticket, nothing claimed ahead),
in alternating order, so that both meet the same load. Each control request the claims
fetch makes is timed where the decode sends it: the table gives the p50 of each path,
the median of the paired differences (claims minus ticket, run by run), the same up to
the room's read (both paths read a whole room alike, `TicketProtocol.read`: the difference
without the noise of a large room's copy), the control
requests a claims fetch makes, and how long its requests took: from the fetch's call to
its first request's answer (the arbiter's claim), to its last claim's answer, and the
control requests still in flight after that (releases, polls); and the arbiter's relay of
the claims to the other ranks, as its `/metrics` timed it (`pdkv_claim_relay_seconds`, each
claims fetch's own), which the claims done wait for; and the share of claims fetches the
arbiter answered from the claims the other ranks held for it, with no relay ("held",
`transfer.prefill.held`; `--no-held-claims`: none held, every claim relayed). Medians over
--runs after a warm-up.

    .venv/bin/python scripts/bench_claims.py [--sizes 64,1024,8192,32768] [--runs 15] [--no-held-claims]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_MODULES", "^ib")

from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from tests.scrape import histogram_totals  # noqa: E402
from transfer.app.api import PrefillReply, PrefillRequest  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.app.router import Deployment, DeploymentSpec  # noqa: E402
from transfer.app.synthetic import fragmented_allocator  # noqa: E402
from transfer.control import ControlClient  # noqa: E402
from transfer.decode import DecodeFetcher  # noqa: E402
from transfer.decode.tickets import TicketProtocol  # noqa: E402

Sent = tuple[str, float, float]  # (what: claim, release, poll...), sent, answered (perf_counter)


def record_owner_requests(log: list[Sent]) -> Callable[[], None]:
    """Time every control request to an owner's rooms (`/v1/rooms/...`) into `log`; returns the undo."""
    original, original_call = ControlClient.request, ControlClient.call

    async def timed(self: ControlClient, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        sent = time.perf_counter()
        try:
            return await original(self, method, url, *args, **kwargs)
        finally:
            if "/v1/rooms/" in url and "/v1/prefill" not in url:
                tail = url.rsplit("/", 1)[-1].split("?")[0]
                log.append((tail if tail in ("claim", "release", "abort") else "poll", sent, time.perf_counter()))

    async def timed_call(self: ControlClient, url: str, *args: Any, **kwargs: Any) -> Any:
        sent = time.perf_counter()
        try:
            return await original_call(self, url, *args, **kwargs)
        finally:
            if url.endswith("/v1/claims"):  # a claim on the owners' channel (the arbiter's: on every owner)
                log.append(("claim", sent, time.perf_counter()))

    ControlClient.request = timed  # type: ignore[method-assign]
    ControlClient.call = timed_call  # type: ignore[method-assign]

    def undo() -> None:
        ControlClient.request = original  # type: ignore[method-assign]
        ControlClient.call = original_call  # type: ignore[method-assign]

    return undo


def record_read_starts(starts: list[float]) -> Callable[[], None]:
    """Note when each read of a whole room begins (`TicketProtocol.read`, which both paths
    take), into `starts`; returns the undo."""
    original = TicketProtocol.read

    async def noted(self: TicketProtocol, *args: Any, **kwargs: Any) -> Any:
        starts.append(time.perf_counter())
        return await original(self, *args, **kwargs)

    TicketProtocol.read = noted  # type: ignore[method-assign]
    return lambda: setattr(TicketProtocol, "read", original)


async def relay_seconds(d: Deployment) -> tuple[float, float]:
    """The arbiter's relays so far, as its `/metrics` says: (count, seconds in all)."""
    text = await d.client.get_text(f"{d.engines[0].controls[0]}/metrics")
    return histogram_totals(text, "pdkv_claim_relay_seconds", outcome="ok")


async def bench(args: argparse.Namespace) -> None:
    pool_tokens = 4 * max(args.sizes) + 4096  # room for the rooms still being freed
    spec = DeploymentSpec(
        engines=(4,),
        decoders=0,
        preset="dsa_v32",
        prefill_pool_tokens=pool_tokens,
        device="cpu",
        hold_claims=args.held_claims,
    )
    pool = DSAKVPool(dsa_v32(size=pool_tokens, device="cpu"))
    pool.slab.fill_(1)  # first-touch faults are not transfer cost
    alloc = fragmented_allocator(pool.layout.num_pages, 7)
    log: list[Sent] = []
    reads: list[float] = []
    undo, undo_reads = record_owner_requests(log), record_read_starts(reads)
    rows = []
    try:
        async with Deployment(spec) as d, DecodeFetcher(pool, d.registry_url, lane="ucx") as fetcher:
            engine = d.engines[0]

            async def prefill(room: int, n: int, ticket: bool) -> PrefillReply:
                ask = PrefillRequest(room=room, num_tokens=n, consumers=1, ticket=ticket)
                reply = await d.client.request("POST", f"{engine.intake}/v1/prefill", PrefillReply, ask)
                assert reply is not None
                return reply

            for n in args.sizes:
                relays = lambda: relay_seconds(d)  # noqa: E731
                rows.append((n, await bench_size(fetcher, prefill, relays, alloc, log, reads, n, args.runs)))
    finally:
        undo()
        undo_reads()
    print_table(rows, args)


async def bench_size(
    fetcher: DecodeFetcher,
    prefill: Callable[[int, int, bool], Awaitable[PrefillReply]],
    relays: Callable[[], Awaitable[tuple[float, float]]],
    alloc: Any,
    log: list[Sent],
    reads: list[float],
    n: int,
    runs: int,
) -> dict[str, list[float]]:
    keys = ("ticket", "claims", "diff", "to_read", "msgs", "first", "claimed", "relay", "after", "held")
    s: dict[str, list[float]] = {k: [] for k in keys}
    dst = alloc.alloc(max(1, n // 64))
    try:
        for i in range(runs + 1):  # the first is a warm-up
            relayed = await relays()  # scraped before the prefills: the fetches find the arbiter as they would
            room = (n << 20) + 2 * i
            reply = await prefill(room, n, True)
            await prefill(room + 1, n, False)
            took: dict[str, float] = {}
            to_read: dict[str, float] = {}
            for mode in ("ticket", "claims") if i % 2 else ("claims", "ticket"):
                log.clear()
                reads.clear()
                t0 = time.perf_counter()
                if mode == "ticket":
                    result = await fetcher.fetch("prefill0", room, dst, ticket=reply.ticket)
                else:
                    result = await fetcher.fetch("prefill0", room + 1, dst)
                    claims = [a for what, _, a in log if what == "claim"]
                    s["msgs"].append(result.control_messages)
                    s["held"].append(float(result.control_messages == 1))  # one call, nothing relayed
                    s["first"].append(min(a for _, _, a in log) - t0)
                    s["claimed"].append(max(claims) - t0)
                    s["after"].append(sum(1 for what, *_ in log if what != "claim"))
                took[mode] = result.seconds
                to_read[mode] = reads[0] - t0 if reads else float("nan")
            count, seconds = await relays()
            if i and count == relayed[0] + 1:  # the claims fetch's one relay
                s["relay"].append(seconds - relayed[1])
            if i:
                s["ticket"].append(took["ticket"])
                s["claims"].append(took["claims"])
                s["diff"].append(took["claims"] - took["ticket"])
                s["to_read"].append(to_read["claims"] - to_read["ticket"])
    finally:
        alloc.free(dst)
    return s


def print_table(rows: list[tuple[int, dict[str, list[float]]]], args: argparse.Namespace) -> None:
    print(
        f"DSA layout, CP=4 owners on cpu, decode on cpu, {args.runs} runs after a warm-up, ticket and claims "
        "fetches alternating; medians (ms)"
    )
    head = ["tokens", "ticket p50", "claims p50", "claims-ticket", "to the read", "ctl msgs", "1st answer"]
    head += ["claims done"]
    head += ["relay", "after", "held"]
    print("".join(f"{h:>14}" for h in head))
    for n, s in rows:
        med = {k: statistics.median(v) if v else float("nan") for k, v in s.items()}
        cells = [f"{n:>14}"] + [f"{1e3 * med[k]:>14.2f}" for k in ("ticket", "claims", "diff", "to_read")]
        cells += [f"{med['msgs']:>14.0f}"] + [f"{1e3 * med[k]:>14.2f}" for k in ("first", "claimed", "relay")]
        cells += [f"{med['after']:>14.0f}", f"{statistics.fmean(s['held']) if s['held'] else 0.0:>14.2f}"]
        print("".join(cells))
    print(
        "to the read: claims - ticket, paired, from the call to the room's read (the same read on both paths: "
        "without its copy's noise); 1st answer / claims done: from the claims fetch's call; relay: the arbiter's, "
        "to the other ranks (its /metrics); after: control requests after the claims; held: the share answered "
        "from held claims"
    )


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument(
        "--no-held-claims", dest="held_claims", action="store_false", help="the ranks hold no claims: all relayed"
    )
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()
