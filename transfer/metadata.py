"""Wire types of pdkv: versioned msgpack messages decoded into typed, frozen structs.

Every message travels in an `Envelope` (schema version, layout fingerprint, kind, body).
The envelope is checked first: an unknown version or another layout is refused before
the body is even decoded. Bodies are msgspec structs: types, ranges and cross-field
rules are enforced while decoding, and every failure becomes `MetadataError` naming
the field.

Schema history:
  1: first version.
  2: MemoryDescriptor.device_id (the GPU a buffer lives on; 0 for host memory).
  3: claims: ClaimRequest; ReleaseNotice.claim; ReleaseReply replaces RoomState as the
     answer to a release; ErrorReply.lineage (the error's ancestors, so a receiver that
     does not know a class rebuilds its nearest known base).
  4: RankDescriptor.ipc: CUDA IPC handles of a GPU rank's owned slabs, for decodes on
     the same host (the same-host GPU lane).
  5: RankDescriptor.pins (a rank's pin table, readable by UCX, mappable on its host); RoomTicket and OwnerPin
     (what a decode needs to read a finished room without asking anyone); TicketRelease
     (a ticket holder's release, sent as a UCX notification).
  6: RoomState.ready_pages: rooms published by chunks of pages (a chunked prefill).
  7: RoomState.aux: an engine's per-request bytes, with a chunked room's last chunk.
  8: ReleaseNotice.abort: a consumer gives its claim up unread (its fetch failed or was
     cancelled); a room no consumer read ends aborted, not released.
  9: ClaimRequest.readers: how many reads the claimant's group makes of the room (a
     decode's attention-TP ranks each read it whole); the room grants at least that many.
 11: RoomState.pin: a claim's answer carries the room's pin slot and nonce, so a claim
     holder reads a finished room as a ticket holder does (its pin words proved after the
     data) and releases by notification (ClaimRelease).
 10: IpcSlab.kind optional (None: a slab holding buffers of either kind, such as one of an
     engine's own allocations) and IpcExport.slabs up to MAX_IPC_SLABS: an engine that keeps
     a tensor per layer exports one slab per allocation.
 12: IpcExport.vmm and fd_socket: owned buffers in VMM memory (expandable segments) as
     spans of chunks whose file descriptors the owner hands out over a Unix socket.
 13: RoomState.reason: why an aborted room ended where its prefill failed it (a bad chunk,
     a sender's error), so its decode fails naming the prefill's error, not only "aborted";
     ErrorReply.cause: the pdkv error an error was raised from (such a room's claim refused);
     RankDescriptor.group_size (an SGLang prefill's DP size, for its decodes' routing), and
     a rank's layers any run of the model's (a pipeline stage's split is the engine's own).
 14: ReadFrom: a claim holder whose decode holds the room's first pages (its prefix) tells
     each owner where its read starts (a UCX notification), so the owner frees the pages
     below every reader's start ahead of the release. ReleaseNotice.abort is named give_up:
     a consumer gives up; only a prefill aborts.
 15: ClaimAll, OwnerRef, OwnerClaim, ClaimAllReply: a decode asks the arbiter (the lowest CP
     rank) for its claim on every owner at once; the arbiter grants its own first (it
     decides a race) and relays the claim to the other owners: one round trip for the decode.
 16: HeldClaim, ReturnHeld, HeldReply, OwnerClaim.claim: the ranks above the arbiter hold a
     claim of each whole room for it, and it hands those to the room's first claimant with
     no relay (the token each rank holds it under); a held claim it will not hand out it
     returns.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta, Struct

from pdkv.errors import IncompatibleLayoutError, MetadataError, PdkvError
from pdkv.layout import BufferKind, KVLayout, geometry_fingerprint

__all__ = [
    "SCHEMA_VERSION",
    "MemoryDescriptor",
    "LayoutSpec",
    "IpcSlab",
    "IpcExport",
    "VmmSpan",
    "RankDescriptor",
    "EngineDescriptor",
    "RoomState",
    "RoomStatus",
    "PinTable",
    "OwnerPin",
    "RoomTicket",
    "TicketRelease",
    "ClaimRequest",
    "ClaimAll",
    "OwnerRef",
    "OwnerClaim",
    "ClaimAllReply",
    "HeldClaim",
    "HeldReply",
    "ReturnHeld",
    "ClaimRelease",
    "ReadFrom",
    "ReleaseNotice",
    "ReleaseReply",
    "ErrorReply",
    "error_reply",
    "error_from",
    "claim_token",
    "consumer_name",
    "encode",
    "decode",
    "decode_any",
]

SCHEMA_VERSION = 16

U63 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Count = Annotated[int, Meta(ge=0, le=2**31 - 1)]
Positive = Annotated[int, Meta(ge=1, le=2**40)]
Name = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@/-]+$")]
MAX_PAGES = 1 << 24
MAX_AUX_BYTES = 1 << 20
PageList = Annotated[list[Count], Meta(max_length=MAX_PAGES)]
ClaimToken = Annotated[str, Meta(min_length=16, max_length=64, pattern=r"^[0-9a-f]+$")]


# Each subclass repeats frozen=True: msgspec inherits it, type checkers do not (PEP 681).
class _Wire(Struct, frozen=True, forbid_unknown_fields=True):
    pass


class MemoryDescriptor(_Wire, frozen=True):
    """One registered buffer: a layer's latent KV or indexer pages on one rank."""

    kind: BufferKind
    layer_id: Count
    addr: U63  # user-space virtual addresses fit in 63 bits
    length: Positive
    item_len: Positive
    device_id: Annotated[int, Meta(ge=0, le=1023)] = 0

    def __post_init__(self) -> None:
        if self.length % self.item_len:
            raise ValueError(f"length {self.length} is not a multiple of item_len {self.item_len}")
        if self.addr + self.length > 2**63:
            raise ValueError("addr + length overflows 63 bits")

    @property
    def num_items(self) -> int:
        return self.length // self.item_len


