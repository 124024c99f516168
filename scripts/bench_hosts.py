"""Fetch throughput between stand-in hosts: `bench_fetch.py` with the owners on another host.

Makes two network namespaces joined by a bridge (198.18.0.0/24, removed at the end), runs
the registry and the CP=4 prefill in one and `scripts/bench_fetch.py` (the decode, pdkv and
raw NIXL on the same descriptors) in the other, with UCX held to the transports a host
pair without RDMA has (`--tls`, default tcp). `--mbit` caps each host's sending rate (a
token bucket) to stand in for a slower NIC. Needs root.

    sudo .venv/bin/python scripts/bench_hosts.py [--sizes 1024,8192,32768] [--runs 3] [--mbit 10000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.netns import HostNet, unavailable  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for every process (tcp: what a host pair without RDMA has)")
    ap.add_argument("--mbit", type=float, default=None, help="cap each host's sending rate (megabits a second)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    args = ap.parse_args()
    why = unavailable()
    if why:
        sys.exit(f"bench_hosts: {why}")
    with HostNet(["prefill", "decode"]) as net:
        for host in ("prefill", "decode"):
            net.limit(host, args.mbit)
        prefill = f"{net.netns('prefill')}@{net.address('prefill')}"
        cmd = [*net.exec_prefix("decode"), sys.executable, str(ROOT / "scripts/bench_fetch.py")]
        cmd += ["--sizes", args.sizes, "--runs", str(args.runs), "--prefill-host", prefill]
        env = {**os.environ, "UCX_TLS": args.tls}
        cap = f"{args.mbit:g} Mbit/s a host" if args.mbit else "no rate cap"
        print(f"prefill host {net.address('prefill')}, decode host {net.address('decode')}, UCX_TLS={args.tls}, {cap}")
        sys.stdout.flush()
        run = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.timeout, stdout=subprocess.PIPE, text=True)
        print("\n".join(line for line in run.stdout.splitlines() if "NIXL INFO" not in line))
        sys.exit(run.returncode)


if __name__ == "__main__":
    main()
