"""Hand open file descriptors from one process to another of the same host (SCM_RIGHTS).

The same-host GPU lane exports VMM allocations (`transfer.lanes.cuda_ipc.vmm`) as POSIX file
descriptors. A descriptor number means nothing in another process: the kernel has to copy
the open file across, which only a Unix socket's SCM_RIGHTS message does (pidfd_getfd
needs ptrace rights over the owner, which containers and Yama usually deny).

`FdServer` runs on the owner's event loop and serves named sets of descriptors; `fetch_fds`
is the decode's side. One exchange a connection::

    server -> client   frame(Hello{nonce})
    client -> server   frame(FdRequest{key, mac = HMAC-SHA256(secret, nonce || key)})
    server -> client   frame(FdReply{ok, count | code, error})
    server -> client   ceil(count / FD_BATCH) messages of one byte, each with <= FD_BATCH fds

A frame is a 4-byte big-endian length and a msgpack body. Both ends check the peer's
credentials (SO_PEERCRED) against their own uid, so a process of another user cannot take
descriptors or squat on the name and hand out its own. The secret (the one the service
runs with) keeps other processes of the same user from fetching by key; the nonce makes
a recorded request useless. No threads: everything runs on the caller's loop.

Addresses are strings: ``@name`` for Linux's abstract namespace (no file; per network
namespace, so processes in different containers need the path form) or a filesystem path.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import uuid
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass

import msgspec

from pdkv.errors import AuthError, DeadlineExceeded, PdkvError, PeerLostError, TransferError
from transfer.deadline import Deadline

logger = logging.getLogger(__name__)

FD_BATCH = 200  # descriptors per SCM_RIGHTS message: Linux takes at most 253 (SCM_MAX_FD)
MAX_FDS = 16384  # the most a client takes in one fetch unless told otherwise
_MAX_FRAME = 4096  # requests and replies are tiny; a larger frame is a bad peer
_FD_MARK = b"F"  # the one data byte each descriptor batch rides on
_LEN = struct.Struct(">I")
_ACCEPT_PAUSE_S = 0.1  # after a failed accept (out of descriptors): a pace, not a bound
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class FdPassError(TransferError):
    """Descriptors could not be handed over: a refused or malformed exchange."""


class UnknownKeyError(FdPassError):
    """The server serves no descriptors under that key (never served, or withdrawn)."""


class _Hello(msgspec.Struct, frozen=True):
    nonce: bytes


class _FdRequest(msgspec.Struct, frozen=True):
    key: str
    mac: bytes


class _FdReply(msgspec.Struct, frozen=True):
    ok: bool
    count: int = 0
    code: str = ""  # "auth", "unknown", "bad" when not ok
    error: str = ""


_hello_dec = msgspec.msgpack.Decoder(_Hello)
_request_dec = msgspec.msgpack.Decoder(_FdRequest)
_reply_dec = msgspec.msgpack.Decoder(_FdReply)
_enc = msgspec.msgpack.Encoder()


def _mac(secret: bytes, nonce: bytes, key: str) -> bytes:
    return hmac.new(secret, nonce + key.encode(), hashlib.sha256).digest()


def _as_bytes(secret: str | bytes) -> bytes:
    return secret.encode() if isinstance(secret, str) else secret


def _sockaddr(address: str) -> str:
    """``@name`` (abstract namespace) -> the kernel's leading-NUL form; a path stays."""
    return "\0" + address[1:] if address.startswith("@") else address


def close_fds(fds: Iterable[int]) -> None:
    """Close each descriptor, ignoring ones already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _peer_uid(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _left(deadline: Deadline) -> float:
    return deadline.left(what="fd exchange past its deadline")


async def _bounded(aw: Awaitable[bytes], deadline: Deadline) -> bytes:
    try:
        return await asyncio.wait_for(aw, _left(deadline))
    except asyncio.TimeoutError as exc:
        raise DeadlineExceeded("fd exchange past its deadline") from exc


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    """Exactly `n` bytes, never more: a byte past the frame may carry descriptors, and a
    plain recv() of it would make the kernel drop (close) them."""
    buf = bytearray()
    while len(buf) < n:
        chunk = await _bounded(loop.sock_recv(sock, n - len(buf)), deadline)
        if not chunk:
            raise PeerLostError("fd peer closed the connection mid-frame")
        buf += chunk
    return bytes(buf)


async def _recv_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, deadline: Deadline) -> bytes:
    (n,) = _LEN.unpack(await _recv_exact(loop, sock, _LEN.size, deadline))
    if n > _MAX_FRAME:
        raise FdPassError(f"fd peer sent a {n}-byte frame (at most {_MAX_FRAME})")
    return await _recv_exact(loop, sock, n, deadline)


async def _send_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket, body: bytes, deadline: Deadline) -> None:
    try:
        await asyncio.wait_for(loop.sock_sendall(sock, _LEN.pack(len(body)) + body), _left(deadline))
    except asyncio.TimeoutError as exc:
        raise DeadlineExceeded("fd exchange past its deadline") from exc


async def _wait_io(loop: asyncio.AbstractEventLoop, sock: socket.socket, write: bool, deadline: Deadline) -> None:
    """Wait until `sock` is readable (or writable), bounded by `deadline`."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await asyncio.wait_for(ready, _left(deadline))
    except asyncio.TimeoutError as exc:
        raise DeadlineExceeded("fd exchange past its deadline") from exc
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def _send_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket, fds: list[int], deadline: Deadline) -> None:
    """Send `fds` in batches, each on one marker byte (the loop has no sendmsg of its own)."""
    for start in range(0, len(fds), FD_BATCH):
        batch = fds[start : start + FD_BATCH]
        while True:
            try:
                sent = socket.send_fds(sock, [_FD_MARK], batch)
            except (BlockingIOError, InterruptedError):
                await _wait_io(loop, sock, True, deadline)
                continue
            if sent != 1:
                raise FdPassError("fd batch not sent")
            break


