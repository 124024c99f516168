"""The decode's signals over UCX: pin words READ from an owner's host memory, and release
notifications, whatever lane reads the owner's pages (`transfer.lanes.base.Signals`).

They share the UCX lane's transport: an owner that lane reads is connected once, for both.
"""

from __future__ import annotations

import torch

from transfer.deadline import Deadline
from transfer.lanes.ucx.lane import exported_regions
from transfer.lanes.ucx.transport import UcxTransport
from transfer.metadata import RankDescriptor


class UcxSignals:
    """Pin words and notifications over `transport` (one made with `notifies=True`)."""

    def __init__(self, transport: UcxTransport) -> None:
        self.transport = transport

    @property
    def closed(self) -> bool:
        return self.transport.closed

    async def connect(self, rank: RankDescriptor) -> None:
        await self.transport.add_peer(rank.agent_name, rank.agent_metadata, exported_regions(rank))

    async def disconnect(self, rank: RankDescriptor) -> None:
        await self.transport.remove_peer(rank.agent_name)

    def register(self, windows: torch.Tensor) -> None:
        self.transport.register([windows])

    async def read_word(self, agent_name: str, addr: int, window: torch.Tensor, deadline: Deadline) -> None:
        await self.transport.read_host(agent_name, addr, window, deadline)

    def notify(self, messages: list[tuple[str, bytes]]) -> list[str]:
        return self.transport.notify(messages)

    async def drain(self) -> None:
        await self.transport.drain_notifications()

    async def aclose(self) -> None:
        await self.transport.aclose()