class LayoutSpec(_Wire, frozen=True):
    """The geometry fields of a `KVLayout` (what its fingerprint covers)."""

    layer_num: Annotated[int, Meta(ge=1, le=4096)]
    start_layer: Count
    page_size: Annotated[int, Meta(ge=1, le=1 << 20)]
    kv_cache_dim: Annotated[int, Meta(ge=1, le=1 << 20)]
    store_dtype: Annotated[str, Meta(max_length=32)]
    dtype: Annotated[str, Meta(max_length=32)]
    kv_lora_rank: Count
    qk_rope_head_dim: Count
    index_head_dim: Annotated[int, Meta(ge=1, le=1 << 16)]

    @classmethod
    def of(cls, layout: KVLayout) -> LayoutSpec:
        return cls(**layout.geometry())  # type: ignore[arg-type]

    def check_against(self, layout: KVLayout) -> None:
        layout.check_geometry(msgspec.structs.asdict(self))


class IpcSlab(_Wire, frozen=True):
    """One owned slab as a CUDA IPC handle: layer buffers of its kind (of either kind, if
    None) lie inside it. A pool exports its two slabs; an engine that keeps a tensor per
    layer exports a slab per allocation, spanning the buffers inside it."""

    addr: U63  # the slab's address in the owner
    length: Positive
    alloc_offset: U63  # the slab's offset in the allocation the handle maps
    handle: Annotated[bytes, Meta(min_length=64, max_length=64)]
    kind: BufferKind | None = None

    def holds(self, b: MemoryDescriptor) -> bool:
        return (self.kind is None or self.kind is b.kind) and self.addr <= b.addr and b.addr + b.length <= self.end

    @property
    def end(self) -> int:
        return self.addr + self.length