async def _recv_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket, count: int, deadline: Deadline) -> list[int]:
    """Receive `count` descriptors, batch by batch; on any failure close what came."""
    got: list[int] = []
    try:
        while len(got) < count:
            want = min(FD_BATCH, count - len(got))
            try:
                msg, fds, flags, _ = socket.recv_fds(sock, 1, want)
            except (BlockingIOError, InterruptedError):
                await _wait_io(loop, sock, False, deadline)
                continue
            got.extend(fds)
            if not msg:
                raise PeerLostError(f"fd peer closed after {len(got)} of {count} descriptors")
            if msg != _FD_MARK or flags & socket.MSG_CTRUNC or len(fds) != want:
                raise FdPassError(f"bad fd batch: {len(fds)} descriptors of {want}, flags {flags:#x}")
        return got
    except BaseException:
        close_fds(got)
        raise


@dataclass
class _Entry:
    """One served set: the server's own duplicates of the caller's descriptors."""

    fds: list[int]
    sending: int = 0  # connections sending them now: a withdrawn set closes after the last
    withdrawn: bool = False

    def release_if_done(self) -> None:
        if self.withdrawn and self.sending == 0 and self.fds:
            close_fds(self.fds)
            self.fds = []


@dataclass
class _Stats:
    served: int = 0
    refused: int = 0


