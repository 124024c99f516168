"""The registry on etcd v3 (`etcd://HOST:PORT/PREFIX`), through the async `aetcd` client.

Keys: `/PREFIX/engines/ENGINE/ranks/RANK`, each holding one rank's `RankDescriptor` in the
wire envelope (so a malformed or foreign value is refused as `MetadataError`), under an
etcd lease of `Timeouts.lease` seconds that the rank refreshes: a dead rank's key expires
with its lease, and a member restart keeps whatever was written (etcd persists keys and
leases). A lookup reads the engine's keys and, while ranks are missing, watches them from
the revision it read rather than polling. Every call is bounded: an unreachable etcd is a
`PeerLostError` (or `DeadlineExceeded`) within the call's timeout, never a hang; bad
credentials or a user without rights on the prefix are an `AuthError`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Awaitable
from typing import Any, TypeVar
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
from transfer.deadline import Deadline
from transfer.metadata import EngineDescriptor, RankDescriptor, decode, encode
from transfer.registry_client import assemble
from transfer.timeouts import Timeouts

__all__ = ["EtcdRegistry"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_AUTH_FAILURE = re.compile(r"authentication failed|user name is empty|invalid auth token|permission denied")


def etcd_target(url: str) -> tuple[str, int, str, str | None, str | None]:
    """(host, port, key prefix, user, password) of an `etcd://` URL."""
    parts = urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"registry URL {url!r} names no host")
    prefix = parts.path.strip("/") or "pdkv"
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return parts.hostname, parts.port or 2379, prefix, user, password


class EtcdRegistry:
    """Ranks as keys under leases; lookups that watch. One per exporter or fetcher."""

    def __init__(
        self,
        host: str,
        port: int,
        prefix: str,
        timeouts: Timeouts,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self.where = f"etcd://{host}:{port}/{prefix}"
        self.prefix = prefix
        self.timeouts = timeouts
        self._client = aetcd.Client(host, port, username=user, password=password, connect_wait_timeout=3)
        self._lease: Any = None  # this rank's lease, once registered

    @classmethod
    def from_url(cls, url: str, timeouts: Timeouts) -> EtcdRegistry:
        host, port, prefix, user, password = etcd_target(url)
        return cls(host, port, prefix, timeouts, user, password)

    def _engine_key(self, engine_id: str) -> bytes:
        return f"/{self.prefix}/engines/{engine_id}/ranks/".encode()

    def _rank_key(self, engine_id: str, cp_rank: int) -> bytes:
        return self._engine_key(engine_id) + str(cp_rank).encode()

    async def _call(self, what: str, call: Awaitable[T], timeout: float | None = None) -> T:
        """One etcd call, bounded, its failures in the pdkv tree."""
        limit = self.timeouts.request if timeout is None else timeout
        try:
            return await asyncio.wait_for(call, limit)
        except asyncio.TimeoutError as exc:
            raise DeadlineExceeded(f"{what} on {self.where}: no answer in {limit:.1f}s") from exc
        except (aetcd.exceptions.ClientError, rpc.AioRpcError) as exc:
            raise self._translate(exc, what) from exc

    def _translate(self, exc: Exception, what: str) -> PdkvError:
        """aetcd's (and gRPC's) failures into the pdkv tree. etcd answers bad credentials with
        INVALID_ARGUMENT and a missing right with PERMISSION_DENIED, which aetcd passes raw."""
        text = exc.details() if isinstance(exc, rpc.AioRpcError) else str(exc)
        denied = isinstance(exc, rpc.AioRpcError) and exc.code() == rpc.StatusCode.PERMISSION_DENIED
        if denied or isinstance(exc, aetcd.exceptions.UnauthenticatedError) or _AUTH_FAILURE.search(text):
            return AuthError(f"{what} on {self.where}: {text}")
        if isinstance(exc, rpc.AioRpcError):
            return TransferError(f"{what} on {self.where}: {exc.code().name}: {text}")
        return PeerLostError(f"{what} on {self.where}: {type(exc).__name__}: {text}", self.where)

    async def register(self, descriptor: RankDescriptor) -> None:
        """Refresh this rank's lease; grant a new one and write the key when it has lapsed."""
        if self._lease is not None:
            reply = await self._call("refresh lease", self._lease.refresh())
            if reply is not None and reply.TTL > 0:
                return
            logger.warning("etcd lease of %s/%d lapsed: registering anew", descriptor.engine_id, descriptor.cp_rank)
        lease = await self._call("grant lease", self._client.lease(math.ceil(self.timeouts.lease)))
        key = self._rank_key(descriptor.engine_id, descriptor.cp_rank)
        await self._call("put", self._client.put(key, encode(descriptor, descriptor.fingerprint), lease=lease))
        self._lease = lease

    async def leave(self, engine_id: str, cp_rank: int) -> None:
        await self._call("delete", self._client.delete(self._rank_key(engine_id, cp_rank)))
        if self._lease is not None:
            lease, self._lease = self._lease, None
            await self._call("revoke lease", lease.revoke())

    async def _read(self, engine_id: str, deadline: Deadline) -> tuple[list[RankDescriptor], int]:
        """The engine's descriptors, oldest write first, and the revision they were read at."""
        got = await self._call("get", self._client.get_prefix(self._engine_key(engine_id)), deadline.left())
        kvs = sorted(got, key=lambda kv: kv.mod_revision)
        ranks = [decode(kv.value, RankDescriptor) for kv in kvs]
        return ranks, got.header.revision

    async def _read_retrying(self, engine_id: str, deadline: Deadline) -> tuple[list[RankDescriptor], int]:
        """`_read`, retried while etcd cannot be reached (restarting, or the client's channel
        still backing off after a refused connection) until the deadline."""
        delay = 0.1
        while True:
            try:
                return await self._read(engine_id, deadline)
            except PeerLostError as exc:
                if deadline.remaining() < delay:
                    raise
                logger.info("etcd not reachable (%s); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def lookup(self, engine_id: str, deadline: Deadline) -> EngineDescriptor:
        while True:
            ranks, revision = await self._read_retrying(engine_id, deadline)
            try:
                return assemble(engine_id, ranks)
            except (NotReadyError, UnknownEngineError) as exc:
                if deadline.remaining() <= 0:
                    raise
                logger.debug("engine %s not complete (%s): watching its keys", engine_id, exc)
                await self._next_change(engine_id, revision + 1, deadline, exc)

    async def _next_change(self, engine_id: str, revision: int, deadline: Deadline, pending: Exception) -> None:
        """Return at the first write to the engine's keys from `revision` on; at the deadline
        raise what kept the lookup waiting."""
        key = self._engine_key(engine_id)
        watch = await self._call("watch", self._client.watch_prefix(key, start_revision=revision), deadline.left())

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
                await asyncio.wait_for(watch.cancel(), 1.0)
            except Exception as exc:  # the stream may already be gone with etcd
                logger.debug("cancelling a watch on %s: %s", self.where, exc)

    async def aclose(self) -> None:
        try:
            await asyncio.wait_for(self._client.close(), 3.0)
        except Exception as exc:  # closing must not fail a shutdown; etcd may be gone
            logger.warning("closing the etcd client of %s: %s", self.where, exc)