MAX_IPC_SLABS = 2 * 4096  # a slab per buffer at most
MAX_VMM_CHUNKS = 1 << 16  # 20 MiB chunks: over a terabyte


class VmmSpan(_Wire, frozen=True):
    """Owned buffers in memory made by the driver's virtual memory management (expandable
    segments, memory savers): the physical chunks behind one span of owner addresses,
    handed over as file descriptors by the owner's descriptor socket under `key`."""

    addr: U63  # the first chunk's owner address: chunk offsets count from it
    chunks: Annotated[list[tuple[U63, Positive]], Meta(min_length=1, max_length=MAX_VMM_CHUNKS)]
    key: Annotated[str, Meta(min_length=16, max_length=64)]

    def holds(self, b: MemoryDescriptor) -> bool:
        """Whether every byte of buffer `b` lies in the span's chunks (they may leave gaps)."""
        at, end = b.addr - self.addr, b.addr - self.addr + b.length
        for offset, size in self.chunks:
            if offset <= at < offset + size:
                at = offset + size
            if at >= end:
                return True
        return False


class IpcExport(_Wire, frozen=True):
    """What a decode needs to map a GPU rank's memory: the same host, which GPU, and the
    memory as IPC slabs, as VMM spans (whose descriptors `fd_socket` hands out), or both."""

    host_id: Annotated[str, Meta(min_length=1, max_length=256)]
    gpu_uuid: Annotated[str, Meta(min_length=1, max_length=64)]
    slabs: Annotated[list[IpcSlab], Meta(max_length=MAX_IPC_SLABS)]
    vmm: Annotated[list[VmmSpan], Meta(max_length=MAX_IPC_SLABS)] = []
    fd_socket: Annotated[str, Meta(min_length=2, max_length=108)] | None = None  # a Unix socket address

    def __post_init__(self) -> None:
        if not self.slabs and not self.vmm:
            raise ValueError("an IPC export names at least one slab or VMM span")
        if self.vmm and self.fd_socket is None:
            raise ValueError("VMM spans come with the socket that hands out their descriptors")

    def slab_of(self, b: MemoryDescriptor) -> IpcSlab | None:
        """A slab that holds buffer `b` (a pool's two kinds may share one slab), or None."""
        return next((s for s in self.slabs if s.holds(b)), None)

    def holds(self, b: MemoryDescriptor) -> bool:
        """Whether buffer `b` lies in a slab or a VMM span."""
        return self.slab_of(b) is not None or any(v.holds(b) for v in self.vmm)


class PinTable(_Wire, frozen=True):
    """A rank's pin words in host memory registered with its UCX agent, one int64 a slot.

    A slot holds its room's random nonce while the room's pages are pinned, and is
    cleared before they are freed: a decode that READs the nonce after its data READs
    has proof that no page was freed or reused while it read, without asking anyone.
    """

    addr: U63  # slot 0's address in the owner, for UCX READs
    slots: Annotated[int, Meta(ge=1, le=1 << 20)]
    # For a decode on the same host: map the owner's table instead (transfer.prefill.pins).
    host_id: Annotated[str, Meta(min_length=1, max_length=256)]
    pid: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    fd: Annotated[int, Meta(ge=0, le=2**31 - 1)]
    tag: Annotated[int, Meta(ge=1, le=2**63 - 1)]

    @property
    def nbytes(self) -> int:
        return self.slots * 8


