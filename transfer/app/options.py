"""The main job's command line: every value checked as it is parsed, before anything starts.

A bad value ends the run with argparse's usage line and one line saying why (exit code 2);
`--help` shows every flag's default and the exit codes.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from pdkv import PRESETS
from transfer.app.launcher import Host
from transfer.app.supervisor import BROADCAST_CTAS
from transfer.timeouts import TCP_PROGRESS_INTERVAL, Timeouts

# (tokens, weight): mostly short prompts, a long tail up to 32k.
DEFAULT_MIX = "1024:35,2048:25,4096:20,8192:12,16384:5,32768:3"


def parse_mix(text: str) -> tuple[np.ndarray, np.ndarray]:
    pairs = [item.split(":") for item in text.split(",")]
    tokens = np.array([int(t) for t, _ in pairs])
    weights = np.array([float(w) for _, w in pairs])
    return tokens, weights / weights.sum()


PROG = "python -m transfer.app"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
EXIT_CODES = """exit codes:
  0    every request verified (one in flight on an engine that died and came back may fail)
  1    a request failed otherwise, a service died or was left down, or one failed to start
       (one line names it and its log; --json then holds that failure)
  2    bad command line: nothing was started
  130  interrupted (Ctrl-C, SIGTERM): every service was stopped"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default after its help, a flag without help too (the scripts' and the
    services' parsers use it as well); none for a value left unset or a switch."""

    @staticmethod
    def _shows_default(action: argparse.Action) -> bool:
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        return bool(action.option_strings) and not unset and "%(default)" not in (action.help or "")

    def _format_action(self, action: argparse.Action) -> str:
        if not (action.help and action.help.strip()) and self._shows_default(action):
            action = copy.copy(action)  # argparse prints nothing after a flag without help
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return f"{action.help} (default: %(default)s)" if self._shows_default(action) else action.help


class _Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The main job's: its description and exit codes kept as written."""


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


def parser(prog: str = PROG, description: str = "The main job: a local PD deployment.") -> argparse.ArgumentParser:
    """The command line: every value is checked here, before any service starts."""
    ap = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [options]  (see --help)",  # a bad value's error stays a line, not a page
        description=description,
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
        default=None,
        help=f"how often a prefill rank drives UCX while its rooms are read (default: {TCP_PROGRESS_INTERVAL * 1e3:g}"
        f" where UCX may serve it over TCP, else {Timeouts().progress_interval * 1e3:g})",
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
    ap.add_argument(
        "--no-tickets",
        dest="tickets",
        action="store_false",
        help="the router carries no ticket: each decode claims its room once the prefill replied (one call "
        "to the arbiter, answered from the claims the engine's other ranks hold for it)",
    )
    return ap
