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
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from tqdm import tqdm

from pdkv import PRESETS
from transfer.app.api import DecodeReply
from transfer.app.launcher import ServiceStartError
from transfer.app.router import Deployment, DeploymentSpec, RequestOutcome
from transfer.app.service import configure_logging
from transfer.app.supervisor import BROADCAST_CTAS, EngineDeath, EngineState, Host
from transfer.timeouts import Timeouts

__all__ = ["main", "Summary"]

# (tokens, weight): mostly short prompts, a long tail up to 32k.
DEFAULT_MIX = "1024:35,2048:25,4096:20,8192:12,16384:5,32768:3"


@dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    failures: int
    verified_bytes: int
    fetched_bytes: int
    wall_seconds: float
    transfer_gbps: float  # fetched bytes / the time a decode had a fetch in flight
    copy_gbps: float  # this machine: one thread copying 256 MiB, for scale
    ttft_p50_ms: float  # request to verified KV in decode
    ttft_p99_ms: float
    fetch_p50_ms: float
    fetch_p99_ms: float
    errors: tuple[str, ...]
    failures_by_cause: dict[str, int] = field(default_factory=dict)  # error class -> requests
    lost_with_engine: int = 0  # failures that were in flight on an engine when it died
    restarts: dict[str, int] = field(default_factory=dict)  # engine -> restarts
    engine_deaths: tuple[str, ...] = ()  # each death and what came of it


def parse_mix(text: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [item.split(":") for item in text.split(",")]
    tokens = np.array([int(t) for t, _ in pairs])
    weights = np.array([float(w) for _, w in pairs])
    return tokens, weights / weights.sum()


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
    )


