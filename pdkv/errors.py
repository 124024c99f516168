"""The one error tree of pdkv and of the transfer layer built on it.

Every failure a caller can act on is a `PdkvError`. Errors from NIXL, UCX, HTTP and
torch.distributed are translated into this tree at the boundary that sees them.
"""

from __future__ import annotations

__all__ = [
    "PdkvError",
    "LayoutError",
    "IncompatibleLayoutError",
    "PageRangeError",
    "CapacityError",
    "MetadataError",
    "TransferError",
    "PeerLostError",
    "UnknownRoomError",
    "UnknownEngineError",
    "NotReadyError",
    "DeadlineExceeded",
    "AuthError",
    "ConflictError",
    "RoomClaimedError",
    "ClaimLostError",
    "RoomAbortedError",
    "InvalidPagesError",
    "ClosedError",
]


class PdkvError(Exception):
    """Base class of every error pdkv raises on purpose."""


class LayoutError(PdkvError, ValueError):
    """A KV layout (geometry) that cannot exist: zero pages, a bad shard plan, ..."""


class IncompatibleLayoutError(LayoutError):
    """Two sides of a transfer disagree on the KV geometry."""

    def __init__(self, message: str, differing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.differing = differing


class PageRangeError(PdkvError, IndexError):
    """A token location, page index or layer id lies outside the pool."""


class CapacityError(PdkvError):
    """No free pages (or other pool capacity) left for a request."""


class InvalidPagesError(PdkvError, ValueError):
    """A page list that is not a 1-D sequence of distinct integer page ids."""


class MetadataError(PdkvError, ValueError):
    """A wire message that is malformed, of another schema version, or inconsistent."""


class TransferError(PdkvError):
    """A UCX transfer failed or could not be set up."""


class PeerLostError(TransferError):
    """A peer (prefill owner, registry, decode) died or stopped answering. `owner`: the
    (engine, CP rank) it was, once known."""

    def __init__(self, message: str, peer: str = "", owner: tuple[str, int] | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.owner = owner


class UnknownRoomError(PdkvError, KeyError):
    """A room that the prefill side does not know or has already released."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownEngineError(PdkvError, KeyError):
    """No rank of this prefill engine is registered (a sibling of `UnknownRoomError`: an
    unknown engine is not an unknown room)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NotReadyError(PdkvError):
    """The peer exists but is not complete yet (e.g. not every CP rank registered)."""


class DeadlineExceeded(PdkvError, TimeoutError):
    """An operation did not finish before its deadline."""


class AuthError(PdkvError, PermissionError):
    """A request without the shared secret the service was started with."""


class ConflictError(PdkvError):
    """The request conflicts with the target's state (already published, already in flight)."""


class RoomClaimedError(ConflictError):
    """Every consumer claim the room was published with is taken: a second fetch of a
    single-consumer room (a duplicate decode, or a retry under a new claim)."""


class ClaimLostError(TransferError):
    """A claim no longer pins the room's source pages (the room was aborted or its pin
    expired, or the claim is unknown there): bytes read under it may belong to another room."""


class RoomAbortedError(ClaimLostError):
    """The room was aborted (by its prefill, by its decode, or its pin expired) before it was
    read: the read stops, and whatever landed is not the room's."""


class ClosedError(PdkvError):
    """An object used before it was started or after it was closed."""