class RankDescriptor(_Wire, frozen=True):
    """What one prefill CP rank publishes: its layers, buffers and UCX connection blob."""

    engine_id: Name
    cp_rank: Count
    cp_size: Annotated[int, Meta(ge=1, le=1024)]
    layer_start: Count
    layer_end: Count
    fingerprint: Annotated[str, Meta(min_length=1, max_length=64)]
    layout: LayoutSpec
    buffers: Annotated[list[MemoryDescriptor], Meta(max_length=2 * 4096)]
    agent_name: Name
    agent_metadata: Annotated[bytes, Meta(max_length=2 << 20)]
    control_url: Annotated[str, Meta(min_length=1, max_length=512)]
    incarnation: Name
    ipc: IpcExport | None = None  # GPU ranks only
    pins: PinTable | None = None
    # Engines in this one's serving group, which a decode picks among by the request (an
    # SGLang prefill's DP size: engines dp0..dp<n-1>, a room on dp<room % n>).
    group_size: Annotated[int, Meta(ge=1, le=1024)] = 1

    def __post_init__(self) -> None:
        if self.cp_rank >= self.cp_size:
            raise ValueError(f"cp_rank {self.cp_rank} >= cp_size {self.cp_size}")
        if self.fingerprint != geometry_fingerprint(msgspec.structs.asdict(self.layout)):
            raise ValueError("fingerprint does not match the layout it travels with")
        # Any contiguous run of the model's layers: a CP shard, or a pipeline stage's (whose
        # split is the engine's own); that an engine's owners cover each layer once is the
        # decode's check (`check_owners`).
        start, end = self.layer_start, self.layer_end
        first, last = self.layout.start_layer, self.layout.start_layer + self.layout.layer_num
        if not first <= start < end <= last:
            raise ValueError(f"layer range [{start}, {end}) is not a run of the model's layers [{first}, {last})")
        seen = sorted((b.kind.value, b.layer_id) for b in self.buffers)
        want = sorted((k.value, layer) for k in BufferKind for layer in range(start, end))
        if seen != want:
            raise ValueError("buffers must describe each owned layer exactly once per kind")
        if self.ipc is not None:
            self._check_ipc(self.ipc)

    def _check_ipc(self, ipc: IpcExport) -> None:
        for b in self.buffers:
            if not ipc.holds(b):
                raise ValueError(f"{b.kind.value} buffer of layer {b.layer_id} lies outside its ipc slabs and spans")

    def buffer(self, kind: BufferKind, layer_id: int) -> MemoryDescriptor:
        for b in self.buffers:
            if b.kind is kind and b.layer_id == layer_id:
                return b
        raise KeyError((kind, layer_id))


class EngineDescriptor(_Wire, frozen=True):
    """All CP ranks of one prefill engine, as the registry hands them to a decode."""

    engine_id: Name
    cp_size: Annotated[int, Meta(ge=1, le=1024)]
    ranks: Annotated[list[RankDescriptor], Meta(max_length=1024)]

    def __post_init__(self) -> None:
        if sorted(r.cp_rank for r in self.ranks) != list(range(self.cp_size)):
            raise ValueError(f"ranks must be exactly 0..{self.cp_size - 1}")
        for r in self.ranks:
            if r.engine_id != self.engine_id or r.cp_size != self.cp_size:
                raise ValueError(f"rank {r.cp_rank} belongs to another engine or CP size")


class RoomStatus(enum.Enum):
    PENDING = "pending"  # layers still being written
    READY = "ready"  # every owned layer ready
    RELEASED = "released"  # all consumers released; pages freed
    ABORTED = "aborted"  # aborted or its pin expired; pages freed
    UNKNOWN = "unknown"  # never published here (yet)


class RoomState(_Wire, frozen=True):
    """A room's source pages on one rank and how far its layers are ready."""

    room: U63
    status: RoomStatus
    src_pages: PageList = []
    ready_upto: Count = 0  # layers [layer_start, ready_upto) are ready
    # A room published by chunks: its first ready_pages pages (src_pages so far) are ready
    # in every layer of the rank; None: all its pages at once, ready layer by layer.
    ready_pages: Count | None = None
    # The engine's per-request auxiliary bytes (SGLang's first output token, logprobs...),
    # given with a chunked room's last chunk; sent once the room is complete.
    aux: Annotated[bytes, Meta(max_length=MAX_AUX_BYTES)] | None = None
    # In a claim's answer, where the room holds a pin slot: its word, as a ticket names it.
    pin: OwnerPin | None = None
    # An aborted room that its prefill failed (a bad chunk, its sender's error): that error.
    reason: ErrorReply | None = None