def render(s: Summary, spec: DeploymentSpec) -> str:
    rows = [
        ("deployment", f"prefill CP {','.join(map(str, spec.engines))} x {spec.decoders} decode, {spec.preset}"),
        ("requests", f"{s.requests} ({s.ok} ok)"),
        ("failures", _failures(s)),
        ("engine restarts", ", ".join(f"{e} {n}" for e, n in s.restarts.items()) or "none"),
        ("verified bytes", f"{s.verified_bytes / 1e9:.2f} GB"),
        ("transfer GB/s (while a fetch was in flight)", f"{s.transfer_gbps:.2f}"),
        ("machine copy GB/s (one thread, for scale)", f"{s.copy_gbps:.2f}"),
        ("TTFT-on-decode p50 / p99", f"{s.ttft_p50_ms:.0f} / {s.ttft_p99_ms:.0f} ms"),
        ("fetch p50 / p99", f"{s.fetch_p50_ms:.0f} / {s.fetch_p99_ms:.0f} ms"),
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
        owner_progress=args.owner_progress_ms / 1e3,
        broadcast_ctas=args.broadcast_ctas,
        max_restarts=args.max_restarts,
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
            summary = summarise(outcomes, wall, copy_bandwidth(), d.deaths, restarts)
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


PROG = "python -m transfer.app"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
EXIT_CODES = """exit codes:
  0    every request verified (one in flight on an engine that died and came back may fail)
  1    a request failed otherwise, a service died or was left down, or one failed to start
       (one line names it and its log; --json then holds that failure)
  2    bad command line: nothing was started
  130  interrupted (Ctrl-C, SIGTERM): every service was stopped"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each flag's help; the description and exit codes kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:  # unset, or a switch: nothing to show
            return action.help
        return super()._get_help_string(action)


def _bad(text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(text)


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _bad(f"expected an integer, got {text!r}") from None
        if value < low:
            raise _bad(f"expected at least {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # what argparse names in its error
    return parse


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _bad(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise _bad(f"expected a number in [0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _bad(f"expected a number, got {text!r}") from None
    if not 0.0 < value < float("inf"):
        raise _bad(f"expected a positive number, got {value}")
    return value


def _engines(text: str) -> tuple[int, ...]:
    """CP sizes, comma separated: `4` or `2,3`."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise _bad(f"expected CP sizes such as 4 or 2,3, got {text!r}") from None
    if any(n < 1 for n in sizes):
        raise _bad(f"a CP size is at least 1, got {text!r}")
    return sizes


def _mix(text: str) -> str:
    """`tokens:weight,...`, checked here so that a typo fails before anything starts."""
    try:
        tokens, weights = parse_mix(text)
    except ValueError:
        raise _bad(f"expected TOKENS:WEIGHT,... such as 1024:3,4096:1, got {text!r}") from None
    if (tokens < 1).any() or not (weights > 0).all():
        raise _bad(f"tokens are at least 1 and weights positive, got {text!r}")
    return text


def _registry(url: str) -> str:
    """An existing registry's URL, checked as its client will read it."""
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise _bad(f"expected http://HOST:PORT, got {url!r}")
        return url
    if parts.scheme == "etcd":
        try:
            from transfer.registry.etcd import etcd_target
        except ImportError:
            raise _bad(f"{url!r} needs the etcd client: pip install 'pdkv[etcd]'") from None
        try:
            etcd_target(url)
        except ValueError as exc:
            raise _bad(str(exc)) from None
        return url
    raise _bad(f"expected http://HOST:PORT or etcd://HOST:PORT[,HOST:PORT...][/PREFIX], got {url!r}")


def _host(text: str) -> Host:
    host = Host.parse(text)
    if not host.address:
        raise _bad(f"expected ADDRESS or NETNS@ADDRESS, got {text!r}")
    return host


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise _bad(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _json_path(text: str) -> str:
    if not Path(text).parent.is_dir():
        raise _bad(f"no directory {str(Path(text).parent)!r} to write {text!r} in")
    return text


def parser() -> argparse.ArgumentParser:
    """The command line: every value is checked here, before any service starts."""
    ap = argparse.ArgumentParser(
        prog=PROG,
        usage="%(prog)s [options]  (see --help)",  # a bad value's error stays a line, not a page
        description=__doc__.split("\n\n")[0],
        epilog=EXIT_CODES,
        formatter_class=_Formatter,
    )
    ap.add_argument(
        "--engines",
        type=_engines,
        default="4",
        metavar="CP[,CP...]",
        help="CP size of each prefill engine, comma separated",
    )
    ap.add_argument("--decoders", type=_int_at_least(1), default=1, metavar="N", help="decode worker processes")
    ap.add_argument(
        "--requests", type=_int_at_least(1), default=200, metavar="N", help="requests to drive through the router"
    )
    ap.add_argument(
        "--concurrency",
        type=_int_at_least(1),
        default=2,
        metavar="N",
        help="requests in flight; the prefill runs them one at a time, so 2 keeps it busy while the decode "
        "fetches the previous one (more only queue at the prefill and pile fetches onto the decode)",
    )
    ap.add_argument(
        "--mix", type=_mix, default=DEFAULT_MIX, metavar="TOKENS:WEIGHT,...", help="prompt lengths as tokens:weight,..."
    )
    ap.add_argument(
        "--prefix-share", type=_fraction, default=0.25, metavar="F", help="fraction of requests with a shared prefix"
    )
    ap.add_argument("--prefixes", type=_int_at_least(1), default=4, metavar="N", help="distinct shared prefixes")
    ap.add_argument(
        "--prefix-tokens", type=_int_at_least(0), default=2048, metavar="N", help="tokens of a shared prefix"
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default="dsa_v32", help="KV layout")
    ap.add_argument(
        "--prefill-pool-tokens", type=_int_at_least(0), default=96 * 1024, metavar="N", help="KV pool per prefill rank"
    )
    ap.add_argument(
        "--decode-pool-tokens", type=_int_at_least(0), default=128 * 1024, metavar="N", help="KV pool per decode"
    )
    ap.add_argument(
        "--device", type=_device, default="cpu", metavar="DEVICE", help="where the pools live: cpu, cuda or cuda:N"
    )
    ap.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the request mix")
    ap.add_argument(
        "--json", type=_json_path, metavar="PATH", help="also write the summary here as JSON (or why the start failed)"
    )
    ap.add_argument("--workdir", metavar="DIR", help="where services' logs go (default: a temp dir)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="WARNING", help="this process's log")
    where = "ADDRESS to bind, or NETNS@ADDRESS to run in that network namespace (a stand-in host; needs root)"
    ap.add_argument(
        "--registry",
        type=_registry,
        metavar="URL",
        help="use this registry (http://HOST:PORT or etcd://HOST:PORT/PREFIX), not a new one",
    )
    ap.add_argument("--registry-host", type=_host, default="127.0.0.1", metavar="HOST", help=where)
    ap.add_argument("--prefill-host", type=_host, default="127.0.0.1", metavar="HOST", help=where)
    ap.add_argument("--decode-host", type=_host, default="127.0.0.1", metavar="HOST", help=where)
    ap.add_argument(
        "--owner-progress-ms",
        type=_positive_float,
        metavar="MS",
        default=Timeouts().ticket_progress_interval * 1e3,
        help="how often a prefill rank drives UCX while a ticket is out: lower it (1) between hosts over TCP",
    )
    ap.add_argument(
        "--broadcast-ctas",
        type=_int_at_least(0),
        default=BROADCAST_CTAS,
        metavar="N",
        help="SMs the prefill's NCCL owner broadcast may take beside compute (0: NCCL's choice)",
    )
    ap.add_argument(
        "--max-restarts",
        type=_int_at_least(0),
        default=3,
        metavar="N",
        help="restarts of each prefill engine after one of its ranks died (the whole CP group restarts; 0: none)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)  # a bad value: one line and exit code 2, nothing started
    configure_logging(args.log_level)  # PDKV_LOG_CONFIG: a logging.config file (JSON lines: docs/deployment.md)
    try:
        sys.exit(asyncio.run(run(args)))
    except (KeyboardInterrupt, asyncio.CancelledError):  # children were stopped on the way out
        sys.exit(130)


if __name__ == "__main__":
    main()
