"""Does a network fault under pdkv's fetch ever crash an owner? Kills and link cuts, counted.

Two stand-in hosts (network namespaces, UCX held to TCP): the registry and a CP=4 prefill
engine (`transfer.app.prefill_worker`, the owners) on one, on the other a controller that,
for each trial, prefills a room (DSA layout, 8k tokens: 394 MB) and starts a decode process
that reads it with `DecodeFetcher` by its ticket. Some seconds into the READ (the prefill
host's sending capped, so it is still running; what the owners sent by then is recorded)
the controller either SIGKILLs the decode (`kill`) or takes the prefill host's cable out
(`cut`: the decode gets its error, then the cable goes back and the decode closes). Then,
after a settling wait, it checks every owner process: still running, and `/health` answered
on each rank's control endpoint and the engine's intake. An owner that exited is counted
(by signal: a crash; its log's tail kept) and the engine restarted. Every `--verify-every`
trials, and at the end (and after a fault under which the owners sent nothing), a fresh
decode fetches a room with the cap lifted and checks it byte for byte; an engine that fails
it (running, answering /health, serving nothing) is restarted and counted. Owners run with
`UCX_HANDLE_ERRORS=bt` and Python's faulthandler, so a crash leaves its stacks in the log.
Prints one row a mode and writes every trial as JSON, as it goes. Needs root.

    sudo .venv/bin/python scripts/bench_owner_faults.py [--kills 50] [--cuts 50] [--tokens 8192] [--out r.json]

`--post-mib N` sets the decode's bound on what one lane posts at a time (0: pdkv's own), a
control: a huge one stands in for the unbounded READs of before commit 15765c2.
`--owner-env KEY=VAL` (repeatable) sets an environment variable for the prefill host's
processes (the owners, and the registry) and not for the decodes; `--decode-env` the reverse.
See `repro_ucx_tcp_crash.py` for the crash the owners' heap guard is for. pdkv's guard
(`protect_owner_heap`) zeroes UCX's own allocations; `--owner-env PDKV_HEAP_GUARD=process`
sets the whole process's mmap threshold instead, `=0` sets none. Figures: docs/benchmarks.md, "Owner crashes under
faults".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdkv.errors import PdkvError  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402

ENGINE = "prefill0"
_SETTLE_S = 4.0  # after a fault, how long an owner is given to fail its endpoints (keepalive: ~3 s)
_FETCH_TIMEOUT_S = 60.0  # a decode's whole fetch
_LINE_TIMEOUT_S = 90.0  # a decode process's start, or its error after a cut


# ---- the decode process (on the decode host) -----------------------------------------------
async def decode(args: argparse.Namespace) -> int:
    import msgspec
    import numpy as np
    import torch

    import transfer.lanes.ucx.worker as ucx
    from pdkv import DSAKVPool, dsa_v32
    from transfer.app.synthetic import RequestContent, request_seed
    from transfer.decode import DecodeFetcher
    from transfer.metadata import RoomTicket

    if args.post_mib:  # the control: what one lane posts at a time
        ucx._PART_BYTES = int(args.post_mib * (1 << 20))
    ticket = msgspec.msgpack.decode(Path(args.ticket).read_bytes(), type=RoomTicket)
    pool = DSAKVPool(dsa_v32(size=args.tokens * 2))
    pages = np.arange(len(ticket.src_pages), dtype=np.int64)
    async with DecodeFetcher(pool, args.registry) as fetcher:
        print("fetching", flush=True)
        t0 = time.monotonic()
        try:
            await fetcher.fetch(ENGINE, ticket.room, pages, ticket=ticket, timeout=_FETCH_TIMEOUT_S)
        except PdkvError as exc:
            print(f"error {type(exc).__name__} {time.monotonic() - t0:.3f} {str(exc)[:200]!r}", flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the cable is back
            return 1
        bad = RequestContent(request_seed(ENGINE, ticket.room), args.tokens).mismatched_layers(
            pool, torch.from_numpy(pages)
        )
        print(f"done {time.monotonic() - t0:.3f} mismatched_layers={len(bad)}", flush=True)
        return 0 if not bad else 2


# ---- the controller (on the decode host) -----------------------------------------------------
def _tx_bytes(netns: str) -> int:
    out = subprocess.run(["ip", "-n", netns, "-j", "-s", "link", "show", "eth0"], capture_output=True, text=True)
    return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])


def _link(netns: str, up: bool) -> None:
    subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "up" if up else "down"], check=True, timeout=10)


def _limit(netns: str, mbit: float | None) -> None:
    tc = ["ip", "netns", "exec", netns, "tc", "qdisc"]
    subprocess.run([*tc, "del", "dev", "eth0", "root"], capture_output=True, timeout=10)
    if mbit:
        tbf = ["rate", f"{mbit}mbit", "burst", "64kb", "latency", "50ms"]
        subprocess.run([*tc, "add", "dev", "eth0", "root", "tbf", *tbf], check=True, capture_output=True, timeout=10)


class Trials:
    def __init__(self, d, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
        self.d, self.args = d, args
        self.room = 0
        self.rng = random.Random(args.seed)
        self.records: list[dict[str, object]] = []

    @property
    def engine(self):  # type: ignore[no-untyped-def]
        return self.d.engines[0]

    async def _prefill(self) -> Path:
        from transfer.app.api import PrefillReply, PrefillRequest

        self.room += 1
        ask = PrefillRequest(room=self.room, num_tokens=self.args.tokens, ticket=True)
        reply = await self.d.client.request("POST", f"{self.engine.intake}/v1/prefill", PrefillReply, ask)
        import msgspec

        path = self.args.workdir / f"ticket{self.room}"
        path.write_bytes(msgspec.msgpack.encode(reply.ticket))
        return path

    async def _decoder(self, ticket: Path) -> asyncio.subprocess.Process:
        cmd = [sys.executable, __file__, "--role", "decode", "--registry", self.d.registry_url, "--ticket", str(ticket)]
        cmd += ["--tokens", str(self.args.tokens), "--post-mib", str(self.args.post_mib)]
        log = open(self.args.workdir / f"decode{self.room}.log", "wb")  # noqa: ASYNC230, SIM115 - a local file; the child holds it
        owner_only = {kv.split("=", 1)[0] for kv in self.args.owner_env}
        env = {k: v for k, v in os.environ.items() if k not in owner_only}
        env.update(kv.split("=", 1) for kv in self.args.decode_env)
        return await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log, cwd=ROOT, env=env
        )

    async def _line(self, proc: asyncio.subprocess.Process, timeout: float = _LINE_TIMEOUT_S) -> str:
        assert proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
            if not raw:
                return ""
            line = raw.decode(errors="replace").strip()
            if line.split(" ", 1)[0] in ("fetching", "error", "done"):
                return line

    async def fault(self, mode: str) -> dict[str, object]:
        """One fetch, and a fault under it; then the owners checked."""
        t0, netns = time.monotonic(), self.args.prefill_netns
        proc = await self._decoder(await self._prefill())
        rec: dict[str, object] = {"room": self.room, "mode": mode}
        assert await self._line(proc) == "fetching"
        tx0 = _tx_bytes(netns)
        await asyncio.sleep(self.rng.uniform(self.args.fault_after[0], self.args.fault_after[1]))
        rec["mb_before_fault"] = round((_tx_bytes(netns) - tx0) / 1e6, 1)
        rec["finished_first"] = proc.returncode is not None
        if mode == "kill":
            proc.kill()
            await proc.wait()
        else:
            _link(netns, up=False)
            cut_at = time.monotonic()
            try:
                rec["decode_saw"] = await self._line(proc)
                rec["cut_to_error_s"] = round(time.monotonic() - cut_at, 2)
            finally:
                _link(netns, up=True)
            assert proc.stdin is not None
            proc.stdin.write(b"\n")
            await asyncio.wait_for(proc.wait(), _LINE_TIMEOUT_S)
        rec.update(await self._owners_after())
        rec["seconds"] = round(time.monotonic() - t0, 1)
        return rec

    async def _owners_after(self) -> dict[str, object]:
        """Whether every owner survived the fault: running, and answering /health."""
        await asyncio.sleep(_SETTLE_S)
        await self._abort(self.room)
        ranks = [c for c in self.d.launcher.children if c.name.startswith(f"{ENGINE}-")]
        dead = {c.name: c.popen.returncode for c in ranks if not c.alive()}
        urls = [*self.engine.controls, self.engine.intake]
        health = await asyncio.gather(*(self._health(u) for u in urls)) if not dead else [False]
        out: dict[str, object] = {"owner_exits": dead, "health_ok": all(health)}
        if dead:
            out["owner_logs"] = {c.name: c.log_tail(40) for c in ranks if not c.alive()}
            await self.d.restart_engine(ENGINE)
        return out

    async def _health(self, url: str) -> bool:
        try:
            return (await self.d.client.get_json(f"{url}/health")).get("status") == "ok"
        except Exception:  # noqa: BLE001 - any failure is a failed probe
            return False

    async def _abort(self, room: int) -> None:
        """Free the room's pins at once, as a router does for a failed decode leg."""
        urls = [f"{c}/v1/rooms/{room}/abort" for c in self.engine.controls]
        await asyncio.gather(*(self.d.client.request("POST", u) for u in urls), return_exceptions=True)

    async def verify(self) -> dict[str, object]:
        """A fresh decode reads a fresh room whole, the cap lifted: byte for byte. An engine
        that cannot serve it (alive, answering /health, but wedged) is restarted."""
        _limit(self.args.prefill_netns, None)
        t0, proc = time.monotonic(), None
        try:
            proc = await self._decoder(await self._prefill())
            line = await self._line(proc)
            line = await self._line(proc) if line == "fetching" else line
            await asyncio.wait_for(proc.wait(), _LINE_TIMEOUT_S)
        except (asyncio.TimeoutError, PdkvError) as exc:
            line = f"failed: {type(exc).__name__}"
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
        finally:
            _limit(self.args.prefill_netns, self.args.mbit)
        rec: dict[str, object] = {"room": self.room, "mode": "verify", "line": line}
        rec.update(ok=line.endswith("mismatched_layers=0"), seconds=round(time.monotonic() - t0, 1))
        if not rec["ok"]:
            ranks = [c for c in self.d.launcher.children if c.name.startswith(f"{ENGINE}-")]
            rec["owner_logs"] = {c.name: c.log_tail(15) for c in ranks}
            await self.d.restart_engine(ENGINE)
        return rec