class OwnerPin(_Wire, frozen=True):
    """Where one owner pins a room: the slot of its pin table and the nonce it holds."""

    cp_rank: Count
    incarnation: Name
    slot: Count
    nonce: Annotated[int, Meta(ge=1, le=2**63 - 1)]


class RoomTicket(_Wire, frozen=True):
    """A finished room, as its prefill hands it to the one decode that will read it.

    With it a decode reads every owner at once and proves the pin by each owner's pin
    word: no claim, no poll, no release request. It is a capability: it reaches the
    decode through the router, and a decode holding it consumes one of the room's reads.
    """

    engine_id: Name
    room: U63
    src_pages: PageList
    pins: Annotated[list[OwnerPin], Meta(min_length=1, max_length=1024)]

    def __post_init__(self) -> None:
        if sorted(p.cp_rank for p in self.pins) != list(range(len(self.pins))):
            raise ValueError("a ticket carries one pin for each CP rank 0..n-1")


class TicketRelease(_Wire, frozen=True):
    """A ticket holder is done with `room` on this rank (a UCX notification)."""

    room: U63
    slot: Count
    nonce: Annotated[int, Meta(ge=1, le=2**63 - 1)]


class ClaimRelease(_Wire, frozen=True):
    """A claim holder is done with `room` on this rank, its bytes proved by the pin word
    (a UCX notification: no answer)."""

    room: U63
    claim: ClaimToken


class ReadFrom(_Wire, frozen=True):
    """The holder of claim `claim` reads `room` on this rank from page `start` on: its decode
    holds the pages below (its prefix). A UCX notification, no answer; lost, the owner only
    keeps those pages pinned until the release."""

    room: U63
    claim: ClaimToken
    start: Count


class ClaimRequest(_Wire, frozen=True):
    """A consumer asks for one of the room's claims; `claim` is a fresh random token.
    `readers`: the claimant is one of that many readers of the room (a decode whose
    attention-TP ranks each hold the whole latent KV), so the room grants at least that
    many claims."""

    room: U63
    consumer_id: Name
    claim: ClaimToken
    readers: Annotated[int, Meta(ge=1, le=1024)] = 1


class OwnerRef(_Wire, frozen=True):
    """An owner as the decode looked it up: a claim relayed to it must reach that incarnation."""

    cp_rank: Count
    incarnation: Name


class ClaimAll(_Wire, frozen=True):
    """`ask` on every owner, asked of the arbiter (the engine's lowest CP rank): it grants its
    own claim first, then relays `ask` to each of `others` at once and answers all of them
    within `budget_ms` (what is left of the decode's wait)."""

    ask: ClaimRequest
    others: Annotated[list[OwnerRef], Meta(max_length=1024)]
    budget_ms: Annotated[int, Meta(ge=1, le=2**31 - 1)]


class OwnerClaim(_Wire, frozen=True):
    """One owner's answer to a relayed claim: the room as the claim found it, or why not.
    `claim`: the token the owner holds the claimant's claim under, where it is not the one
    asked (the arbiter handed out a claim held for it, `HeldClaim`)."""

    cp_rank: Count
    state: RoomState | None = None
    error: ErrorReply | None = None
    claim: ClaimToken | None = None

    def __post_init__(self) -> None:
        if (self.state is None) == (self.error is None):
            raise ValueError("an owner's claim answers a state or an error")


class ClaimAllReply(_Wire, frozen=True):
    """The arbiter's answer to `ClaimAll`: its own claim's state, then each relayed owner's."""

    arbiter: RoomState
    others: Annotated[list[OwnerClaim], Meta(max_length=1024)]


