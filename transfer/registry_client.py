"""The bootstrap registry as prefill ranks and decodes see it: HTTP (built-in) or etcd.

A registry URL picks the backend: `http://HOST:PORT` is pdkv's own registry
(`transfer.bootstrap`), `etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/PREFIX]` an etcd
v3 cluster (its members listed),
the store NIXL and Dynamo keep this kind of metadata in. Both keep a rank's descriptor
under a lease (a rank that dies drops out by itself) and answer a lookup only once every
CP rank of the engine is in. On etcd a decode waits for the missing ranks by watching the
engine's keys instead of polling, and etcd's own users and passwords guard the keys.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit

from pdkv.errors import NotReadyError, PdkvError, UnknownEngineError
from transfer.deadline import Deadline, retry_until
from transfer.http import ControlClient
from transfer.metadata import EngineDescriptor, RankDescriptor
from transfer.timeouts import Timeouts

__all__ = ["RegistryClient", "HttpRegistry", "registry_client"]

_REGISTER_PAUSE_S = 0.25  # the longest pause between registration attempts while the registry is away


class RegistryClient(Protocol):
    """What an exporter and a fetcher need of a registry."""

    async def register(self, descriptor: RankDescriptor) -> None:
        """Put (or renew) this rank's descriptor under its lease; one attempt."""

    async def leave(self, engine_id: str, cp_rank: int) -> None:
        """Take the rank's descriptor out at once."""

    async def lookup(self, engine_id: str, deadline: Deadline) -> EngineDescriptor:
        """The engine once every CP rank is in, waiting for the rest until `deadline` or
        `Timeouts.lookup`, whichever comes first."""

    async def aclose(self) -> None: ...


def registry_client(url: str, timeouts: Timeouts, secret: str | None = None) -> RegistryClient:
    """The client for `url`'s scheme (`http`, `https` or `etcd`)."""
    scheme = urlsplit(url).scheme
    if scheme in ("http", "https"):
        return HttpRegistry(url, timeouts, secret)
    if scheme == "etcd":
        try:
            from transfer.etcd_registry import EtcdRegistry
        except ImportError as exc:
            raise ImportError(f"registry URL {url!r} needs the etcd client: pip install 'pdkv[etcd]' ({exc})") from exc
        return EtcdRegistry.from_url(url, timeouts)
    raise ValueError(f"registry URL {url!r}: the scheme must be http, https or etcd")


def assemble(engine_id: str, ranks: list[RankDescriptor]) -> EngineDescriptor:
    """An engine from its ranks' descriptors, oldest first: typed errors while incomplete."""
    if not ranks:
        raise UnknownEngineError(f"engine {engine_id!r} is not registered")
    size = ranks[-1].cp_size  # the newest decides: a restart with a new shape wins
    by_rank = {r.cp_rank: r for r in ranks if r.cp_size == size}
    missing = sorted(set(range(size)) - set(by_rank))
    if missing:
        raise NotReadyError(f"engine {engine_id!r}: ranks {missing} of {size} not registered")
    return EngineDescriptor(engine_id, size, [by_rank[r] for r in range(size)])


class HttpRegistry:
    """pdkv's built-in registry (`transfer.bootstrap.RegistryServer`) over HTTP."""

    def __init__(self, url: str, timeouts: Timeouts, secret: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self._client = ControlClient(timeouts, secret)

    def _rank_url(self, engine_id: str, cp_rank: int) -> str:
        return f"{self.url}/v1/engines/{engine_id}/ranks/{cp_rank}"

    async def register(self, descriptor: RankDescriptor) -> None:
        url = self._rank_url(descriptor.engine_id, descriptor.cp_rank)
        await self._client.request("PUT", url, body=descriptor, fingerprint=descriptor.fingerprint)

    async def leave(self, engine_id: str, cp_rank: int) -> None:
        await self._client.request("DELETE", self._rank_url(engine_id, cp_rank))

    async def lookup(self, engine_id: str, deadline: Deadline) -> EngineDescriptor:
        url = f"{self.url}/v1/engines/{engine_id}"
        deadline = deadline.within(self.timeouts.lookup)

        async def get() -> EngineDescriptor:
            limit = deadline.left(self.timeouts.request)
            found = await self._client.request("GET", url, EngineDescriptor, timeout=limit)
            assert found is not None  # a reply kind was given: a reply or an error
            return found

        return await retry_until(get, deadline, (NotReadyError, UnknownEngineError), f"engine {engine_id}", cap=0.5)

    async def aclose(self) -> None:
        await self._client.aclose()


async def register_until(registry: RegistryClient, descriptor: RankDescriptor, deadline: float) -> None:
    """Register, retrying with backoff while the registry is not reachable, until `deadline`
    (a `time.monotonic()` instant)."""
    await retry_until(
        lambda: registry.register(descriptor), Deadline(deadline), PdkvError, "registering", cap=_REGISTER_PAUSE_S
    )