class FdServer:
    """Serves named sets of descriptors over a Unix socket to same-uid processes holding
    `secret`. Start with `start()` (or `async with`), register with `serve()`, stop with
    `aclose()`. Call `serve`/`withdraw` on the loop's thread.

    `directory`: make a socket file there; else an abstract-namespace name (``@...``).
    `timeout`: the most one connection may take, from accept to the last descriptor (the
    exporter's `Timeouts.connect`).
    """

    def __init__(
        self,
        secret: str | bytes,
        *,
        directory: str | None = None,
        name: str | None = None,
        timeout: float,
    ) -> None:
        if not secret:
            raise ValueError("FdServer needs a non-empty secret")
        self._secret = _as_bytes(secret)
        name = name or f"pdkv-fd-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.address = os.path.join(directory, name + ".sock") if directory is not None else "@" + name
        self.timeout = timeout
        self._entries: dict[str, _Entry] = {}
        self._sock: socket.socket | None = None
        self._accept: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._uid = os.geteuid()
        self.stats = _Stats()

    async def __aenter__(self) -> FdServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> str:
        """Listen; returns the address clients pass to `fetch_fds`."""
        if self._sock is not None:
            return self.address
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(_sockaddr(self.address))
            if not self.address.startswith("@"):
                os.chmod(self.address, 0o600)  # the uid check stands behind this as well
            sock.listen(64)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise FdPassError(f"cannot listen on {self.address}: {exc}") from exc
        self._sock = sock
        self._accept = asyncio.get_running_loop().create_task(self._accept_loop())
        logger.debug("fd server listening on %s", self.address)
        return self.address

    def serve(self, key: str, fds: list[int]) -> None:
        """Serve (duplicates of) `fds` under `key`; the caller keeps its own and may close
        them at once. Replaces a set already under `key`."""
        dups: list[int] = []
        try:
            for fd in fds:
                dups.append(os.dup(fd))
        except OSError as exc:
            close_fds(dups)
            raise FdPassError(f"cannot duplicate descriptors for {key!r}: {exc}") from exc
        self.withdraw(key)
        self._entries[key] = _Entry(dups)

    def withdraw(self, key: str) -> None:
        """Stop serving `key`; its descriptors close once no connection is sending them."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.withdrawn = True
            entry.release_if_done()

    def keys(self) -> list[str]:
        return list(self._entries)

    async def aclose(self) -> None:
        """Stop listening, cancel open exchanges, close every served descriptor."""
        tasks = [t for t in (self._accept, *self._conns) if t is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._accept = None
        for key in list(self._entries):
            self.withdraw(key)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            if not self.address.startswith("@"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.address)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # EMFILE and kin: log, back off, keep serving
                logger.warning("fd server accept failed: %s", exc)
                await asyncio.sleep(_ACCEPT_PAUSE_S)
                continue
            task = loop.create_task(self._handle(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _handle(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        deadline = Deadline.after(self.timeout)
        entry: _Entry | None = None
        try:
            conn.setblocking(False)
            pid, uid = _peer_uid(conn)
            if uid != self._uid:
                self.stats.refused += 1
                logger.warning("fd server refused pid %d: uid %d is not %d", pid, uid, self._uid)
                await self._refuse(loop, conn, "auth", "peer runs as another user", deadline)
                return
            nonce = secrets.token_bytes(16)
            await _send_frame(loop, conn, _enc.encode(_Hello(nonce)), deadline)
            try:
                req = _request_dec.decode(await _recv_frame(loop, conn, deadline))
            except (msgspec.DecodeError, msgspec.ValidationError, FdPassError) as exc:
                self.stats.refused += 1
                await self._refuse(loop, conn, "bad", f"malformed request: {exc}", deadline)
                return
            if not hmac.compare_digest(req.mac, _mac(self._secret, nonce, req.key)):
                self.stats.refused += 1
                logger.warning("fd server refused pid %d: bad secret for %r", pid, req.key)
                await self._refuse(loop, conn, "auth", "bad secret", deadline)
                return
            entry = self._entries.get(req.key)
            if entry is None:
                self.stats.refused += 1
                await self._refuse(loop, conn, "unknown", f"no descriptors under {req.key!r}", deadline)
                return
            entry.sending += 1
            fds = list(entry.fds)
            await _send_frame(loop, conn, _enc.encode(_FdReply(ok=True, count=len(fds))), deadline)
            # Descriptors in flight are the kernel's: closing ours (or the connection) after
            # the send cannot take them from a client that has not read them yet.
            await _send_fds(loop, conn, fds, deadline)
            self.stats.served += 1
            logger.debug("fd server sent %d descriptors of %r to pid %d", len(fds), req.key, pid)
        except asyncio.CancelledError:
            raise
        except (OSError, PdkvError) as exc:  # a client that vanished or stalled: its loss only
            logger.info("fd server exchange ended: %s", exc)
        finally:
            if entry is not None:
                entry.sending -= 1
                entry.release_if_done()
            conn.close()

    async def _refuse(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket, code: str, error: str, deadline: Deadline
    ) -> None:
        with contextlib.suppress(OSError, DeadlineExceeded):
            await _send_frame(loop, conn, _enc.encode(_FdReply(ok=False, code=code, error=error)), deadline)


async def fetch_fds(
    address: str, key: str, secret: str | bytes, timeout: float, *, max_fds: int = MAX_FDS
) -> list[int]:
    """The descriptors an `FdServer` at `address` serves under `key`: new descriptors of
    this process, which the caller owns (close them with `close_fds` once imported).

    Raises `DeadlineExceeded` past `timeout`, `AuthError` for a wrong secret or a server of
    another user, `UnknownKeyError`, `PeerLostError` when nothing listens, `FdPassError`
    for anything malformed (or more than `max_fds` descriptors)."""
    loop = asyncio.get_running_loop()
    deadline = Deadline.after(timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, _sockaddr(address)), _left(deadline))
        except asyncio.TimeoutError as exc:
            raise DeadlineExceeded(f"connecting to fd server {address}") from exc
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise PeerLostError(f"no fd server at {address}: {exc}", peer=address) from exc
        pid, uid = _peer_uid(sock)
        if uid != os.geteuid():
            raise AuthError(f"fd server {address} (pid {pid}) runs as uid {uid}, not {os.geteuid()}")
        first = await _recv_frame(loop, sock, deadline)
        try:
            hello = _hello_dec.decode(first)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise _refusal(address, _as_reply(first)) from None  # refused before the hello
        mac = _mac(_as_bytes(secret), hello.nonce, key)
        await _send_frame(loop, sock, _enc.encode(_FdRequest(key=key, mac=mac)), deadline)
        try:
            reply = _reply_dec.decode(await _recv_frame(loop, sock, deadline))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise FdPassError(f"malformed reply from fd server {address}: {exc}") from exc
        if not reply.ok:
            raise _refusal(address, reply)
        if not 0 <= reply.count <= max_fds:
            raise FdPassError(f"fd server {address} offers {reply.count} descriptors (at most {max_fds})")
        return await _recv_fds(loop, sock, reply.count, deadline)
    except PdkvError:
        raise
    except OSError as exc:  # (DeadlineExceeded and AuthError are OSErrors too: kept above)
        raise PeerLostError(f"fd exchange with {address} failed: {exc}", peer=address) from exc
    finally:
        sock.close()


def _as_reply(frame: bytes) -> _FdReply:
    try:
        return _reply_dec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _FdReply(ok=False, code="bad", error="neither a hello nor a reply")


def _refusal(address: str, reply: _FdReply) -> TransferError:
    what = f"fd server {address}: {reply.error or reply.code}"
    if reply.code == "auth":
        return _AuthFdError(what)
    if reply.code == "unknown":
        return UnknownKeyError(what)
    return FdPassError(what)


class _AuthFdError(FdPassError, AuthError):
    """A refusal for the secret or the uid: both an `AuthError` and an `FdPassError`."""
