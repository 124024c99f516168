"""What a fetch reports: bytes, time and path per owner, and the fetch as a whole."""

from __future__ import annotations

import msgspec

__all__ = ["FetchResult", "OwnerStats"]


# Structs, not frozen dataclasses: several are built on every fetch's path, and a frozen
# dataclass's __init__ costs ten times a struct's.
class OwnerStats(msgspec.Struct, frozen=True):
    cp_rank: int
    layers: tuple[int, int]
    nbytes: int
    descriptors: int
    reads: int
    seconds: float  # from the first poll to the last byte from this owner
    read_seconds: float  # inside READs only (the rest is waiting for prefill)
    lane: str = "ucx"  # what moved the bytes: "ucx", or "cuda_ipc" (the same-host GPU lane)
    aux: bytes | None = None  # the request's auxiliary bytes, where this owner had them


class FetchResult(msgspec.Struct, frozen=True):
    engine_id: str
    room: int
    nbytes: int
    seconds: float  # from the call (`fetch`, or a lease's `read`) to its return
    owners: tuple[OwnerStats, ...]
    # This fetch's release was the room's last on every owner. With several consumers the
    # last release on each owner may belong to different fetches, so none may say so:
    # `freed_on` is the per-owner answer.
    freed: bool = False
    control_messages: int = 0  # HTTP requests to owners (claims, polls, releases); the lookup is cached
    # The CP ranks on which this fetch's release was the room's last (its pages freed there).
    # Over all of a room's consumers, each rank appears in exactly one fetch's `freed_on`.
    freed_on: tuple[int, ...] = ()

    @property
    def aux(self) -> bytes | None:
        """The request's auxiliary bytes (given with a chunked room's last chunk), from
        the lowest CP rank that had them; None if the prefill gave none."""
        return next((o.aux for o in sorted(self.owners, key=lambda o: o.cp_rank) if o.aux is not None), None)

    @property
    def descriptors(self) -> int:
        return sum(o.descriptors for o in self.owners)

    @property
    def read_seconds(self) -> float:
        return sum(o.read_seconds for o in self.owners)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
