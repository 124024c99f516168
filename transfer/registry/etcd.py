"""The registry on etcd v3 (`etcd://HOST:PORT[,HOST:PORT...]/PREFIX`), through the async
`aetcd` client.

Keys: `/PREFIX/engines/ENGINE/ranks/RANK`, each holding one rank's `RankDescriptor` in the
wire envelope (so a malformed or foreign value is refused as `MetadataError`), under an
etcd lease of `Timeouts.lease` seconds that the rank refreshes: a dead rank's key expires
with its lease, and a member restart keeps whatever was written (etcd persists keys and
leases). A lookup reads the engine's keys and, while ranks are missing, watches them from
the revision it read rather than polling. Every call is bounded: an unreachable etcd is a
`PeerLostError` (or `DeadlineExceeded`) within the call's timeout, never a hang, and a
lookup within `Timeouts.lookup` whatever its deadline; bad credentials or a user without
rights on the prefix are an `AuthError`. After an outage the client's channel reconnects
within a fraction of a second of etcd answering (gRPC's own backoff grows to minutes),
and a lookup whose watch died with etcd reads anew and watches on the new connection.

A cluster's members are listed in the URL. The client talks to one; when that one cannot
be reached, a call moves on to the next (aetcd connects to a single endpoint), so a member
that stops or restarts costs a failed connection, not the registry. Leases are the
cluster's, so a rank keeps its lease across members.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import unquote, urlsplit

import aetcd
import aetcd.exceptions
from aetcd import rpc

from pdkv.errors import (
    AuthError,
    DeadlineExceeded,
    NotReadyError,
    PdkvError,
    PeerLostError,
    TransferError,
    UnknownEngineError,
)
from transfer.deadline import Deadline, retry_until
from transfer.metadata import EngineDescriptor, RankDescriptor, decode, encode
from transfer.registry.base import assemble
from transfer.timeouts import Timeouts

logger = logging.getLogger(__name__)

T = TypeVar("T")

# gRPC's own reconnect backoff grows to minutes, and a client found etcd back only that late.
_RECONNECT_BACKOFF_MS = (100, 500)  # (first, most) between connection attempts
_FIRST_PAUSE_S = 0.05  # the first pause between calls while etcd cannot be reached (the most: `Timeouts.retry_pause`)

# etcd keeps auth tokens in memory: a restart forgets them, and one unused for a while lapses.
_TOKEN_LAPSED = re.compile(r"invalid auth token|auth store is old")
_AUTH_FAILURE = re.compile(r"authentication failed|user name is empty|invalid auth token|permission denied")


def etcd_target(url: str) -> tuple[list[tuple[str, int]], str, str | None, str | None]:
    """(member endpoints, key prefix, user, password) of an `etcd://` URL."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    endpoints = []
    for member in hosts.split(","):
        host, _, port = member.rpartition(":") if ":" in member else (member, "", "")
        if not host:
            raise ValueError(f"registry URL {url!r} names no host")
        try:
            endpoints.append((host, int(port) if port else 2379))
        except ValueError as exc:
            raise ValueError(f"registry URL {url!r}: {member!r} is not HOST:PORT") from exc
    prefix = parts.path.strip("/") or "pdkv"
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return endpoints, prefix, user, password


