"""transfer.lanes.cuda_ipc.fd_pass with real processes: a child serves descriptors of memfd files, the
test process fetches them and reads the files through them."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from pdkv.errors import AuthError, DeadlineExceeded, PeerLostError
from transfer.lanes.cuda_ipc.fd_pass import (
    FD_BATCH,
    FdPassError,
    FdServer,
    UnknownKeyError,
    close_fds,
    fetch_fds,
)

SECRET = "s3cret"
ROOT = Path(__file__).resolve().parents[1]
MANY = 2 * FD_BATCH + 50  # three SCM_RIGHTS batches

# The child: memfd files served under "files" (3 distinct files) and "many" (one file,
# MANY times); prints its address, serves until its stdin closes. "silent": a socket that
# listens and never accepts, so a client's connect succeeds and then hears nothing.
CHILD = r"""
import asyncio, os, socket, sys
from transfer.lanes.cuda_ipc.fd_pass import FdServer

mode, secret, directory = sys.argv[1], sys.argv[2], sys.argv[3] or None
if mode == "silent":
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind("\0pdkv-test-silent-%d" % os.getpid())
    s.listen(8)
    print("@pdkv-test-silent-%d" % os.getpid(), flush=True)
    sys.stdin.read()
    sys.exit(0)

def memfd(i):
    fd = os.memfd_create("pdkv-test-%d" % i)
    os.write(fd, (b"file %d " % i) * 1000)
    return fd

async def main():
    files = [memfd(i) for i in range(3)]
    one = memfd(99)
    async with FdServer(secret, directory=directory, timeout=5) as server:
        server.serve("files", files)
        server.serve("many", [one] * int(sys.argv[4]))
        for fd in files + [one]:
            os.close(fd)  # the server keeps its own duplicates
        print(server.address, flush=True)
        eof = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().add_reader(sys.stdin.fileno(), lambda: eof.done() or eof.set_result(None))
        await eof

asyncio.run(main())
"""


def _fd_count() -> int:
    """Descriptors open in this process, once garbage is collected: an earlier test's objects
    (a UCX agent holds dozens) freed by a collection mid-test would otherwise change the
    count under it (seen once in a full run: 80 before, 25 after)."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def _child(mode: str, directory: str = "") -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, SECRET, directory, str(MANY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    assert address, "the child printed no address"
    return proc, address


