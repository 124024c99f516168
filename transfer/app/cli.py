"""The main job: a local PD deployment driven by a realistic request mix.

    pdkv-deploy                      # prefill CP=4 + one decode, DSA layout, 200 requests
    pdkv-deploy --engines 2,3 --decoders 2 --requests 500 --json summary.json

Starts a registry, the prefill engines and the decode workers as processes, sends the
requests through the router with bounded concurrency, shows progress, and prints a
summary. A prefill engine that loses a rank is restarted whole (`--max-restarts`) while the
others serve on. Exits non-zero if a request failed for any other reason than being in
flight on an engine that died and came back, or a service is left dead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from transfer.app.api import DecodeReply
from transfer.app.launcher import ServiceStartError
from transfer.app.options import PROG, parse_mix, parser
from transfer.app.router import Deployment, DeploymentSpec, RequestOutcome
from transfer.app.service import configure_logging
from transfer.app.supervisor import EngineDeath, EngineState


@dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    failures: int
    verified_bytes: int
    fetched_bytes: int
    wall_seconds: float
    transfer_gbps: float  # fetched bytes / the time a decode had a fetch in flight
    copy_gbps: float  # the copy the transfer rate is read against (copy_label says which)
    ttft_p50_ms: float  # request to verified KV in decode
    ttft_p99_ms: float
    fetch_p50_ms: float
    fetch_p99_ms: float
    errors: tuple[str, ...]
    failures_by_cause: dict[str, int] = field(default_factory=dict)  # error class -> requests
    lost_with_engine: int = 0  # failures that were in flight on an engine when it died
    restarts: dict[str, int] = field(default_factory=dict)  # engine -> restarts
    engine_deaths: tuple[str, ...] = ()  # each death and what came of it
    copy_label: str = ""  # what copy_gbps measured (`copy_scale`)
    control_messages: int = 0  # the fetches' control messages, in all (a ticket's fetch makes none)


HOST_COPY = "machine copy GB/s (one thread, for scale)"


def copy_scale(device: str, nbytes: int) -> tuple[str, float]:
    """The copy a transfer rate is read against, as the summary names it, and its GB/s.

    Where the pools are on a GPU, the fetch moves device memory, and the host's one-thread
    copy says nothing about that: the device's own copy (torch, device to device) of
    `nbytes`, the bytes a request fetched on average. On the host, one thread's copy."""
    if device.startswith("cuda"):
        size = nbytes or 256 << 20
        return f"device copy GB/s ({device} to itself, {size / 1e6:.0f} MB, for scale)", device_copy_gbps(size, device)
    return HOST_COPY, copy_bandwidth()