class EtcdRegistry:
    """Ranks as keys under leases; lookups that watch. One per exporter or fetcher."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        prefix: str,
        timeouts: Timeouts,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("an etcd registry needs at least one member")
        self.endpoints = endpoints
        self.prefix = prefix
        self.timeouts = timeouts
        self._credentials = (user, password)
        self._at = 0  # the member talked to
        self._client = self._connect()
        self._retired: list[aetcd.Client] = []  # clients of members moved away from
        self._lease_id: int | None = None  # this rank's lease, once registered

    @classmethod
    def from_url(cls, url: str, timeouts: Timeouts) -> EtcdRegistry:
        endpoints, prefix, user, password = etcd_target(url)
        return cls(endpoints, prefix, timeouts, user, password)

    @property
    def where(self) -> str:
        host, port = self.endpoints[self._at]
        return f"etcd://{host}:{port}/{self.prefix}"

    def _connect(self) -> aetcd.Client:
        host, port = self.endpoints[self._at]
        user, password = self._credentials
        first, most = _RECONNECT_BACKOFF_MS
        options = {
            "grpc.initial_reconnect_backoff_ms": first,
            "grpc.max_reconnect_backoff_ms": most,
            # despite its name, the least time gRPC core gives one connection attempt
            "grpc.min_reconnect_backoff_ms": int(self.timeouts.connect * 1e3),
        }
        return aetcd.Client(
            host, port, username=user, password=password, options=options, connect_wait_timeout=self.timeouts.connect
        )

    async def _replace(self, failed: aetcd.Client, move: bool) -> aetcd.Client:
        """A new client in place of `failed`, on the next member if `move`, unless a
        concurrent call already replaced it (two failing calls must not skip a healthy member)."""
        if self._client is not failed:
            return self._client
        self._retired.append(self._client)
        if move:
            self._at = (self._at + 1) % len(self.endpoints)
            logger.info("etcd: moving to member %s", self.where)
        self._client = self._connect()
        # A client left behind is closed only once as many replacements have followed as there
        # are members: closing it at once cancelled the calls and watches still waiting on it
        # (gRPC ends them with CancelledError, which would read as the caller's own).
        if len(self._retired) > len(self.endpoints):
            await _close_quietly(self._retired.pop(0), "an etcd client left behind", self.timeouts.connect)
        return self._client

    async def _authenticated(self, call: Callable[[aetcd.Client], Awaitable[T]], client: aetcd.Client) -> T:
        """`call(client)`, and once more on a new client (which authenticates anew) when etcd
        no longer knows the client's token: aetcd never asks for another."""
        try:
            return await call(client)
        except aetcd.exceptions.ClientError as exc:
            if self._credentials == (None, None) or not _TOKEN_LAPSED.search(str(exc)):
                raise
            logger.info("etcd %s refused this client's auth token (%s): authenticating anew", self.where, exc)
        return await call(await self._replace(client, move=False))

    def _engine_key(self, engine_id: str) -> bytes:
        return f"/{self.prefix}/engines/{engine_id}/ranks/".encode()

    def _rank_key(self, engine_id: str, cp_rank: int) -> bytes:
        return self._engine_key(engine_id) + str(cp_rank).encode()

    async def _call(self, what: str, call: Callable[[aetcd.Client], Awaitable[T]], timeout: float | None = None) -> T:
        """One etcd call, bounded, its failures in the pdkv tree. A member that refuses or
        does not answer hands the call to the next: each member left gets an equal share
        of what remains of the bound (at least `Timeouts.attempt`: a busy member is not a dead one),
        and the last one all of it."""
        limit = self.timeouts.request if timeout is None else timeout
        end = asyncio.get_running_loop().time() + limit
        members = len(self.endpoints)
        for tried in range(1, members + 1):
            remaining = max(0.0, end - asyncio.get_running_loop().time())
            share = min(remaining, max(remaining / (members - tried + 1), self.timeouts.attempt))
            client = self._client
            try:
                return await asyncio.wait_for(self._authenticated(call, client), share)
            except asyncio.TimeoutError as exc:
                if tried == members:
                    raise DeadlineExceeded(f"{what} on {self.where}: no answer in {limit:.1f}s") from exc
            except (aetcd.exceptions.ClientError, rpc.AioRpcError) as exc:
                error = self._translate(exc, what)
                if not isinstance(error, PeerLostError) or tried == members:
                    raise error from exc
            await self._replace(client, move=True)
        raise AssertionError("unreachable")  # the last member's outcome returned or raised

    def _translate(self, exc: Exception, what: str) -> PdkvError:
        """aetcd's (and gRPC's) failures into the pdkv tree. etcd answers bad credentials with
        INVALID_ARGUMENT and a missing right with PERMISSION_DENIED, which aetcd passes raw."""
        text = exc.details() if isinstance(exc, rpc.AioRpcError) else str(exc)
        denied = isinstance(exc, rpc.AioRpcError) and exc.code() == rpc.StatusCode.PERMISSION_DENIED
        if denied or isinstance(exc, aetcd.exceptions.UnauthenticatedError) or _AUTH_FAILURE.search(text):
            return AuthError(f"{what} on {self.where}: {text}")
        if isinstance(exc, rpc.AioRpcError):
            return TransferError(f"{what} on {self.where}: {exc.code().name}: {text}")
        if _not_found(exc):  # an answer (aetcd wraps NOT_FOUND in its base class), not a lost member
            return TransferError(f"{what} on {self.where}: NOT_FOUND: {text}")
        return PeerLostError(f"{what} on {self.where}: {type(exc).__name__}: {text}", self.where)

    async def register(self, descriptor: RankDescriptor) -> None:
        """Refresh this rank's lease; grant a new one and write the key when it has lapsed."""
        lease_id = self._lease_id
        if lease_id is not None:
            reply = await self._call("refresh lease", lambda c: c.refresh_lease(lease_id))
            if reply is not None and reply.TTL > 0:
                return
            logger.warning("etcd lease of %s/%d lapsed: registering anew", descriptor.engine_id, descriptor.cp_rank)
        lease = await self._call("grant lease", lambda c: c.lease(math.ceil(self.timeouts.lease)))
        key = self._rank_key(descriptor.engine_id, descriptor.cp_rank)
        value = encode(descriptor, descriptor.fingerprint)
        await self._call("put", lambda c: c.put(key, value, lease=lease.id))
        self._lease_id = lease.id

    async def leave(self, engine_id: str, cp_rank: int) -> None:
        await self._call("delete", lambda c: c.delete(self._rank_key(engine_id, cp_rank)))
        if self._lease_id is not None:
            lease_id, self._lease_id = self._lease_id, None
            try:
                await self._call("revoke lease", lambda c: c.revoke_lease(lease_id))
            except TransferError as exc:
                # An attempt that timed out on one member may have revoked it before the
                # next member was asked: a lease that is gone is what leaving wants.
                if not _not_found(exc):
                    raise
                logger.info("etcd lease %x was gone already (revoked before, or expired)", lease_id)

    async def _read(self, engine_id: str, deadline: Deadline) -> tuple[list[RankDescriptor], int]:
        """The engine's descriptors, oldest write first, and the revision they were read at."""
        key = self._engine_key(engine_id)
        got = await self._call("get", lambda c: c.get_prefix(key), deadline.left())
        kvs = sorted(got, key=lambda kv: kv.mod_revision)
        ranks = [decode(kv.value, RankDescriptor) for kv in kvs]
        return ranks, got.header.revision

    async def _read_retrying(self, engine_id: str, deadline: Deadline) -> tuple[list[RankDescriptor], int]:
        """`_read`, retried while etcd cannot be reached (restarting, or the client's channel
        still backing off after a refused connection) until the deadline."""
        return await retry_until(
            lambda: self._read(engine_id, deadline),
            deadline,
            PeerLostError,
            "etcd not reachable",
            first=_FIRST_PAUSE_S,
            cap=self.timeouts.retry_pause,
        )

    async def lookup(self, engine_id: str, deadline: Deadline) -> EngineDescriptor:
        deadline = deadline.within(self.timeouts.lookup)
        while True:
            ranks, revision = await self._read_retrying(engine_id, deadline)
            try:
                return assemble(engine_id, ranks)
            except (NotReadyError, UnknownEngineError) as exc:
                if deadline.remaining() <= 0:
                    raise
                logger.debug("engine %s not complete (%s): watching its keys", engine_id, exc)
                try:
                    await self._next_change(engine_id, revision + 1, deadline, exc)
                except PeerLostError as lost:  # the member went away under the watch: read again, elsewhere
                    logger.info("etcd watch of %s lost: %s", engine_id, lost)

    async def _next_change(self, engine_id: str, revision: int, deadline: Deadline, pending: Exception) -> None:
        """Return at the first write to the engine's keys from `revision` on; at the deadline
        raise what kept the lookup waiting."""
        key = self._engine_key(engine_id)
        watch = await self._call("watch", lambda c: c.watch_prefix(key, start_revision=revision), deadline.left())

        async def first_event() -> None:
            async for _ in watch:
                return

        try:
            await asyncio.wait_for(first_event(), deadline.remaining())
        except asyncio.TimeoutError:
            raise type(pending)(f"{pending} (watched until the deadline)") from None
        except (aetcd.exceptions.ClientError, rpc.AioRpcError) as exc:
            raise self._translate(exc, "watch") from exc
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), self.timeouts.request)
            except Exception as exc:  # the stream may already be gone with etcd
                logger.debug("cancelling a watch on %s: %s", self.where, exc)

    async def aclose(self) -> None:
        for client in [*self._retired, self._client]:
            await _close_quietly(client, self.where, self.timeouts.connect)
        self._retired.clear()


async def _close_quietly(client: aetcd.Client, what: str, timeout: float) -> None:
    """Close an etcd client, bounded; closing must not fail a shutdown, etcd may be gone."""
    try:
        await asyncio.wait_for(client.close(), timeout)
    except Exception as exc:
        logger.warning("closing the etcd client of %s: %s", what, exc)


def _not_found(exc: BaseException | None) -> bool:
    """Whether etcd answered NOT_FOUND somewhere along `exc`'s chain of causes."""
    while exc is not None:
        if isinstance(exc, rpc.AioRpcError) and exc.code() == rpc.StatusCode.NOT_FOUND:
            return True
        exc = exc.__cause__
    return False
