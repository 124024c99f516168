"""Fetch throughput between stand-in hosts: `bench_fetch.py` with the owners on another host.

Makes two network namespaces joined by a bridge (198.18.0.0/24, removed at the end), runs
the registry and the CP=4 prefill in one and `scripts/bench_fetch.py` (the decode, pdkv and
raw NIXL on the same descriptors) in the other, with UCX held to the transports a host
pair without RDMA has (`--tls`, default tcp). `--mbit` caps each host's sending rate (a
token bucket) to stand in for a slower NIC; `--loss P` drops P% of each host's packets at
random (a tc BPF program: the kernel here has no netem); `--delay MS` holds every packet MS
milliseconds each way (a user-space link, `tests/delay_link.py`, for the same reason; with
it, `--loss` is that link's) and prints what packets were actually held. First, plain TCP from
the prefill host to the decode host on one stream and on four (`scripts/tcp_line.py`): each
size's pdkv GB/s then prints against four streams' too. `--cuts N` then cuts the link under N fetches
(`tests/link_cut.py`) and prints how long each took to fail, and what followed. Needs root.

    sudo .venv/bin/python scripts/bench_hosts.py [--sizes 1024,8192,32768] [--runs 3] [--mbit 10000] [--loss 1]
    sudo .venv/bin/python scripts/bench_hosts.py --delay 1
    sudo .venv/bin/python scripts/bench_hosts.py --sizes 1024 --runs 1 --cuts 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.netns import HostNet, delay_unavailable, loss_unavailable, unavailable  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402


def add_link_options(ap: argparse.ArgumentParser) -> None:
    """The options of the link between the stand-in hosts (`stand_in_hosts`, `run_on_decode`)."""
    ap.add_argument("--tls", default="tcp", help="UCX_TLS for every process (tcp: what a host pair without RDMA has)")
    ap.add_argument("--mbit", type=float, default=None, help="cap each host's sending rate (megabits a second)")
    ap.add_argument("--loss", type=float, default=None, help="drop this percent of each host's packets, at random")
    ap.add_argument("--delay", type=float, default=None, help="hold every packet this many ms each way")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")


@contextlib.contextmanager
def stand_in_hosts(args: argparse.Namespace, script: str) -> Iterator[HostNet]:
    """Hosts "prefill" and "decode" with the link `add_link_options` set (exits saying why
    where they cannot be made); removed at the end."""
    why = delay_unavailable() if args.delay is not None else unavailable() if args.loss is None else loss_unavailable()
    if why:
        sys.exit(f"{script}: {why}")
    with HostNet(["prefill", "decode"]) as net:
        if args.delay is not None:  # the link drops packets itself
            net.delay(args.delay, loss=args.loss or 0.0)
        for host in ("prefill", "decode"):
            net.limit(host, args.mbit)
            if args.delay is None:
                net.lose(host, args.loss)
        yield net


def run_on_decode(net: HostNet, args: argparse.Namespace, cmd: list[str], note: str = "") -> int:
    """Run `cmd` (a script that puts its prefill on `net.where("prefill")`) on the decode host
    with UCX held to `--tls`; print a line of the link, its output, and what the delayed
    link held; its exit status."""
    return run_on_decode_output(net, args, cmd, note)[0]


def run_on_decode_output(net: HostNet, args: argparse.Namespace, cmd: list[str], note: str = "") -> tuple[int, str]:
    """`run_on_decode`, with the command's output as well."""
    cap = f"{args.mbit:g} Mbit/s a host" if args.mbit else "no rate cap"
    cap += f", {args.loss:g}% of packets lost each way" if args.loss else ""
    cap += f", {args.delay:g} ms added each way" if args.delay else ""
    cap += note
    print(f"prefill host {net.address('prefill')}, decode host {net.address('decode')}, UCX_TLS={args.tls}, {cap}")
    sys.stdout.flush()
    env = {**os.environ, "UCX_TLS": args.tls}
    cmd = [*net.exec_prefix("decode"), sys.executable, *cmd]
    run = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.timeout, stdout=subprocess.PIPE, text=True)
    print("\n".join(line for line in run.stdout.splitlines() if "NIXL INFO" not in line))
    if (held := net.delay(None)) is not None:
        print(
            f"delayed link: {held['packets']} packets ({held['lost']} lost), {held['bytes'] / 1e9:.2f} GB, "
            f"held ms: "
            f"min {held['held_min_ms']:.3f}, p50 {held['held_p50_ms']:.3f}, p99 {held['held_p99_ms']:.3f}"
        )
    return run.returncode, run.stdout


