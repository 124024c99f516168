"""Services forked from a server that imported their heavy modules once, rather than fresh
interpreters that each import torch, aiohttp and pdkv again (most of a rank's CPU at its start,
and of a restart's delay).

The server is multiprocessing's forkserver: a process started once, which imports `PRELOAD`
and then forks a child per service. Nothing it imports starts a thread or loads NIXL, so no
child inherits UCX's state (UCX reads its settings as it loads, in the child, from the
environment the launcher gave it). A child then runs its service's module as `python -m` would,
in its own session, with the launcher's environment, its log on stdout and stderr, and
its command line where `ps` looks (`setproctitle`).

`PDKV_LAUNCH=exec` starts every service as a fresh interpreter instead; services on another
host (a network namespace) are always started so.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
from multiprocessing.process import BaseProcess
from typing import Any

import setproctitle

# What every service imports and nothing of which starts a thread or loads NIXL.
PRELOAD = [
    "aiohttp",
    "msgspec",
    "numpy",
    "torch",
    "torch.distributed",
    "transfer.prefill.exporter",
    "transfer.decode.fetcher",
]


def enabled() -> bool:
    """Whether services on this host are forked (`PDKV_LAUNCH`, default fork where Linux has it)."""
    mode = os.environ.get("PDKV_LAUNCH", "fork").lower()
    return mode != "exec" and sys.platform.startswith("linux")


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    # One forkserver a process: where its user (a test harness) named what to preload, keep
    # that; else (multiprocessing's default, the main module) preload the services' modules.
    if multiprocessing.forkserver._forkserver._preload_modules == ["__main__"]:  # type: ignore[attr-defined]
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


class ForkedService:
    """A service forked from the forkserver, seen through `subprocess.Popen`'s face (the
    part a launcher uses: `pid`, `poll`, `wait`, `returncode`). A daemon, to multiprocessing:
    stopped if the launching process exits without stopping it."""

    def __init__(self, module: str, argv: list[str], env: dict[str, str], log_path: str) -> None:
        self._process: BaseProcess = _context().Process(  # type: ignore[attr-defined]
            target=_serve, args=(module, argv, env, log_path), name=module, daemon=True
        )
        self._process.start()

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return None if self._process.is_alive() else self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        return self._process.exitcode


def _serve(module: str, argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the child: what `subprocess.Popen([python, -m, module, *argv], start_new_session=True)`
    with stdin from /dev/null and stdout and stderr to the log would have set up, then the module."""
    os.setsid()
    # The forkserver lives while any process holds this pipe's end, which each of its children
    # inherits: a service must not, or one whose launcher was killed would keep its parent,
    # the forkserver, alive, and so never get the SIGTERM that `--die-with-parent` arranged.
    server: Any = multiprocessing.forkserver._forkserver  # its fields are multiprocessing's own
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    stdin = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd, to in ((stdin, 0), (log, 1), (log, 2)):
        os.dup2(fd, to)
    os.close(stdin)
    os.close(log)
    # What `ps` and /proc/PID/cmdline show: the service's own line, not the forkserver's.
    # Before the environment changes: setproctitle finds the room it writes in from it.
    setproctitle.setproctitle(" ".join([sys.executable, "-m", module, *argv]))
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
