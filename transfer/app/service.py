"""What every pdkv service process shares: flags, logging set-up, readiness, signals.

A service tells its launcher where it listens by writing its URL to `--ready-file`
(written atomically), so launchers can use port 0 and never race for ports.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import logging.config
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from pdkv.layout import PRESETS
from transfer.logctx import RequestFilter


def add_service_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless told otherwise)")
    ap.add_argument("--port", type=int, default=0, help="listening port (0: any free one)")
    ap.add_argument("--ready-file", type=Path, help="write the service URL here once it listens")
    ap.add_argument(
        "--secret-env", default="PDKV_SECRET", help="environment variable holding the shared secret (unset: none)"
    )
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--die-with-parent", action="store_true", help="exit when the launching process dies (Linux)")


def add_pool_flags(ap: argparse.ArgumentParser, pool_tokens: int) -> None:
    """The KV pool a worker holds."""
    ap.add_argument("--preset", choices=sorted(PRESETS), default="dsa_v32")
    ap.add_argument("--pool-tokens", type=int, default=pool_tokens)
    ap.add_argument("--device", default="cpu")


# A `logging.config.dictConfig` JSON file: where set, it configures every process's logging
# (children inherit it) in place of the text format; docs/logging-json.json writes JSON lines.
LOG_CONFIG_ENV = "PDKV_LOG_CONFIG"


def configure_logging(level: str) -> None:
    """An entry point's logging (the library installs no handler): the file named by
    `PDKV_LOG_CONFIG` if set, else text lines at `level` with the request's fields."""
    path = os.environ.get(LOG_CONFIG_ENV)
    if path:
        with open(path) as f:
            logging.config.dictConfig(json.load(f))
    else:
        logging.basicConfig(
            level=level.upper(), format="%(asctime)s %(process)d %(name)s %(levelname)s %(request)s%(message)s"
        )
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RequestFilter) for f in handler.filters):
            handler.addFilter(RequestFilter())  # engine, room and rank of the request a line is about


def setup_process(args: argparse.Namespace) -> None:
    """For process entry points only: logging (`configure_logging`) and, when launched by a
    supervisor, dying with it."""
    if args.die_with_parent:
        die_with_parent()
    configure_logging(args.log_level)


def secret_from_env(name: str) -> str | None:
    return os.environ.get(name) or None


def announce(ready_file: Path | None, url: str) -> None:
    logging.getLogger("pdkv.service").info("listening on %s", url)
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(url)
        tmp.replace(ready_file)


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM, so that `finally` blocks run and ports are freed."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def die_with_parent() -> None:
    """Get SIGTERM when the launching process dies, however it dies (Linux).

    A launcher killed with SIGKILL runs no cleanup; without this its services would
    live on as orphans holding ports and pinned memory.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent was already gone before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class Service(Protocol):
    async def run(self) -> None: ...


def run_service(args: argparse.Namespace, make: Callable[[argparse.Namespace], Service]) -> None:
    """A service process's main: logging and parent watch first, one torch thread, serve."""
    import torch  # here: the registry and the router, which share this module, never load it

    setup_process(args)
    torch.set_num_threads(1)  # CP ranks and decodes share the host's cores
    asyncio.run(make(args).run())