class HeldClaim(_Wire, frozen=True):
    """A rank other than the arbiter holds one of a whole room's claims, under `claim`, for
    its arbiter to hand out: a claimant the arbiter grants first then reads with no relay.
    `state`: the room there, whole, with its pin, less its pages, which `pages` names (their
    digest, `transfer.prefill.held.pages_digest`). Sent on the arbiter's claim channel."""

    cp_rank: Count
    incarnation: Name
    claim: ClaimToken
    state: RoomState
    pages: Annotated[bytes, Meta(min_length=16, max_length=16)]


class ReturnHeld(_Wire, frozen=True):
    """The arbiter will not hand out the claim a rank holds for it under `claim` (its own room
    ended first): the rank ends that claim unread. Sent on the rank's claim channel."""

    room: U63
    claim: ClaimToken


class HeldReply(_Wire, frozen=True):
    """The answer to `HeldClaim` (whether the arbiter keeps it to hand out; if not, `ended`:
    its own room ended, unread, so the rank ends the held claim unread too, else the rank frees
    its place) or to `ReturnHeld` (whether the rank still held it, and so ended it)."""

    room: U63
    kept: bool
    ended: bool = False


class ReleaseNotice(_Wire, frozen=True):
    """A claim holder is done with the room's pages on this rank; `give_up`: it gives its
    claim up without having read the room (or, unclaimed yet, one of the room's claims)."""

    room: U63
    consumer_id: Name
    claim: ClaimToken
    give_up: bool = False


class ReleaseReply(_Wire, frozen=True):
    """The pages stayed pinned under the claim until this release; `freed`: it was the last."""

    room: U63
    freed: bool
    unreleased: Count  # claims of the room (granted or not) still to be released


ErrorName = Annotated[str, Meta(max_length=64)]


class ErrorReply(_Wire, frozen=True):
    code: ErrorName  # the error's class name
    message: Annotated[str, Meta(max_length=4096)]
    lineage: Annotated[list[ErrorName], Meta(max_length=16)] = []  # its pdkv ancestors, nearest first
    cause: ErrorReply | None = None  # the pdkv error it was raised from, one level deep


def error_reply(exc: PdkvError, with_cause: bool = True) -> ErrorReply:
    """`exc` as it crosses the wire: its class name, message and pdkv ancestors, and the
    pdkv error it was raised from (a room aborted because its prefill failed: that error)."""
    lineage = [c.__name__ for c in type(exc).__mro__[1:] if isinstance(c, type) and issubclass(c, PdkvError)]
    cause = exc.__cause__ if with_cause and isinstance(exc.__cause__, PdkvError) else None
    return ErrorReply(
        code=type(exc).__name__,
        message=str(exc)[:4000],
        lineage=lineage[:16],
        cause=error_reply(cause, with_cause=False) if cause is not None else None,
    )


def error_from(reply: ErrorReply, where: str) -> PdkvError:
    """The error `reply` names, rebuilt as the nearest class this process knows (and the
    one it was raised from, as its `__cause__`)."""
    known: dict[str, type[PdkvError]] = {}
    todo: list[type[PdkvError]] = [PdkvError]
    while todo:
        cls = todo.pop()
        known.setdefault(cls.__name__, cls)
        todo += cls.__subclasses__()
    cls = next((known[n] for n in [reply.code, *reply.lineage] if n in known), PdkvError)
    error = cls(f"{where}: {reply.message}")
    if reply.cause is not None:
        error.__cause__ = error_from(reply.cause, where)
    return error


class Envelope(Struct, frozen=True, array_like=True):
    """What `encode` writes; `decode` reads its `_Head`, then the body as the kind it expects."""

    version: int
    fingerprint: str
    kind: str
    body: msgspec.Raw


