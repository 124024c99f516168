"""Bare-NIXL reproduction of an owner crash in UCX's TCP transport (no pdkv code involved).

An owner agent exports 256 MiB; a reader on another stand-in host (network namespace,
UCX_TLS=tcp) READs it as DSA-sized descriptors (41,984 bytes) and, half a second in, either
dies (`--mode kill`) or has the link cut under it (`--mode cut`, with the TCP keepalive pdkv
sets). When the owner's endpoint then fails with READ replies still queued, UCX 1.23.0 (the
one bundled with nixl 1.5.1) crashed in `uct_tcp_ep_pending_purge -> ucp_request_send_state_ff
-> ucp_request_memory_dereg`: 1 of 10 cuts and 3 of 10 kills here (2026-11-30). Prints the owner's
exit code per trial (-11: the crash). `--chunk-mb N` READs N MiB at a time, one after
another: 0 of 10 crashed at 4, 16 and 64 MiB (5 of 10 with one READ, the same day). Needs root.

`--owner-env KEY=VAL` (`--reader-env`) sets a variable for the owner (the reader) only, and
`--gdb DIR` runs the owner under gdb and writes its stack and registers at a crash to DIR.
Under gdb the crash is in the IOV branch of `ucp_request_memory_dereg`: the queued requests
are the owner's GET replies, which `ucp_get_req_handler` builds without setting
`req->send.datatype`, so the purge reads whatever the request pool's chunk held there; the
pool's 41 KB chunks came from the reused glibc heap, and a stale value with IOV's class bits
sent it through a garbage `dt_reg`. With `--owner-env MALLOC_MMAP_THRESHOLD_=32768` the
chunks are fresh zeroed mmaps (the field reads CONTIG, the memh the handler cleared, so the
purge has nothing to release): 0 of 10 kills against 2 of 10 without (2026-12-01).
`--owner-env PDKV_HEAP_GUARD=1` has the owner set pdkv's guard (`protect_owner_heap`: UCX's
own allocations zeroed; `=process` the threshold for the whole process instead). The pool's
chunks come from libucs's `ucs_mpool_hugetlb_malloc` -> `ucs_malloc` -> `malloc` through
libucs's own GOT slot, the one the guard points at `calloc`: 0 of 10 kills and 0 of 10 cuts
crashed under it, against 1 of 10 and 7 of 10 without, alternately (2026-12-03). A trial
whose owner dies by any signal prints it, with what UCX's error handler said.

    sudo .venv/bin/python scripts/repro_ucx_tcp_crash.py [--trials 8] [--mode kill|cut]
    sudo .venv/bin/python scripts/repro_ucx_tcp_crash.py --owner-env MALLOC_MMAP_THRESHOLD_=32768 --gdb /tmp/g
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZE = 256 << 20
ITEM = 41_984  # DSA's latent KV bytes per page and layer


def _agent(name: str):  # type: ignore[no-untyped-def]
    from transfer.lanes.ucx.nixl import load_nixl

    nixl = load_nixl()
    return nixl.nixl_agent(name, nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def owner(workdir: Path, seconds: float) -> None:
    import torch

    if "PDKV_HEAP_GUARD" in os.environ:  # pdkv's guard, asked for with --owner-env
        from transfer.lanes.ucx.nixl import protect_owner_heap

        print("heap guard:", protect_owner_heap("cpu"), flush=True)
    agent, buf = _agent("owner"), torch.ones(SIZE, dtype=torch.uint8)
    agent.register_memory([buf])
    (workdir / "meta.tmp").write_bytes(agent.get_agent_metadata())
    (workdir / "addr").write_text(str(buf.data_ptr()))
    (workdir / "meta.tmp").rename(workdir / "meta")
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # progress as an exporter does
        agent.get_new_notifs()
        time.sleep(0.001)


def _read_for(agent, peer: str, local: int, remote: int, count: int, chunk: int, seconds: float):  # type: ignore[no-untyped-def]
    """READ `count` items, `chunk` items a READ one after another (0: all in one), for `seconds`;
    returns the READ in flight at the end."""
    chunk = chunk or count
    end = time.monotonic() + seconds
    first = 0
    while True:
        items = range(first, min(first + chunk, count))
        descs = [(local + i * ITEM, ITEM, 0) for i in items], [(remote + i * ITEM, ITEM, 0) for i in items]
        handle = agent.initialize_xfer(
            "READ", agent.get_xfer_descs(descs[0], "DRAM"), agent.get_xfer_descs(descs[1], "DRAM"), peer
        )
        agent.transfer(handle)
        _progress(agent, handle, end - time.monotonic())  # requests go out as the reader progresses
        if time.monotonic() >= end:
            return handle
        first = (first + chunk) % count


def reader(workdir: Path, cut_netns: str | None, chunk: int) -> None:
    import torch

    agent, buf = _agent("reader"), torch.zeros(SIZE, dtype=torch.uint8)
    agent.register_memory([buf])
    end = time.monotonic() + 30
    while not (workdir / "meta").exists() and time.monotonic() < end:
        time.sleep(0.05)
    peer = agent.add_remote_agent((workdir / "meta").read_bytes())
    base, count = int((workdir / "addr").read_text()), SIZE // ITEM
    handle = _read_for(agent, peer, buf.data_ptr(), base, count, chunk, 0.5)
    if cut_netns is None:
        os._exit(0)  # dies mid-READ
    subprocess.run(["ip", "-n", cut_netns, "link", "set", "eth0", "down"], check=True, timeout=10)
    _progress(agent, handle, 5)  # the keepalive fails the endpoints on both sides
    subprocess.run(["ip", "-n", cut_netns, "link", "set", "eth0", "up"], check=True, timeout=10)
    agent.remove_remote_agent(peer)
    end = time.monotonic() + 5
    while time.monotonic() < end:
        agent.get_new_notifs()
        time.sleep(0.001)
    os._exit(0)


def _progress(agent, handle, seconds: float) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if agent.check_xfer_state(handle) != "PROC":
                return
        except Exception:  # the endpoint failed: what the cut is for
            return
        time.sleep(0.001)


def main() -> None:
    ap = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, description=__doc__.splitlines()[0]
    )
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--mode", choices=("kill", "cut"), default="kill")
    ap.add_argument(
        "--chunk-mb", type=float, default=0, help="READ this many MiB at a time, one after another (0: all at once)"
    )
    ap.add_argument("--chunk-items", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--owner-env", action="append", default=[], metavar="KEY=VAL", help="for the owner only")
    ap.add_argument("--reader-env", action="append", default=[], metavar="KEY=VAL", help="for the reader only")
    ap.add_argument("--gdb", type=Path, help="run the owner under gdb; a crash's stack and registers go here")
    ap.add_argument("--role", choices=("owner", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cut", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "owner":
        return owner(args.workdir, 16)
    if args.role == "reader":
        return reader(args.workdir, args.cut, args.chunk_items)
    from tests.netns import HostNet, unavailable

    if why := unavailable():
        sys.exit(f"repro: {why}")
    codes = []
    env = {**os.environ, "UCX_TLS": "tcp"}
    with HostNet(["owner", "reader"]) as net:
        net.limit("owner", 400)  # the READ must still be running when the reader goes
        for _ in range(args.trials):
            with tempfile.TemporaryDirectory() as tmp:
                chunk = str(int(args.chunk_mb * (1 << 20)) // ITEM)
                me = [sys.executable, __file__, "--workdir", tmp, "--chunk-items", chunk, "--role"]
                own_env = {"UCX_HANDLE_ERRORS": "bt", **env, **dict(kv.split("=", 1) for kv in args.owner_env)}
                gdb: list[str] = []
                if args.gdb:  # the crash's frames and the request's fields, then the exit code gdb reports
                    args.gdb.mkdir(parents=True, exist_ok=True)
                    own_env["UCX_HANDLE_ERRORS"] = "none"
                    gdb = ["gdb", "-q", "-batch", "-ex", "set pagination off", "-ex", "handle SIGPIPE nostop noprint"]
                    gdb += ["-ex", "run", "-ex", "bt 12", "-ex", "info registers", "-ex", "x/8i $pc-16"]
                    gdb += ["-ex", "frame 1", "-ex", "info registers", "-ex", "kill", "--args"]
                log = args.gdb / f"owner{len(codes)}.txt" if args.gdb else Path(tmp) / "owner.log"
                out = open(log, "wb")  # noqa: SIM115
                own_cmd = [*net.exec_prefix("owner"), *gdb, *me, "owner"]
                own = subprocess.Popen(own_cmd, env=own_env, stdout=out, stderr=out)
                cut = ["--cut", net.netns("owner")] if args.mode == "cut" else []
                run = [*net.exec_prefix("reader"), *me, "reader", *cut]
                read_env = {**env, **dict(kv.split("=", 1) for kv in args.reader_env)}
                subprocess.run(run, env=read_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
                codes.append(own.wait(timeout=90))
                out.close()
                text = log.read_text(errors="replace")
                if args.gdb:
                    codes[-1] = -11 if "SIGSEGV" in text else -6 if "SIGABRT" in text else codes[-1]
                if codes[-1] < 0:
                    print(f"trial {len(codes) - 1}: owner died by signal {-codes[-1]}: {_signature(text)}", flush=True)
    how = f"{args.chunk_mb:g} MiB READs one at a time" if args.chunk_mb else "one READ"
    extra = f"; owner env {args.owner_env}" if args.owner_env else ""
    extra += f"; reader env {args.reader_env}" if args.reader_env else ""
    print(f"owner exit codes ({args.mode}, {ITEM}-byte descriptors, {how}, UCX over TCP{extra}): {codes}")
    print(f"crashed (SIGSEGV): {sum(c == -11 for c in codes)} of {len(codes)}")
    print(f"crashed (any signal): {sum(c < 0 for c in codes)} of {len(codes)}")


def _signature(log: str) -> str:
    """What a dead owner's log says of its end: UCX's error line and its first UCX frames."""
    lines = log.splitlines()
    said = [ln.strip() for ln in lines if any(k in ln for k in ("Caught signal", "Assertion", "Fatal", "free()"))]
    frames = [ln.split("(")[1].split(")")[0] for ln in lines if ln.lstrip()[:2].strip().isdigit() and "(" in ln]
    frames = [f for f in frames if f.startswith(("ucp_", "uct_", "ucs_", "ucm_"))][:6]
    found = "; ".join(said[:2]) + (" | " + " < ".join(frames) if frames else "")
    return found or "(no UCX report) " + " / ".join(ln.strip() for ln in lines[-3:])


if __name__ == "__main__":
    main()