def plain_tcp(net: HostNet, streams: int, seconds: float = 3.0) -> float:
    """GB/s of plain TCP from the prefill host to the decode host over `streams` connections."""
    script, port = str(ROOT / "scripts/tcp_line.py"), 5201
    receiver = subprocess.Popen(
        [*net.exec_prefix("decode"), sys.executable, script, "receive", "--port", str(port), "--streams", str(streams)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        json.loads(receiver.stdout.readline())  # listening
        sender = [sys.executable, script, "send", "--host", net.address("decode"), "--port", str(port)]
        sender += ["--streams", str(streams), "--seconds", str(seconds)]
        subprocess.run([*net.exec_prefix("prefill"), *sender], check=True, timeout=seconds + 60)
        out, _ = receiver.communicate(timeout=60)
        return float(json.loads(out.splitlines()[-1])["gbps"])
    finally:
        if receiver.poll() is None:
            receiver.kill()


def pdkv_rates(output: str) -> dict[int, float]:
    """Tokens -> pdkv GB/s, read off `bench_fetch.py`'s table."""
    rates = {}
    for line in output.splitlines():
        cells = line.split()
        if len(cells) > 4 and cells[0].isdigit():
            rates[int(cells[0])] = float(cells[4])
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--runs", type=int, default=3)
    add_link_options(ap)
    ap.add_argument(
        "--owner-progress-ms",
        type=float,
        default=None,
        help="owners drive UCX this often while read (default: 0.5 over TCP)",
    )
    ap.add_argument("--ucx-workers", type=int, default=0, help="the decode's READ threads (0: pdkv's default)")
    ap.add_argument("--cuts", type=int, default=0, help="then cut the link under this many fetches")
    ap.add_argument("--cut-mbit", type=float, default=400, help="rate cap while cutting, so a cut falls mid-READ")
    args = ap.parse_args()
    with stand_in_hosts(args, "bench_hosts") as net:
        cmd = [str(ROOT / "scripts/bench_fetch.py"), "--sizes", args.sizes, "--runs", str(args.runs)]
        cmd += ["--prefill-host", net.where("prefill")]
        if args.ucx_workers:
            cmd += ["--ucx-workers", str(args.ucx_workers)]
        if args.owner_progress_ms is not None:
            cmd += ["--owner-progress-ms", str(args.owner_progress_ms)]
        note = f", owners progress every {args.owner_progress_ms:g} ms" if args.owner_progress_ms else ""
        lines = {n: plain_tcp(net, n) for n in (1, 4)}
        returncode, output = run_on_decode_output(net, args, cmd, note)
        print(f"plain TCP, prefill -> decode: {lines[1]:.2f} GB/s on one stream, {lines[4]:.2f} on four")
        ratios = ", ".join(f"{n}: {gbps / lines[4]:.2f}" for n, gbps in pdkv_rates(output).items())
        print(f"pdkv / four streams of plain TCP, by tokens: {ratios}")
        if returncode or not args.cuts:
            sys.exit(returncode)
        sys.exit(_cuts(net, {**os.environ, "UCX_TLS": args.tls}, args))


def _cuts(net: HostNet, env: dict[str, str], args: argparse.Namespace) -> int:
    net.limit("prefill", args.cut_mbit)
    out = Path(tempfile.mkdtemp()) / "cuts.json"
    cmd = [*net.exec_prefix("decode"), sys.executable, "-m", "tests.link_cut", net.netns("prefill")]
    cmd += [net.address("prefill"), "--trials", str(args.cuts), "--tokens", "8192", "--out", str(out)]
    cmd += ["--restart-crashed"]  # an owner UCX crashes (upstream, see README) is restarted and counted
    run = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.timeout, capture_output=True, text=True)
    if not out.exists():
        print(run.stderr[-3000:])
        return run.returncode or 1
    report = json.loads(out.read_text())
    cuts = report["cuts"]
    seconds = sorted(c["seconds"] for c in cuts if c["seconds"] is not None)
    kinds = sorted({str(c["error"]) for c in cuts})
    print(f"link cut 0.5 s into an 8k-token fetch, {args.cut_mbit:g} Mbit/s cap: {len(cuts)} cuts, errors {kinds}")
    if seconds:
        p99 = seconds[min(len(seconds) - 1, round(0.99 * (len(seconds) - 1)))]
        print(f"cut to error, s: p50 {seconds[len(seconds) // 2]:.2f}, p99 {p99:.2f}, max {seconds[-1]:.2f}")
    print(f"bytes landed after the link was back: {sum(bool(c['landed_late']) for c in cuts)} of {len(cuts)}")
    recovered = sum(bool(c.get("then_clean_fetch_ok")) for c in cuts)
    print(f"byte-exact fetch after reconnecting: {recovered} of {len(cuts)}")
    print(f"owner processes that crashed (SIGSEGV in UCX, restarted): {len(report['crashed'])}: {report['crashed']}")
    if report.get("failed") or report["dead"]:
        print(f"stopped early: {report.get('failed', '')}; services that died: {report['dead']}")
    return 0


if __name__ == "__main__":
    main()