def _stop(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.stdout is not None
    proc.stdout.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    proc, address = _child("serve")
    yield address
    _stop(proc)
    assert proc.returncode == 0


async def test_fetch_reads_the_files(server: str) -> None:
    before = _fd_count()
    fds = await fetch_fds(server, "files", SECRET, timeout=5)
    try:
        assert len(fds) == 3
        for i, fd in enumerate(fds):
            assert os.pread(fd, 8000, 0) == (b"file %d " % i) * 1000
    finally:
        close_fds(fds)
    assert _fd_count() == before


async def test_many_descriptors_in_batches(server: str) -> None:
    before = _fd_count()
    fds = await fetch_fds(server, "many", SECRET, timeout=5)
    try:
        assert len(fds) == MANY and len(set(fds)) == MANY
        assert all(os.pread(fd, 7, 0) == b"file 99" for fd in fds)
    finally:
        close_fds(fds)
    assert _fd_count() == before


async def test_more_than_max_fds_is_refused(server: str) -> None:
    before = _fd_count()
    with pytest.raises(FdPassError, match="at most 10"):
        await fetch_fds(server, "many", SECRET, timeout=5, max_fds=10)
    assert _fd_count() == before


async def test_wrong_secret_refused(server: str) -> None:
    before = _fd_count()
    with pytest.raises(AuthError, match="bad secret"):
        await fetch_fds(server, "files", "not-the-secret", timeout=5)
    assert _fd_count() == before


async def test_unknown_key_refused(server: str) -> None:
    before = _fd_count()
    with pytest.raises(UnknownKeyError, match="nope"):
        await fetch_fds(server, "nope", SECRET, timeout=5)
    assert _fd_count() == before


async def test_server_survives_refusals(server: str) -> None:
    """Refused and abandoned exchanges leave the server serving the next client."""
    for _ in range(3):
        with pytest.raises(AuthError):
            await fetch_fds(server, "files", "wrong", timeout=5)
    # A client that connects and goes away without a word.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + server[1:])
    s.close()
    fds = await fetch_fds(server, "files", SECRET, timeout=5)
    close_fds(fds)
    assert len(fds) == 3


async def test_path_address(tmp_path: Path) -> None:
    proc, address = _child("serve", str(tmp_path))
    try:
        assert address.startswith(str(tmp_path)) and os.stat(address).st_mode & 0o777 == 0o600
        fds = await fetch_fds(address, "files", SECRET, timeout=5)
        try:
            assert os.pread(fds[2], 6, 0) == b"file 2"
        finally:
            close_fds(fds)
    finally:
        _stop(proc)
    assert not os.path.exists(address)  # the server removed its socket file


async def test_deadline_on_a_silent_server() -> None:
    proc, address = _child("silent")
    try:
        before = _fd_count()
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            await fetch_fds(address, "files", SECRET, timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 3
        assert _fd_count() == before
    finally:
        _stop(proc)


async def test_nothing_listening() -> None:
    with pytest.raises(PeerLostError):
        await fetch_fds(f"@pdkv-test-nobody-{os.getpid()}", "files", SECRET, timeout=2)


async def test_malformed_request_gets_a_typed_reply() -> None:
    """In process: a raw client that sends garbage is told so ("bad") and cut off."""
    threads = threading.active_count()
    before = _fd_count()
    r, w = os.pipe()
    async with FdServer(SECRET, timeout=5) as srv:
        srv.serve("k", [r])
        loop = asyncio.get_running_loop()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        await loop.sock_connect(s, "\0" + srv.address[1:])
        hello = await asyncio.wait_for(loop.sock_recv(s, 4096), 5)
        assert len(hello) > 4
        await loop.sock_sendall(s, struct.pack(">I", 3) + b"\xc1\xc1\xc1")  # not msgpack
        reply = await asyncio.wait_for(loop.sock_recv(s, 4096), 5)
        body = msgspec.msgpack.decode(reply[4:])
        assert body["ok"] is False and body["code"] == "bad"
        assert await asyncio.wait_for(loop.sock_recv(s, 1), 5) == b""  # closed
        s.close()
        # An oversized frame is refused the same way.
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        await loop.sock_connect(s, "\0" + srv.address[1:])
        await asyncio.wait_for(loop.sock_recv(s, 4096), 5)
        await loop.sock_sendall(s, struct.pack(">I", 1 << 30))
        reply = await asyncio.wait_for(loop.sock_recv(s, 4096), 5)
        assert msgspec.msgpack.decode(reply[4:])["code"] == "bad"
        s.close()
        assert srv.stats.refused == 2
        # The served set is still there and good.
        fds = await fetch_fds(srv.address, "k", SECRET, timeout=5)
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"
        close_fds(fds)
    close_fds([r, w])
    assert _fd_count() == before  # the server's duplicates closed with it
    assert threading.active_count() == threads


async def test_withdraw_closes_duplicates() -> None:
    before = _fd_count()
    r, w = os.pipe()
    async with FdServer(SECRET, timeout=5) as srv:
        listening = _fd_count()  # the pipe's two ends and the listening socket
        srv.serve("k", [r, w])
        assert _fd_count() == listening + 2
        srv.withdraw("k")
        assert _fd_count() == listening
        with pytest.raises(UnknownKeyError):
            await fetch_fds(srv.address, "k", SECRET, timeout=5)
    close_fds([r, w])
    assert _fd_count() == before
