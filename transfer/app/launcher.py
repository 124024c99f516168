"""Starting and stopping pdkv service processes on one machine.

Services are forks of a server that imported their heavy modules and nothing that touches
UCX (`transfer.app.forked`), or fresh interpreters (`python -m ...`) on another host: never
forks of a process that has initialised UCX, which must not fork and use UCX in the child.
Each child gets its own process group so a stop reaches everything it started, and tells us its URL via a ready file.
A child counts as ready once that file is written and every URL in it answers `GET /ready`
with 200: listening is not serving (a prefill rank that listens may not be registered, or
its UCX transport may be down; `/health` says only that the process answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdkv.errors import DeadlineExceeded, PdkvError, PeerLostError
from transfer.app import forked

logger = logging.getLogger(__name__)

_PROBE_S = 1.0  # the most one `GET /ready` may take before it is asked again
_PROBE_PAUSE_S = 0.05  # between probes of a service that is not ready yet


@dataclass(frozen=True)
class Host:
    """Where a service runs: a network namespace (None: this one) and the address it binds.

    Namespaces stand in for separate machines (tests and benchmarks of the path between
    hosts); entering one needs root.
    """

    netns: str | None = None
    address: str = "127.0.0.1"

    @classmethod
    def parse(cls, text: str) -> Host:
        """`ADDRESS` or `NETNS@ADDRESS`."""
        netns, _, address = text.rpartition("@")
        return cls(netns or None, address)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes] | forked.ForkedService
    ready_file: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class ServiceStartError(PdkvError):
    """A service that exited or did not get ready while starting. `line()` is what a user
    needs (which service, why, where its log is); the message adds the log's tail."""

    def __init__(self, child: Child, reason: str) -> None:
        super().__init__(f"{child.name} {reason}:\n{child.log_tail()}")
        self.service, self.reason, self.log_path = child.name, reason, child.log_path
        self.peer = child.name  # PeerLostError's field, where this is one

    def line(self) -> str:
        last = next((ln.strip() for ln in reversed(self.args[0].splitlines()) if ln.strip()), "")
        why = f"{self.reason} ({last})" if last and not last.startswith(self.service) else self.reason
        return f"{self.service} failed to start: {why}; its log: {self.log_path}"


class ServiceExited(ServiceStartError, PeerLostError):
    """The service exited before it was ready."""


class ServiceNotReady(ServiceStartError, DeadlineExceeded):
    """The service did not get ready within its start timeout."""


class Launcher:
    """Owns the child processes of a deployment and their logs under `workdir`."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.children: list[Child] = []
        self._spawned: set[str] = set()

    def spawn(self, name: str, module: str, args: list[str], prefix: Sequence[str] = ()) -> Child:
        """Start `python -m module args`; `prefix` goes before it (`ip netns exec NS`: on another host)."""
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        again = name in self._spawned  # a restart: keep what the dead one logged, above
        self._spawned.add(name)
        with open(log_path, "ab" if again else "wb") as log:
            if again:
                log.write(f"---- {name} restarted ----\n".encode())
                log.flush()
        argv = [*args, "--ready-file", str(ready), "--die-with-parent"]
        popen: subprocess.Popen[bytes] | forked.ForkedService
        if not prefix and forked.enabled():
            popen = forked.ForkedService(module, argv, self.env, str(log_path))
        else:
            with open(log_path, "ab") as log:
                popen = subprocess.Popen(
                    [*prefix, sys.executable, "-m", module, *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
        child = Child(name, popen, ready, log_path)
        self.children.append(child)
        logger.info("started %s (pid %d)", name, popen.pid)
        return child

    async def wait_ready(self, child: Child, timeout: float) -> str:
        """The child's ready-file content, once written and each URL in it (`ready_urls`)
        answers `/ready`; fails fast if the child died."""
        deadline = time.monotonic() + timeout
        while not child.ready_file.exists():
            if not child.alive():
                raise ServiceExited(child, f"exited with {child.popen.returncode}")
            if time.monotonic() > deadline:
                raise ServiceNotReady(child, f"not ready within {timeout:.0f}s")
            await asyncio.sleep(0.05)
        text = child.ready_file.read_text()
        async with aiohttp.ClientSession() as session:
            for url in ready_urls(text):
                await _until_ready(session, child, url, deadline, timeout)
        return text

    async def all_ready(self, children: list[Child], timeout: float) -> list[str]:
        """Each child's ready-file content; the first failure ends the wait for all of them."""
        waits = [asyncio.ensure_future(self.wait_ready(c, timeout)) for c in children]
        try:
            return list(await asyncio.gather(*waits))
        finally:
            for w in waits:
                w.cancel()

    async def stop_some(self, children: list[Child], grace: float, hang_expected: bool = False) -> None:
        """Stop these children and forget them."""
        await asyncio.gather(*(self.stop(c, grace, hang_expected) for c in children))
        self.children = [c for c in self.children if c not in children]

    async def stop(self, child: Child, grace: float, hang_expected: bool = False) -> int:
        """SIGTERM, then SIGKILL after `grace` seconds; returns the exit code. `hang_expected`:
        a rank whose CP peer died may sit in a collective; its kill is no news."""
        if child.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while child.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if child.alive():
            level = logging.INFO if hang_expected else logging.WARNING
            logger.log(level, "%s ignored SIGTERM for %.0fs; killing it", child.name, grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # also reaps anything it left in its group
        return child.popen.wait()

    async def stop_all(self, grace: float = 10.0) -> dict[str, int]:
        codes = await asyncio.gather(*(self.stop(c, grace) for c in reversed(self.children)))
        return {c.name: code for c, code in zip(reversed(self.children), codes)}


def ready_urls(text: str) -> list[str]:
    """The service URLs a ready file names: the file's text, or each URL of its JSON object
    (a prefill rank's control endpoint and, on rank 0, its intake)."""
    if not text.startswith("{"):
        return [text]
    return [url for url in json.loads(text).values() if isinstance(url, str) and url]


async def _until_ready(session: aiohttp.ClientSession, child: Child, url: str, deadline: float, timeout: float) -> None:
    """Until `url`'s `/ready` answers 200; `ServiceNotReady` with its last reason at `deadline`."""
    why = "no answer"
    while True:
        if not child.alive():
            raise ServiceExited(child, f"exited with {child.popen.returncode}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServiceNotReady(child, f"{url} not ready within {timeout:.0f}s: {why}")
        try:
            limit = aiohttp.ClientTimeout(total=min(_PROBE_S, left))
            async with session.get(f"{url}/ready", timeout=limit) as resp:
                if resp.status == 200:
                    return
                why = f"{resp.status}: {(await resp.text())[:200]}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(_PROBE_PAUSE_S)
