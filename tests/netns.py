"""Hosts on one machine: network namespaces joined by a bridge, for tests and benchmarks.

Each host is a network namespace with one interface, `eth0`, cabled by a veth pair to a
bridge in a switch namespace of its own. Addresses come from 198.18.0.0/24 (the
benchmarking range, which no other network here uses), so nothing a test does reaches the
machine's own interfaces or any address it did not make. Every namespace carries a prefix
unique to this process and is deleted on exit, also when the test fails; deleting a
namespace deletes its end of each veth, and with it the pair.

Needs root and iproute2 (`ip`, `tc`); `unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["HostNet", "unavailable"]

SUBNET = "198.18.0"
_CMD_TIMEOUT_S = 10


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"pdkvprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:  # what HostNet builds: a veth pair, and a token bucket on it
        for step in (
            ["-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            ["-n", probe, "link", "set", "v0", "up"],
        ):
            if (done := _ip(*step, check=False)).returncode != 0:
                return f"ip {' '.join(step[2:])} failed: {done.stderr.strip()}"
        tbf = ["tc", "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1mbit", "burst", "32kb", "latency", "50ms"]
        done = _ip("netns", "exec", probe, *tbf, check=False)
        if done.returncode != 0:
            return f"tc tbf failed: {done.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", probe, check=False)


@dataclass
class HostNet:
    """Namespaces `hosts`, each with `eth0` at 198.18.0.(i + 1) on one bridge."""

    hosts: Sequence[str]
    prefix: str = field(default_factory=lambda: f"pdkv{os.getpid()}")
    _made: list[str] = field(default_factory=list, init=False)

    def netns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{list(self.hosts).index(host) + 1}"

    def where(self, host: str) -> str:
        """`host` as a deployment flag takes it: NETNS@ADDRESS."""
        return f"{self.netns(host)}@{self.address(host)}"

    def exec_prefix(self, host: str) -> list[str]:
        """Put before a command line to run it on `host`."""
        return ["ip", "netns", "exec", self.netns(host)]

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def up(self) -> HostNet:
        switch = self.netns("switch")
        try:
            self._add(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for i, host in enumerate(self.hosts):
                ns = self.netns(host)
                self._add(ns)
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}", "netns", switch)
                _ip("-n", switch, "link", "set", f"port{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Delete every namespace made (their veths go with them); safe to call twice."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)

    def link(self, host: str, up: bool) -> None:
        """Take `host`'s cable out (or put it back): its interface goes down."""
        _ip("-n", self.netns(host), "link", "set", "eth0", "up" if up else "down")

    def limit(self, host: str, mbit: float | None) -> None:
        """Cap what `host` sends at `mbit` megabits a second (a token bucket); None lifts it.

        Delay and loss would need netem, which the kernels here are built without
        (`CONFIG_NET_SCH_NETEM` unset, no modules): only HTB and TBF shape traffic.
        """
        ns = self.netns(host)
        subprocess.run(
            [*self.exec_prefix(host), "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True,
            timeout=_CMD_TIMEOUT_S,
        )
        if mbit is not None:
            tbf = ["rate", f"{mbit}mbit", "burst", "64kb", "latency", "50ms"]
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", *tbf]
            subprocess.run(cmd, check=True, capture_output=True, timeout=_CMD_TIMEOUT_S)

    def __enter__(self) -> HostNet:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
