"""A prefill engine that comes back on another host: do decodes find it there?

Runs inside the decode's namespace (`tests/test_hosts.py` starts it): the registry on a host
of its own, the prefill engine on host A, a decode worker here. After a request, the engine
is stopped and started again on host B, with another address (as a restarted pod would
get); requests then must reach it there, through the registry, byte for byte. Writes JSON.

    python -m tests.host_move REGISTRY_HOST HOST_A HOST_B --out report.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

from transfer.app.router import Deployment, DeploymentSpec
from transfer.app.supervisor import Host


async def run(args: argparse.Namespace) -> dict[str, object]:
    spec = DeploymentSpec(
        engines=(2,),
        decoders=1,
        preset="tiny",
        prefill_pool_tokens=8192,
        decode_pool_tokens=8192,
        registry_host=Host.parse(args.registry_host),
        prefill_host=Host.parse(args.host_a),
        decode_host=Host.parse(args.decode_host),
    )
    async with Deployment(spec) as d:
        before = [await d.submit(n) for n in (200, 900)]
        old_controls = list(d.engines[0].controls)
        d.spec = dataclasses.replace(d.spec, prefill_host=Host.parse(args.host_b))
        await d.restart_engine("prefill0")
        after = [await d.submit(n) for n in (300, 1000)]
        return {
            "before": [o.ok for o in before],
            "after": [o.ok for o in after],
            "errors": [o.error for o in (*before, *after) if not o.ok],
            "controls_before": old_controls,
            "controls_after": list(d.engines[0].controls),
            "dead": d.dead_children(),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("registry_host", help="NETNS@ADDRESS")
    ap.add_argument("host_a", help="NETNS@ADDRESS: where the engine starts")
    ap.add_argument("host_b", help="NETNS@ADDRESS: where it comes back")
    ap.add_argument("decode_host", help="NETNS@ADDRESS: this namespace")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.write_text(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
