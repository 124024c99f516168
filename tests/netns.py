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

import itertools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests import delay_link
from tests.bpf_loss import load_and_pin

__all__ = ["HostNet", "delay_unavailable", "enter_netns", "loss_unavailable", "unavailable"]

SUBNET = "198.18.0"
SUBNET6 = "fd00:198:18::"  # a unique-local /64 beside the IPv4 one (`HostNet(ipv6=True)`)
_CLONE_NEWNET = 0x40000000
_CMD_TIMEOUT_S = 10
_ROOT = Path(__file__).resolve().parents[1]
_NETS = itertools.count()


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


def loss_unavailable() -> str | None:
    """Why `HostNet.lose` cannot work here (beyond `unavailable`), or None when it can."""
    why = unavailable()
    if why is not None:
        return why
    with tempfile.TemporaryDirectory() as fs:
        mounted = subprocess.run(["mount", "-t", "bpf", "bpf", fs], capture_output=True, text=True, check=False)
        if mounted.returncode != 0:
            return f"no bpffs: {mounted.stderr.strip()}"
        try:
            load_and_pin(0.01, os.path.join(fs, "probe"))
        except OSError as exc:
            return f"a tc BPF program cannot be loaded: {exc}"
        finally:
            subprocess.run(["umount", fs], capture_output=True, check=False)
    return None


def delay_unavailable() -> str | None:
    """Why `HostNet.delay` cannot work here (beyond `unavailable`), or None when it can."""
    why = unavailable()
    if why is not None:
        return why
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as exc:
        return f"no TUN devices: {exc}"
    return None


