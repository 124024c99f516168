"""What a lane is: the only kind of code that moves a room's bytes from an owner into local pages.

A lane reads the pages of some layers of one owner (a prefill CP rank) into a decode's
pages, one-sided: the owner is never asked. The decode picks a lane for each owner from
an ordered list (`reach` says why a lane cannot read it; the first that can, opens it),
much as httpx mounts transports or NIXL takes `backends=[...]`; `transfer.lanes.choice`
makes that list. Everything else about a fetch (claims, readiness, releases) is the
decode's protocol, the same for every lane; what it says to an owner beside the bytes (pin
words, release notifications) goes through `Signals`. Today's lanes: `transfer.lanes.ucx`
(UCX through NIXL, anywhere; also the signals) and `transfer.lanes.cuda_ipc` (the same
host's GPUs, CUDA IPC and one gather kernel).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from transfer.deadline import Deadline
from transfer.lanes.runs import BufferPair
from transfer.metadata import RankDescriptor

__all__ = ["Batch", "Lane", "Peer", "ReadStats", "Signals", "Transport", "Watch", "host_id"]

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


class Peer(Protocol):
    """What a lane opened for one owner (its connection, or its mappings)."""

    @property
    def cp_rank(self) -> int: ...

    @property
    def layers(self) -> range:
        """The layers its owner holds."""
        ...


P = TypeVar("P", bound=Peer)
P_co = TypeVar("P_co", bound=Peer, covariant=True)


class Batch(Protocol[P_co]):
    """Several owners on one lane, every layer of each read as one operation over one source
    page list (a room's owners). Made once for a set of peers, read any number of times."""

    @property
    def shares(self) -> tuple[tuple[P_co, int], ...]:
        """Each peer (by CP rank) and its bytes a page."""
        ...

    @property
    def page_bytes(self) -> int: ...

    def read(self, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None) -> Awaitable[float]:
        """Copy `src` pages of every layer of each peer into `dst` pages (ids known to lie
        below `dst_below`); await it for its seconds once the bytes are in place. A lane that
        learns on a thread of its own when they are tells `watch` there; others ignore it."""
        ...


@runtime_checkable
class Lane(Protocol[P]):
    """Moves bytes from owners into the decode's pool. Every method checks what it is given
    (page ids, addresses) before anything is posted or launched."""

    name: str  # what `OwnerStats.lane` says: "ucx", "cuda_ipc"

    def reach(self, rank: RankDescriptor) -> str | None:
        """Why this lane cannot read `rank`, or None if it can."""
        ...

    async def open(self, rank: RankDescriptor, pairs: Pairs) -> P:
        """Connect to or map `rank`, eagerly (at lookup); raises `TransferError` if it cannot."""
        ...

    async def close(self, peer: P) -> None:
        """Drop what `open` made, once nothing of this lane can still read it."""
        ...

    async def read(self, peer: P, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline) -> ReadStats:
        """Copy `src` pages of `layers` of `peer` into `dst` pages; returns once they are in
        place, or raises (cancelled: once nothing more can land)."""
        ...

    def batch(self, peers: tuple[P, ...]) -> Batch[P] | None:
        """The read of every layer of `peers` as one operation, or None (this lane reads
        one owner at a time: owners' reads already run at once)."""
        ...

    def prime(self) -> None:
        """A read is about to come: get ready for it (may do nothing)."""
        ...

    async def aclose(self) -> None: ...


class Transport(Protocol):
    """What carries a decode's signals (and the UCX lane's reads), as the fetcher reports it."""

    @property
    def workers(self) -> int:
        """Threads that post READs."""
        ...

    @property
    def peer_count(self) -> int:
        """Owners connected."""
        ...


@runtime_checkable
class Signals(Protocol):
    """The decode's word with an owner beside its bytes, whatever lane reads those: the
    owner's pin words (a READ of its host memory) and release notifications (no reply).
    An owner that publishes a pin table is connected here at lookup, whichever lane reads it."""

    @property
    def closed(self) -> bool: ...

    @property
    def transport(self) -> Transport: ...

    async def connect(self, rank: RankDescriptor) -> None:
        """Connect to `rank` (a no-op where a lane over the same transport already did)."""
        ...

    async def disconnect(self, rank: RankDescriptor) -> None:
        """Drop the connection to `rank` (its owner died, re-registered or was forgotten)."""
        ...

    def register(self, windows: torch.Tensor) -> None:
        """Make `windows` (a contiguous host tensor) memory that pin words can be READ into."""
        ...

    async def read_word(self, agent_name: str, addr: int, window: torch.Tensor, deadline: Deadline) -> None:
        """READ `window.nbytes` of `agent_name`'s host memory at `addr` (a pin table's words)
        into `window` (within registered windows); `PeerLostError` where no connection is held."""
        ...

    def notify(self, messages: list[tuple[str, bytes]]) -> list[str]:
        """Send each (agent, message), no reply, best effort; returns the agents not sent to
        (no connection held), whose messages are dropped."""
        ...

    async def drain(self) -> None:
        """Let notifications just sent leave (before connections are dropped)."""
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