def device_copy_gbps(nbytes: int, device: str) -> float:
    """`nbytes` copied within `device` by torch, in GB/s: best of three rounds of five copies."""
    import torch  # the driver of a host run never needs it

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def sync() -> None:
        if src.is_cuda:
            torch.cuda.synchronize(src.device)

    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        sync()
        best = min(best, (time.perf_counter() - t0) / 5)
    return nbytes / best / 1e9


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    """This machine's one-thread copy rate (GB/s, best of three): the scale for transfer rates."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def transfer_seconds(replies: list[DecodeReply]) -> float:
    """Seconds during which a decode worker had at least one fetch in flight, summed over
    workers: concurrent fetches share the lanes, so a rate per fetch would count their
    overlap several times, and the time between fetches (waiting for prefill) not at all
    belongs to the transfer."""
    total = 0.0
    for decoder in {r.decoder for r in replies}:
        spans = sorted((r.fetch_started, r.fetch_started + r.fetch_seconds) for r in replies if r.decoder == decoder)
        end = float("-inf")
        for a, b in spans:
            total += max(0.0, b - max(a, end))
            end = max(end, b)
    return total


def summarise(
    outcomes: list[RequestOutcome],
    wall: float,
    copy_gbps: float = 0.0,
    deaths: list[EngineDeath] | None = None,
    restarts: dict[str, int] | None = None,
    copy_label: str = HOST_COPY,
) -> Summary:
    ok = [o for o in outcomes if o.ok and o.decode is not None]
    replies = [o.decode for o in ok if o.decode is not None]
    ttft = np.array([o.seconds for o in ok]) * 1e3 if ok else np.zeros(1)
    fetch = np.array([r.fetch_seconds for r in replies]) * 1e3 if ok else np.zeros(1)
    fetched = sum(r.nbytes for r in replies)
    return Summary(
        requests=len(outcomes),
        ok=len(ok),
        failures=len(outcomes) - len(ok),
        verified_bytes=sum(r.verified_bytes for r in replies),
        fetched_bytes=fetched,
        wall_seconds=wall,
        transfer_gbps=fetched / max(transfer_seconds(replies), 1e-9) / 1e9,
        copy_gbps=copy_gbps,
        ttft_p50_ms=float(np.percentile(ttft, 50)),
        ttft_p99_ms=float(np.percentile(ttft, 99)),
        fetch_p50_ms=float(np.percentile(fetch, 50)),
        fetch_p99_ms=float(np.percentile(fetch, 99)),
        errors=tuple(o.error for o in outcomes if not o.ok)[:10],
        failures_by_cause=dict(Counter(o.cause or "unknown" for o in outcomes if not o.ok).most_common()),
        lost_with_engine=sum(1 for o in outcomes if not o.ok and o.engine_lost),
        restarts={e: n for e, n in (restarts or {}).items() if n},
        engine_deaths=tuple(d.describe() for d in deaths or ()),
        copy_label=copy_label,
        control_messages=sum(r.control_messages for r in replies),
    )


def render(s: Summary, spec: DeploymentSpec) -> str:
    rows = [
        ("deployment", f"prefill CP {','.join(map(str, spec.engines))} x {spec.decoders} decode, {spec.preset}"),
        ("requests", f"{s.requests} ({s.ok} ok)"),
        ("failures", _failures(s)),
        ("engine restarts", ", ".join(f"{e} {n}" for e, n in s.restarts.items()) or "none"),
        ("verified bytes", f"{s.verified_bytes / 1e9:.2f} GB"),
        ("transfer GB/s (while a fetch was in flight)", f"{s.transfer_gbps:.2f}"),
        (s.copy_label or HOST_COPY, f"{s.copy_gbps:.2f}"),
        ("TTFT-on-decode p50 / p99", f"{s.ttft_p50_ms:.0f} / {s.ttft_p99_ms:.0f} ms"),
        ("fetch p50 / p99", f"{s.fetch_p50_ms:.0f} / {s.fetch_p99_ms:.0f} ms"),
        ("control messages a fetch", f"{s.control_messages / max(s.ok, 1):.2f}"),
        ("wall time", f"{s.wall_seconds:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    deaths = [f"engine died: {d}" for d in s.engine_deaths]
    return "\n".join(lines + deaths + [f"error: {e}" for e in s.errors])


def _failures(s: Summary) -> str:
    if not s.failures:
        return "0"
    causes = ", ".join(f"{cause} {n}" for cause, n in s.failures_by_cause.items())
    lost = f"; {s.lost_with_engine} in flight on an engine that died" if s.lost_with_engine else ""
    return f"{s.failures} ({causes}{lost})"


async def drive(d: Deployment, args: argparse.Namespace) -> list[RequestOutcome]:
    rng = np.random.default_rng(args.seed)
    tokens, weights = parse_mix(args.mix)
    lengths = rng.choice(tokens, size=args.requests, p=weights)
    lengths = np.maximum(1, (lengths * rng.uniform(0.5, 1.0, size=args.requests)).astype(int))
    shared = rng.random(args.requests) < args.prefix_share
    prefix_ids = rng.integers(0, args.prefixes, size=args.requests)
    gate = asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=args.requests, unit="req", disable=args.no_progress, file=sys.stderr)

    async def one(i: int) -> RequestOutcome:
        async with gate:
            pid = int(prefix_ids[i]) if shared[i] else -1
            out = await d.submit(int(lengths[i]), pid, args.prefix_tokens if shared[i] else 0)
        bar.update(1)
        if not out.ok:
            bar.write(f"room {out.room}: {out.error}")
        return out

    try:
        return list(await asyncio.gather(*(one(i) for i in range(args.requests))))
    finally:
        bar.close()


async def run(args: argparse.Namespace) -> int:
    # SIGTERM ends the run like Ctrl-C: the deployment's exit path stops every child.
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    spec = DeploymentSpec(
        engines=args.engines,
        decoders=args.decoders,
        preset=args.preset,
        prefill_pool_tokens=args.prefill_pool_tokens,
        decode_pool_tokens=args.decode_pool_tokens,
        device=args.device,
        log_level=args.log_level,
        registry_host=args.registry_host,
        registry=args.registry,
        prefill_host=args.prefill_host,
        decode_host=args.decode_host,
        owner_progress=None if args.owner_progress_ms is None else args.owner_progress_ms / 1e3,
        broadcast_ctas=args.broadcast_ctas,
        max_restarts=args.max_restarts,
        tickets=args.tickets,
    )
    cps = ",".join(map(str, args.engines))
    print(f"starting: prefill CP {cps} and {args.decoders} decode worker(s) ({args.preset})", file=sys.stderr)
    try:
        async with Deployment(spec, Path(args.workdir) if args.workdir else None) as d:
            t0 = time.perf_counter()
            outcomes = await drive(d, args)
            wall = time.perf_counter() - t0
            await d.recovered()  # an engine that died near the end: its restart's outcome counts
            restarts = {e.engine_id: e.restarts for e in d.engines}
            fetched = [o.decode.nbytes for o in outcomes if o.ok and o.decode is not None]
            label, gbps = copy_scale(spec.device, sum(fetched) // max(len(fetched), 1))
            summary = summarise(outcomes, wall, gbps, d.deaths, restarts, label)
            dead = d.dead_children() + [f"{e.engine_id} (down)" for e in d.engines if e.state is not EngineState.UP]
    except ServiceStartError as exc:  # the log has the traceback; the user needs which and where
        print(f"pdkv: {exc.line()}", file=sys.stderr)
        if args.json:  # a caller reading the file learns why there is no summary
            failed = {"failed_to_start": exc.service, "error": exc.line(), "log": str(exc.log_path)}
            Path(args.json).write_text(json.dumps(failed, indent=2))
        return 1
    print(render(summary, spec))
    for name in dead:
        print(f"service died during the run: {name} (logs in {d.workdir})")
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(summary), indent=2))
    # A request in flight on an engine that died is lost with it; the run is still good if
    # the engine came back and nothing else failed.
    return 0 if summary.failures == summary.lost_with_engine and not dead else 1


def main(argv: list[str] | None = None) -> None:
    # Named as it was started: `python -m transfer.app`, or an entry point's own name.
    prog = PROG if sys.argv[0].endswith("__main__.py") else Path(sys.argv[0]).name
    args = parser(prog, __doc__.split("\n\n")[0]).parse_args(argv)  # bad input: one line, exit 2, nothing started
    configure_logging(args.log_level)  # PDKV_LOG_CONFIG: a logging.config file (JSON lines: docs/deployment.md)
    try:
        sys.exit(asyncio.run(run(args)))
    except (KeyboardInterrupt, asyncio.CancelledError):  # children were stopped on the way out
        sys.exit(130)


if __name__ == "__main__":
    main()
