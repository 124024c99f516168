"""Added delay without netem: a user-space link that holds every packet for a fixed time.

The kernels here are built without netem (and without fq, whose departure times a BPF
program could set), so no qdisc can delay a packet. TUN devices can: this process makes
one per stand-in host (`slow0` in its namespace, holding the host's address in place of
its cable to the bridge), and moves each IPv4 packet it reads from one device to the
device of its destination host once `--delay-ms` have passed since it arrived. Constant
delay keeps packets in arrival order, so one queue serves every direction. `--loss P`
drops P% of the packets at random on the way: a drop the sender's kernel never hears of, as
on a wire (a tc program on a TUN device's egress drops packets before they leave, and TCP,
told at once, just sends them again without counting a loss).

The devices' MTU is 65000: across the veth bridge the kernel moves TCP in 64 KiB
super-packets (segmentation offload), and a 1500-byte MTU here would instead cost this
one Python thread a read and a write per wire packet. What it measures is what each
packet was actually held (the select timeout overshoots by microseconds); on SIGTERM it
writes those figures to `--stats` and exits, and its devices go with it (the caller puts
the addresses back on the cables).

    python -m tests.delay_link --delay-ms 1 [--loss 1] --stats out.json NETNS=ADDRESS NETNS=ADDRESS ...
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["DEVICE", "main"]

DEVICE = "slow0"  # the delayed link's name in each host's namespace
MTU = 65000
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_PR_SET_TIMERSLACK = 29
_READS_PER_WAKE = 64  # bounded, so one busy device cannot starve the due writes
_MAX_SAMPLES = 1_000_000  # the first ones; enough for the held-time figures


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def _attach(hosts: Sequence[tuple[str, str]], prefix_len: int) -> dict[bytes, int]:
    """One TUN device per host, moved into its namespace and given the host's address.

    The address moves rather than a route being added: UCX's TCP transport takes a peer as
    reachable through an interface only if the kernel's route to it leaves by that
    interface, so the delayed link must be the host's interface, not a detour beside it.
    """
    by_address: dict[bytes, int] = {}
    for i, (netns, address) in enumerate(hosts):
        made = f"pdkvd{os.getpid() % 10**6}x{i}"  # unique while it sits in this namespace
        fd = _open_tun(made)
        _ip("link", "set", made, "netns", netns)
        _ip("-n", netns, "link", "set", made, "name", DEVICE)
        _ip("-n", netns, "link", "set", DEVICE, "mtu", str(MTU), "up")
        _ip("-n", netns, "addr", "add", f"{address}/{prefix_len}", "dev", DEVICE)
        by_address[socket.inet_aton(address)] = fd
    return by_address


class _Link:
    """The packets on their way, and what each was held."""

    def __init__(self, delay_s: float, loss: float, by_address: dict[bytes, int]) -> None:
        self.delay_s = delay_s
        self.loss = loss  # the share of packets dropped, as a lossy wire would
        self.lost = 0
        self.by_address = by_address
        self.pending: collections.deque[tuple[float, int, bytes]] = collections.deque()
        self.held_s: list[float] = []
        self.packets = 0
        self.bytes = 0
        self.dropped = 0  # not IPv4 to a known host (IPv6 router solicitations, say), or no room to write

    def take(self, fd: int) -> None:
        for _ in range(_READS_PER_WAKE):
            try:
                packet = os.read(fd, MTU + 64)
            except BlockingIOError:
                return
            out = self.by_address.get(packet[16:20]) if packet[:1] and packet[0] >> 4 == 4 else None
            if out is None:
                self.dropped += 1
                continue
            if self.loss and random.random() < self.loss:
                self.lost += 1
                continue
            self.pending.append((time.monotonic() + self.delay_s, out, packet))

    def release_due(self) -> None:
        now = time.monotonic()
        while self.pending and self.pending[0][0] <= now:
            due, out, packet = self.pending.popleft()
            try:
                os.write(out, packet)
            except (BlockingIOError, OSError):  # the device's queue is full: a loss, as on a wire
                self.dropped += 1
                continue
            self.packets += 1
            self.bytes += len(packet)
            if len(self.held_s) < _MAX_SAMPLES:
                self.held_s.append(time.monotonic() - due + self.delay_s)

    def wait_s(self) -> float:
        return max(0.0, self.pending[0][0] - time.monotonic()) if self.pending else 0.5

    def stats(self) -> dict[str, float]:
        held = sorted(self.held_s) or [0.0]
        return {
            "delay_ms": self.delay_s * 1e3,
            "packets": self.packets,
            "bytes": self.bytes,
            "lost": self.lost,
            "dropped": self.dropped,
            "held_min_ms": held[0] * 1e3,
            "held_p50_ms": statistics.median(held) * 1e3,
            "held_p99_ms": held[min(len(held) - 1, round(0.99 * (len(held) - 1)))] * 1e3,
        }


def _run(link: _Link, stop: list[bool]) -> None:
    fds = list(link.by_address.values())
    while not stop:
        try:
            readable, _, _ = select.select(fds, [], [], link.wait_s())
        except InterruptedError:
            continue
        for fd in readable:
            link.take(fd)
        link.release_due()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delay-ms", type=float, required=True, help="one-way delay added to every packet")
    ap.add_argument("--loss", type=float, default=0.0, help="percent of packets dropped at random")
    ap.add_argument("--stats", required=True, help="where to write what packets were held, on SIGTERM")
    ap.add_argument("--prefix-len", type=int, default=24, help="of the hosts' subnet")
    ap.add_argument("hosts", nargs="+", help="NETNS=ADDRESS of each host the link joins (the address not in use)")
    args = ap.parse_args(argv)
    # Sleeps end when asked, not up to 50 us later (the default slack): 0.1 ms must mean it.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    hosts = [tuple(h.split("=", 1)) for h in args.hosts]
    link = _Link(args.delay_ms / 1e3, args.loss / 100, _attach(hosts, args.prefix_len))  # type: ignore[arg-type]
    print("ready", flush=True)
    _run(link, stop)
    with open(args.stats, "w") as out:
        json.dump(link.stats(), out)


if __name__ == "__main__":
    sys.exit(main())
