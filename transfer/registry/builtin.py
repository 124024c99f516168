"""pdkv's built-in registry (`transfer.registry.server`) as its clients see it, over HTTP."""

from __future__ import annotations

from pdkv.errors import NotReadyError
from transfer.control import ControlClient
from transfer.deadline import Deadline, retry_until
from transfer.metadata import EngineDescriptor, RankDescriptor
from transfer.timeouts import Timeouts


class HttpRegistry:
    """pdkv's built-in registry (`transfer.registry.server.RegistryServer`) over HTTP."""

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

        # UnknownEngineError is the registry's answer that it never saw the engine (past its
        # start-up grace, `transfer.registry.server.Registry`): a mistyped id, raised at once.
        return await retry_until(get, deadline, NotReadyError, f"engine {engine_id}", cap=0.5)

    async def aclose(self) -> None:
        await self._client.aclose()