async def control(args: argparse.Namespace) -> dict[str, object]:
    from transfer.app.router import Deployment, DeploymentSpec
    from transfer.app.supervisor import Host

    host = Host(args.prefill_netns, args.prefill_address)
    spec = DeploymentSpec(
        engines=(4,),
        decoders=0,
        prefill_pool_tokens=args.tokens * 8 + 4096,  # rooms are aborted after each trial
        pin=60,
        registry_host=host,
        prefill_host=host,
    )
    modes = ["kill"] * args.kills + ["cut"] * args.cuts
    random.Random(args.seed).shuffle(modes)
    t0 = time.monotonic()
    async with Deployment(spec, args.workdir / "services") as d:
        trials = Trials(d, args)
        report = {"records": trials.records, "deaths": [], "seconds": 0.0}

        def keep(record: dict[str, object]) -> None:
            trials.records.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "owner_logs"}), flush=True)
            report.update(deaths=[x.describe() for x in d.deaths], seconds=time.monotonic() - t0)
            if args.out:  # as it goes: a run cut short still leaves its trials
                args.out.write_text(json.dumps(report))

        keep(await trials.verify())
        for i, mode in enumerate(modes, 1):
            try:
                fault = await trials.fault(mode)
            except (PdkvError, asyncio.TimeoutError, AssertionError) as exc:  # the trial could not run
                fault = {"room": trials.room, "mode": mode, "failed": f"{type(exc).__name__}: {exc}"[:300]}
                fault.update(mb_before_fault=0.0, finished_first=False, owner_exits={}, health_ok=False, seconds=0)
            keep(fault)
            # A fault under which the owners sent nothing: are they still serving at all?
            if i % args.verify_every == 0 or i == len(modes) or not fault["mb_before_fault"]:
                keep(await trials.verify())
            if time.monotonic() - t0 > args.budget:
                print(f"stopping: {args.budget:g} s spent after {i} of {len(modes)} trials", flush=True)
                break
        return report


