"""Cut the link between stand-in hosts in the middle of fetches; report what each fetch saw.

Runs inside the decode's namespace (`ip netns exec`, started by `tests/test_hosts.py` or
`scripts/bench_hosts.py --cuts N`): the registry and a CP=4 prefill run on the prefill host,
the decode fetches a room by its ticket, and `--cut-after` seconds into the READ the prefill
host's interface goes down. For each trial it records the error and how long after the cut
it came, whether any destination byte changed once the link was back (a READ abandoned
but still landing), and whether a fresh room then fetches byte for byte. Writes JSON.

    python -m tests.link_cut PREFILL_NETNS PREFILL_ADDRESS --out report.json [--trials 3] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from pdkv import DSAKVPool, PdkvError, dsa_v32
from transfer.app.api import PrefillReply, PrefillRequest
from transfer.app.router import Deployment, DeploymentSpec
from transfer.app.supervisor import Host
from transfer.app.synthetic import RequestContent, request_seed
from transfer.decode import DecodeFetcher

LATE_WATCH_S = 3.0  # how long after the link is back a late READ is given to land
CLEAN_TOKENS = 256  # the room fetched before and after each cut


def _link(netns: str, up: bool) -> None:
    subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "up" if up else "down"], check=True, timeout=10)


class Trials:
    def __init__(self, d: Deployment, fetcher: DecodeFetcher, pool: DSAKVPool, args: argparse.Namespace) -> None:
        self.d, self.fetcher, self.pool, self.args = d, fetcher, pool, args
        self.engine = d.engines[0]
        self.room = 0

    async def _prefill(self, tokens: int) -> tuple[int, PrefillReply]:
        self.room += 1
        ask = PrefillRequest(room=self.room, num_tokens=tokens, ticket=True)
        return self.room, await self.d.client.request("POST", f"{self.engine.intake}/v1/prefill", PrefillReply, ask)

    def _pages(self, reply: PrefillReply) -> np.ndarray:
        return np.arange(len(reply.ticket.src_pages), dtype=np.int64)

    def _snapshot(self, pages: np.ndarray) -> list[torch.Tensor]:
        return [self.pool.kv_slab[:, pages].clone(), self.pool.index_slab[:, pages].clone()]

    async def cut(self) -> dict[str, object]:
        """One fetch with the link cut under it."""
        room, reply = await self._prefill(self.args.tokens)
        pages = self._pages(reply)
        fetch = asyncio.ensure_future(self.fetcher.fetch("prefill0", room, pages, ticket=reply.ticket, timeout=120))
        await asyncio.sleep(self.args.cut_after)
        _link(self.args.netns, up=False)
        cut_at = time.monotonic()
        outcome: dict[str, object] = {"room": room}
        try:
            await fetch
            outcome.update(error=None, seconds=None)  # it finished before the cut
        except PdkvError as exc:
            outcome.update(error=type(exc).__name__, seconds=time.monotonic() - cut_at, message=str(exc)[:300])
        finally:
            before = self._snapshot(pages)
            _link(self.args.netns, up=True)
        await asyncio.sleep(LATE_WATCH_S)
        after = self._snapshot(pages)
        outcome["landed_late"] = not all(torch.equal(a, b) for a, b in zip(before, after))
        return outcome

    async def clean_fetch(self) -> bool:
        """A fresh room, the link up: fetched, then checked byte for byte. A short one: what it
        shows (the owners reconnected, every byte right) needs no room that takes seconds."""
        room, reply = await self._prefill(CLEAN_TOKENS)
        pages = self._pages(reply)
        await self.fetcher.fetch("prefill0", room, pages, ticket=reply.ticket, timeout=120)
        content = RequestContent(request_seed("prefill0", room), CLEAN_TOKENS)
        return not content.mismatched_layers(self.pool, torch.from_numpy(pages))


async def run(args: argparse.Namespace) -> dict[str, object]:
    host = Host(args.netns, args.address)
    pool_tokens = args.tokens * (args.trials + 3) + 4096  # a cut room stays pinned until its pin expires
    spec = DeploymentSpec(
        engines=(4,), decoders=0, prefill_pool_tokens=pool_tokens, registry_host=host, prefill_host=host
    )
    pool = DSAKVPool(dsa_v32(size=args.tokens * 2))
    async with Deployment(spec, args.workdir) as d, DecodeFetcher(pool, d.registry_url) as fetcher:
        trials = Trials(d, fetcher, pool, args)
        cuts: list[dict[str, object]] = []
        report: dict[str, object] = {"first_fetch_ok": await trials.clean_fetch(), "cuts": cuts, "crashed": []}
        while len(cuts) < args.trials:
            try:
                cut = await trials.cut()
                cuts.append(cut)
                cut["then_clean_fetch_ok"] = await trials.clean_fetch()
            except PdkvError as exc:
                dead = await _dead_soon(d)
                if not (args.restart_crashed and dead):
                    report["failed"] = f"{type(exc).__name__}: {exc}"
                    break
                report["crashed"].extend(dead)  # type: ignore[attr-defined]
                await d.restart_engine("prefill0")  # as a deployment's supervisor would
        report["dead"] = d.dead_children()  # services that exited on their own
        return report


async def _dead_soon(d: Deployment, within: float = 5.0) -> list[str]:
    """Services that exited, waiting a little: a crashing process takes a while to go."""
    end = time.monotonic() + within
    while not (dead := d.dead_children()) and time.monotonic() < end:
        await asyncio.sleep(0.1)
    return dead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("netns", help="the prefill host's network namespace")
    ap.add_argument("address", help="the prefill host's address")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cut-after", type=float, default=0.5, help="seconds into the fetch")
    ap.add_argument("--restart-crashed", action="store_true", help="restart an engine that died, and go on")
    ap.add_argument("--workdir", type=Path, help="where the services' logs go (default: a temp dir)")
    ap.add_argument("--out", type=Path, required=True, help="write the JSON report here (UCX logs to stdout)")
    args = ap.parse_args()
    args.out.write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
