"""What exporters and fetchers ask of a registry, whatever keeps it: the client protocol,
an engine assembled from its ranks, and registration retried while the registry is away."""

from __future__ import annotations

from typing import Protocol

from pdkv.errors import NotReadyError, PdkvError, UnknownEngineError
from transfer.deadline import Deadline, retry_until
from transfer.metadata import EngineDescriptor, RankDescriptor
from transfer.metrics import observe_register_failure

__all__ = ["RegistryClient", "assemble", "register_until"]


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


async def register_until(
    registry: RegistryClient, descriptor: RankDescriptor, deadline: Deadline, pause: float
) -> None:
    """Register, retrying with backoff while the registry is not reachable, until `deadline`;
    `pause` (`Timeouts.retry_pause`): the longest between attempts."""

    async def attempt() -> None:
        try:
            await registry.register(descriptor)
        except PdkvError as exc:
            observe_register_failure(exc)
            raise

    await retry_until(attempt, deadline, PdkvError, "registering", cap=pause)