def table(report: dict[str, object], args: argparse.Namespace) -> str:
    """One row a mode: trials, faults that fell mid-READ, owner crashes and other exits."""
    records = report["records"]  # type: ignore[index]
    rows = [
        "| fault | trials | mid-READ | owners' MB sent before it: median, none | owner crashes (signal) "
        "| other owner exits | /health failed | trial failed | decode's error after a cut, s: p50 / max | s a trial |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in ("kill", "cut"):
        rs = [r for r in records if r["mode"] == mode]
        if not rs:
            continue
        mb = sorted(float(r["mb_before_fault"]) for r in rs)
        crashes = sum(any(c is not None and c < 0 for c in r["owner_exits"].values()) for r in rs)
        exits = sum(bool(r["owner_exits"]) for r in rs) - crashes
        failed = sum("failed" in r for r in rs)
        mid = sum(not r["finished_first"] and 0 < float(r["mb_before_fault"]) < args.room_mb for r in rs)
        cut = sorted(float(r["cut_to_error_s"]) for r in rs if "cut_to_error_s" in r)
        cut_s = f"{cut[len(cut) // 2]:.2f} / {cut[-1]:.2f}" if cut else "-"
        per = sum(float(r["seconds"]) for r in rs) / len(rs)
        unhealthy = sum(not r["health_ok"] for r in rs if not r["owner_exits"] and "failed" not in r)
        rows.append(
            f"| {mode} | {len(rs)} | {mid} | {mb[len(mb) // 2]:.0f}, {sum(not m for m in mb)} | {crashes} | {exits} "
            f"| {unhealthy} | {failed} | {cut_s} | {per:.1f} |"
        )
    verified = [r for r in records if r["mode"] == "verify"]
    wedged = [r["room"] for r in verified if not r["ok"]]
    rows.append(
        f"\nbyte-exact fetches between the faults: {sum(bool(r['ok']) for r in verified)} of {len(verified)}; "
        f"failed (engine restarted), rooms: {wedged or 'none'}; {report['seconds']:.0f} s in all; "
        f"engine deaths: {report['deaths'] or 'none'}"
    )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--cuts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--mbit", type=float, default=400, help="the prefill host's sending cap, so a fault falls mid-READ")
    ap.add_argument("--fault-after", type=float, nargs=2, default=(0.5, 3.0), help="seconds into the fetch, drawn")
    ap.add_argument("--verify-every", type=int, default=10)
    ap.add_argument("--post-mib", type=float, default=0, help="a lane's posts at most this many MiB (0: pdkv's)")
    ap.add_argument("--owner-env", action="append", default=[], metavar="KEY=VAL", help="for the owners only")
    ap.add_argument("--decode-env", action="append", default=[], metavar="KEY=VAL", help="for the decodes only")
    ap.add_argument("--budget", type=float, default=3600, help="stop starting trials after this many seconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, help="write every trial as JSON here")
    ap.add_argument("--role", choices=("control", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--registry", help=argparse.SUPPRESS)
    ap.add_argument("--ticket", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-netns", help=argparse.SUPPRESS)
    ap.add_argument("--prefill-address", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "decode":
        sys.exit(asyncio.run(decode(args)))
    if args.role == "control":
        from pdkv import dsa_v32

        layout = dsa_v32(size=args.tokens)
        args.room_mb = -(-args.tokens // layout.page_size) * layout.page_bytes_all_layers / 1e6
        print(table(asyncio.run(control(args)), args))
        return
    _outer(args)


def _outer(args: argparse.Namespace) -> None:
    """Make the hosts, cap the prefill's sending, and run the controller on the decode host."""
    import tempfile

    from tests.netns import HostNet, unavailable

    if why := unavailable():
        sys.exit(f"bench_owner_faults: {why}")
    workdir = Path(tempfile.mkdtemp(prefix="pdkv-owner-faults-"))
    with HostNet(["prefill", "decode"]) as net:
        net.limit("prefill", args.mbit)
        cmd = [*net.exec_prefix("decode"), sys.executable, __file__, *sys.argv[1:], "--role", "control"]
        cmd += ["--workdir", str(workdir), "--prefill-netns", net.netns("prefill")]
        cmd += ["--prefill-address", net.address("prefill")]
        print(
            f"{args.kills} kills, {args.cuts} cuts of an {args.tokens}-token fetch; prefill host sends at "
            f"{args.mbit:g} Mbit/s; UCX_TLS=tcp; owner env {args.owner_env}; decode env {args.decode_env}; "
            f"post MiB {args.post_mib or 'pdkv'}; logs in {workdir}",
            flush=True,
        )
        # A crashing owner prints its native and Python stacks into its log (kept in the report).
        env = {"UCX_HANDLE_ERRORS": "bt", "PYTHONFAULTHANDLER": "1", **os.environ, "UCX_TLS": "tcp"}
        env.update(kv.split("=", 1) for kv in args.owner_env)  # the controller's children: the owners
        env["PYTHONPATH"] = str(ROOT)
        sys.exit(subprocess.run(cmd, env=env, cwd=ROOT).returncode)


if __name__ == "__main__":
    main()