class _Head(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """An envelope's first three fields, decoded before its body is touched."""

    version: int
    fingerprint: str
    kind: str


T = TypeVar("T", bound=Struct)

_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(_Head)
_body_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_ARRAY_OF_4 = 0x94  # msgpack's fixarray of four: how `encode` frames every envelope
_INT_SIZE = {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
_STR_PREFIX = {0xD9: 1, 0xDA: 2, 0xDB: 4}


def encode(msg: Struct, fingerprint: str = "") -> bytes:
    body = msgspec.Raw(_encoder.encode(msg))
    return _encoder.encode(Envelope(SCHEMA_VERSION, fingerprint, type(msg).__name__, body))


def _item_end(data: memoryview, pos: int) -> int:
    """Where the int or string at `pos` ends; any other type ends at its marker, for msgspec to name."""
    marker = data[pos] if pos < len(data) else 0
    if 0xA0 <= marker <= 0xBF:  # a fixstr
        return pos + 1 + (marker & 0x1F)
    if marker in _STR_PREFIX:
        width = _STR_PREFIX[marker]
        return pos + 1 + width + int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
    return pos + _INT_SIZE.get(marker, 1)


def _split(data: bytes | bytearray | memoryview) -> tuple[_Head, memoryview]:
    """The envelope's head, decoded, and its body's bytes, unread.

    Decoding the body as `msgspec.Raw` made msgspec walk it, recursing once a level (a
    100k-deep array raised RecursionError); typed decoding goes no deeper than the type.
    """
    view = memoryview(data).cast("B")
    if not view or view[0] != _ARRAY_OF_4:
        raise MetadataError("malformed envelope: not an array of (version, fingerprint, kind, body)")
    end = _item_end(view, _item_end(view, _item_end(view, 1)))
    try:  # an item claiming more than the data holds is cut at its end: msgspec reports truncation
        head = _head_decoder.decode(b"\x93" + bytes(view[1:end]))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MetadataError(f"malformed envelope: {exc}") from exc
    if end >= len(view):
        raise MetadataError("malformed envelope: no body")
    return head, view[end:]


def decode(data: bytes | bytearray | memoryview, kind: type[T], fingerprint: str | None = None) -> T:
    """Decode an envelope carrying a `kind`; refuse another version, kind or layout first."""
    return decode_any(data, (kind,), fingerprint)


def decode_any(data: bytes | bytearray | memoryview, kinds: tuple[type[T], ...], fingerprint: str | None = None) -> T:
    """Decode an envelope carrying one of `kinds` (a channel that carries several, such as
    an owner's notifications); refuse another version, kind or layout first."""
    env, body = _split(data)
    if env.version != SCHEMA_VERSION:
        raise MetadataError(f"schema version {env.version} is not {SCHEMA_VERSION}")
    kind = next((k for k in kinds if k.__name__ == env.kind), None)
    if kind is None:
        raise MetadataError(f"expected a {' or '.join(k.__name__ for k in kinds)}, got {env.kind!r}")
    if fingerprint is not None and env.fingerprint != fingerprint:
        raise IncompatibleLayoutError(
            f"layout fingerprint {env.fingerprint!r} differs from local {fingerprint!r}", ("fingerprint",)
        )
    decoder = _body_decoders.get(kind)
    if decoder is None:
        if not kind.__struct_config__.forbid_unknown_fields:  # msgspec would skip (walk) their values
            raise TypeError(f"{kind.__name__} must forbid unknown fields to be decoded from the wire")
        decoder = _body_decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MetadataError(f"invalid {kind.__name__}: {exc}") from exc


def consumer_name(text: str) -> str:
    """A consumer id from a URL, checked like the one in a `ClaimRequest`."""
    try:
        return msgspec.convert(text, Name)
    except msgspec.ValidationError as exc:
        raise MetadataError(f"consumer: {exc}") from exc


def claim_token(text: str) -> str:
    """A claim token from a URL, checked like the one in a `ClaimRequest`."""
    try:
        return msgspec.convert(text, ClaimToken)
    except msgspec.ValidationError as exc:
        raise MetadataError(f"claim token: {exc}") from exc