@dataclass
class HostNet:
    """Namespaces `hosts`, each with `eth0` at 198.18.0.(i + 1) on one bridge."""

    hosts: Sequence[str]
    # The process (each xdist worker is one) and a count within it: no two nets alive at
    # once share a namespace name.
    prefix: str = field(default_factory=lambda: f"pdkv{os.getpid()}n{next(_NETS)}")
    ipv6: bool = False  # each host's eth0 also at fd00:198:18::(i + 1)
    _made: list[str] = field(default_factory=list, init=False)
    _bpffs: str | None = field(default=None, init=False)  # where loss programs are pinned
    _delayer: subprocess.Popen[str] | None = field(default=None, init=False)
    _delay_stats: str | None = field(default=None, init=False)
    _shaped: bool = field(default=False, init=False)  # a rate cap or loss was put on a wire

    def netns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{list(self.hosts).index(host) + 1}"

    def address6(self, host: str) -> str:
        """`host`'s IPv6 address (with `ipv6=True`)."""
        return f"{SUBNET6}{list(self.hosts).index(host) + 1}"

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
                if self.ipv6:  # nodad: usable at once, not after duplicate address detection
                    _ip("-n", ns, "addr", "add", f"{self.address6(host)}/64", "dev", "eth0", "nodad")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Delete every namespace made (their veths go with them); safe to call twice."""
        self.delay(None)
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)
        if self._bpffs is not None:  # the programs go once no filter holds them
            subprocess.run(["umount", self._bpffs], capture_output=True, check=False, timeout=_CMD_TIMEOUT_S)
            os.rmdir(self._bpffs)
            self._bpffs = None

    def wire(self) -> str:
        """The interface that carries traffic between hosts: the delayed link once there is one."""
        return delay_link.DEVICE if self._delayer is not None else "eth0"

    def link(self, host: str, up: bool) -> None:
        """Take `host`'s cable out (or put it back): its interfaces go down."""
        for dev in {"eth0", self.wire()}:
            _ip("-n", self.netns(host), "link", "set", dev, "up" if up else "down")

    def delay(self, ms: float | None, loss: float = 0.0) -> dict[str, float] | None:
        """Hold every packet between hosts `ms` milliseconds each way and drop `loss` percent
        of them at random (`tests.delay_link`); None takes the link away and returns what
        packets were actually held and lost.

        Set it before `limit`: that acts on the interface that carries the traffic. `lose`
        does not apply to this link; its own `loss` does.
        """
        if ms is None:
            return self._undelay()
        self._start_delay(ms, loss)
        return None

    def _start_delay(self, ms: float, loss: float) -> None:
        if self._delayer is not None or self._shaped:
            raise ValueError("set the delay once, before any rate cap or loss")
        fd, self._delay_stats = tempfile.mkstemp(prefix="pdkv-delay-", suffix=".json")
        os.close(fd)
        for host in self.hosts:  # the delayed link takes each host's address off its cable
            _ip("-n", self.netns(host), "addr", "del", f"{self.address(host)}/24", "dev", "eth0")
        hosts = [f"{self.netns(h)}={self.address(h)}" for h in self.hosts]
        cmd = [sys.executable, "-m", "tests.delay_link", "--delay-ms", str(ms), "--loss", str(loss)]
        cmd += ["--stats", self._delay_stats]
        self._delayer = subprocess.Popen([*cmd, *hosts], cwd=_ROOT, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self._delayer.stdout], [], [], _CMD_TIMEOUT_S)
        if not ready or self._delayer.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            self._undelay()
            raise RuntimeError("the delayed link did not come up")

    def _undelay(self) -> dict[str, float] | None:
        if self._delayer is None:
            return None
        delayer, self._delayer = self._delayer, None
        delayer.terminate()
        try:
            delayer.wait(timeout=_CMD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            delayer.kill()
            delayer.wait(timeout=_CMD_TIMEOUT_S)
        for host in self.hosts:  # its devices went with it: the cables carry the hosts again
            _ip("-n", self.netns(host), "addr", "replace", f"{self.address(host)}/24", "dev", "eth0", check=False)
        stats_path, self._delay_stats = self._delay_stats, None
        assert stats_path is not None
        try:
            text = Path(stats_path).read_text()
            return json.loads(text) if text else None
        finally:
            os.unlink(stats_path)

    def limit(self, host: str, mbit: float | None) -> None:
        """Cap what `host` sends at `mbit` megabits a second (a token bucket); None lifts it.

        The kernels here are built without netem (`CONFIG_NET_SCH_NETEM` unset, no
        modules): only HTB and TBF shape traffic. Delay: `delay`; loss: `lose`.
        """
        ns, wire = self.netns(host), self.wire()
        subprocess.run(
            [*self.exec_prefix(host), "tc", "qdisc", "del", "dev", wire, "root"],
            capture_output=True,
            timeout=_CMD_TIMEOUT_S,
        )
        if mbit is not None:
            self._shaped = True
            tbf = ["rate", f"{mbit}mbit", "burst", "64kb", "latency", "50ms"]
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", wire, "root", "tbf", *tbf]
            subprocess.run(cmd, check=True, capture_output=True, timeout=_CMD_TIMEOUT_S)

    def lose(self, host: str, percent: float | None) -> None:
        """Drop `percent` of the packets `host` sends, at random (None: none); see `tests.bpf_loss`.

        Offloads are turned down to one segment a packet, so the share counts wire packets,
        not 64 KiB TCP super-packets.
        """
        if self._delayer is not None:
            raise ValueError("the delayed link drops packets itself: delay(ms, loss=...)")
        ns, wire = self.netns(host), "eth0"
        tc = [*self.exec_prefix(host), "tc"]
        subprocess.run([*tc, "qdisc", "del", "dev", wire, "clsact"], capture_output=True, timeout=_CMD_TIMEOUT_S)
        if percent is None:
            _ip("-n", ns, "link", "set", wire, "gso_max_segs", "65535")
            return
        self._shaped = True
        if self._bpffs is None:
            self._bpffs = tempfile.mkdtemp(prefix="pdkv-bpffs-")
            subprocess.run(["mount", "-t", "bpf", "bpf", self._bpffs], check=True, capture_output=True)
        pinned = os.path.join(self._bpffs, f"loss{round(percent * 1000)}")  # bpffs refuses dots in names
        if not os.path.exists(pinned):
            load_and_pin(percent / 100, pinned)
        _ip("-n", ns, "link", "set", wire, "gso_max_segs", "1")
        subprocess.run([*tc, "qdisc", "add", "dev", wire, "clsact"], check=True, capture_output=True)
        attach = ["filter", "add", "dev", wire, "egress", "bpf", "da", "object-pinned", pinned]
        subprocess.run([*tc, *attach], check=True, capture_output=True, timeout=_CMD_TIMEOUT_S)

    def __enter__(self) -> HostNet:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def enter_netns(netns: str) -> None:
    """Move the calling process (its one thread: call it first in a fresh process, before any
    thread or socket exists) into the network namespace `netns` made by `ip netns add`."""
    import ctypes

    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
    finally:
        os.close(fd)
