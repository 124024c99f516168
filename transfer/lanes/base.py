"""What a lane is: the only kind of code that moves a room's bytes from an owner into local pages.

A lane reads the pages of some layers of one owner (a prefill CP rank) into a decode's
pages, one-sided: the owner is never asked. The decode picks a lane for each owner from
an ordered list (`reach` says why a lane cannot read it; the first that can, opens it),
much as httpx mounts transports or NIXL takes `backends=[...]`. Everything else about a
fetch (claims, readiness, releases, pin words) is the decode's protocol, the same for every
lane. Today's lanes: `transfer.lanes.ucx` (UCX through NIXL, anywhere) and
`transfer.lanes.cuda_ipc` (the same host's GPUs, CUDA IPC and one gather kernel).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from transfer.deadline import Deadline
from transfer.lanes.runs import BufferPair
from transfer.metadata import RankDescriptor

__all__ = ["Lane", "LanePeer", "MergedRead", "ReadGroup", "ReadSlot", "ReadStats", "Watch", "host_id"]

Pairs = dict[int, tuple[BufferPair, BufferPair]]  # layer -> (latent, index), local and remote


class Watch(Protocol):
    """Told, on a lane's own thread, that a read's bytes are in place, before the decode's
    loop hears of it (`transfer.decode.landing`: a synchronous caller's outcome)."""

    def landed(self) -> bool:
        """The bytes are in place; True if the read's caller was given its outcome here (the
        loop's continuation may then wait). Never raises."""
        ...


@dataclass(frozen=True)
class ReadStats:
    """One read: bytes, descriptors (0 where none are posted), seconds moving bytes, parts."""

    nbytes: int
    descriptors: int
    seconds: float
    pieces: int = 1


class LanePeer(Protocol):
    """What a lane opened for one owner (its connection or its mappings)."""

    cp_rank: int
    closed: bool


class ReadSlot(Protocol):
    """One owner's place in a `ReadGroup`: read through it once, or close it to withdraw."""

    def read(self, peer: Any, layers: range, src: np.ndarray, dst: np.ndarray) -> Awaitable[ReadStats]: ...

    def close(self) -> None: ...


class ReadGroup(Protocol):
    """Several owners of one fetch read as one operation, once each has joined or withdrawn."""

    def slot(self) -> ReadSlot: ...


class MergedRead(Protocol):
    """A room's owners on one lane, read together over one source page list (a ticket's)."""

    @property
    def shares(self) -> tuple[tuple[Any, int], ...]:
        """Each peer (by CP rank) and its bytes a page."""
        ...

    @property
    def page_bytes(self) -> int: ...


@runtime_checkable
class Lane(Protocol):
    """Moves bytes from owners into the decode's pool. Every method checks what it is given
    (page ids, addresses) before anything is posted or launched."""

    name: str  # what `OwnerStats.path` says: "ucx", "cuda_ipc"
    merges: bool  # `merged` reads several owners together

    def reach(self, rank: RankDescriptor) -> str | None:
        """Why this lane cannot read `rank`, or None if it can."""
        ...

    async def open(self, rank: RankDescriptor, pairs: Pairs) -> Any:
        """Connect to or map `rank`, eagerly (at lookup); raises `TransferError` if it cannot."""
        ...

    async def close(self, peer: Any) -> None:
        """Drop what `open` made, once nothing of this lane can still read it."""
        ...

    async def read(self, peer: Any, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline) -> ReadStats:
        """Copy `src` pages of `layers` of `peer` into `dst` pages; returns once they are in
        place, or raises (cancelled: once nothing more can land)."""
        ...

    def group(self, expected: int) -> ReadGroup | None:
        """A group in which `expected` owners' reads go out as one, or None (no gain here)."""
        ...

    def merged(self, peers: tuple[Any, ...]) -> MergedRead | None:
        """The read of every layer of `peers` together, or None (this lane reads one at a time)."""
        ...

    def read_merged(
        self, merged: Any, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None
    ) -> Awaitable[float]:
        """Run `merged` over `src` into `dst` (ids known to lie below `dst_below`); its seconds.
        A lane that learns on a thread of its own when the bytes are in place tells `watch`
        there; others ignore it."""
        ...

    def prime(self) -> None:
        """A read is about to come: get ready for it (may do nothing)."""
        ...

    async def aclose(self) -> None: ...


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This host as one kernel sees it: processes with the same id share memory (CUDA IPC,
    memfds) directly."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}:{boot}"
