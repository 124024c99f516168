"""Messages between the PD router and its workers (same envelope as `transfer.metadata`)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from transfer.metadata import RoomTicket

Room = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Tokens = Annotated[int, Meta(ge=1, le=1 << 24)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
# What remains of the request's end-to-end deadline when the message is sent (see
# transfer.deadline); None: the worker's own default.
BudgetMs = Annotated[int, Meta(ge=0, le=2**31 - 1)]


# Each subclass repeats frozen=True: msgspec inherits it, type checkers do not (PEP 681).
class _Api(Struct, frozen=True, forbid_unknown_fields=True):
    pass


class PrefillRequest(_Api, frozen=True):
    room: Room
    num_tokens: Tokens
    prefix_id: Annotated[int, Meta(ge=-1, le=2**31 - 1)] = -1  # -1: no shared prefix
    prefix_tokens: Count = 0
    consumers: Annotated[int, Meta(ge=1, le=64)] = 1
    budget_ms: BudgetMs | None = None
    # Reply with the room's ticket, which holds one of its claims; False: every consumer
    # claims (a decode that starts before the prefill ends, say).
    ticket: bool = True


class PrefillReply(_Api, frozen=True):
    room: Room
    pages: Count
    seconds: float
    ticket: RoomTicket | None = None  # None: the room is read by claims (no pin slot free)


class DecodeRequest(_Api, frozen=True):
    engine_id: Annotated[str, Meta(min_length=1, max_length=256)]
    room: Room
    num_tokens: Tokens
    prefix_id: Annotated[int, Meta(ge=-1, le=2**31 - 1)] = -1
    prefix_tokens: Count = 0
    budget_ms: BudgetMs | None = None
    ticket: RoomTicket | None = None  # the prefill's, when the decode starts after it


class DecodeReply(_Api, frozen=True):
    room: Room
    nbytes: Annotated[int, Meta(ge=0)]
    descriptors: Count
    fetch_seconds: float
    verified_bytes: int
    read_seconds: float = 0.0  # inside UCX READs, summed over owners (lanes read several at once)
    reads: Count = 0  # batched READs; more than one per owner means it began before prefill ended
    decoder: str = ""  # which decode worker fetched: `fetch_started` is on its clock
    control_messages: Count = 0  # the fetch's (`FetchResult.control_messages`)
    fetch_started: float = 0.0  # that worker's monotonic clock when the fetch began
