import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdkv import IncompatibleLayoutError, MetadataError
from pdkv.layout import BufferKind
from tests.wire_helpers import LAYOUT, TOKEN, rank_descriptor
from transfer.metadata import (
    SCHEMA_VERSION,
    ClaimRequest,
    EngineDescriptor,
    Envelope,
    ErrorReply,
    IpcExport,
    IpcSlab,
    LayoutSpec,
    MemoryDescriptor,
    RankDescriptor,
    ReleaseNotice,
    ReleaseReply,
    RoomState,
    RoomStatus,
    VmmSpan,
    claim_token,
    decode,
    encode,
)


def _raw(msg, **over):
    """Re-encode `msg` with fields changed at the msgpack level (bypassing validation)."""
    body = msgspec.to_builtins(msg, builtin_types=(bytes,))
    body.update(over)
    return msgspec.msgpack.encode(
        Envelope(SCHEMA_VERSION, LAYOUT.fingerprint, type(msg).__name__, msgspec.Raw(msgspec.msgpack.encode(body)))
    )


def test_round_trip_every_type():
    for msg in (
        rank_descriptor(),
        RoomState(room=5, status=RoomStatus.PENDING, src_pages=[3, 4], ready_upto=4),
        ReleaseNotice(room=5, consumer_id="d0", claim=TOKEN),
        ClaimRequest(room=5, consumer_id="d0", claim=TOKEN),
        ReleaseReply(room=5, freed=True, unreleased=0),
        ErrorReply(code="MetadataError", message="x", lineage=["PdkvError"]),
    ):
        assert decode(encode(msg, LAYOUT.fingerprint), type(msg), LAYOUT.fingerprint) == msg


@pytest.mark.parametrize(
    "change, field",
    [
        ({"cp_rank": -1}, "cp_rank"),
        ({"cp_rank": 3}, "cp_rank"),
        ({"layer_start": 9}, "layer range"),  # past its end: not a run of layers
        ({"cp_size": "3"}, "cp_size"),
        ({"agent_metadata": 5}, "agent_metadata"),
        ({"engine_id": ""}, "engine_id"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_rank_descriptor_names_the_field(change, field):
    with pytest.raises(MetadataError, match=field):
        decode(_raw(rank_descriptor(), **change), RankDescriptor)


def test_missing_field_and_bad_buffers_refused():
    d = msgspec.to_builtins(rank_descriptor(), builtin_types=(bytes,))
    del d["incarnation"]
    env = Envelope(SCHEMA_VERSION, "", "RankDescriptor", msgspec.Raw(msgspec.msgpack.encode(d)))
    with pytest.raises(MetadataError, match="incarnation"):
        decode(msgspec.msgpack.encode(env), RankDescriptor)
    desc = msgspec.to_builtins(rank_descriptor(), builtin_types=(bytes,))
    desc["buffers"] = desc["buffers"][:-1]
    with pytest.raises(MetadataError, match="exactly once"):
        decode(_raw(rank_descriptor(), buffers=desc["buffers"]), RankDescriptor)
    bad = dict(desc["buffers"][0], length=100, item_len=192)
    with pytest.raises(MetadataError, match="multiple"):
        decode(_raw(rank_descriptor(), buffers=[bad] + desc["buffers"][1:]), RankDescriptor)
    huge = dict(desc["buffers"][0], addr=2**63 - 10)
    with pytest.raises(MetadataError, match="overflow"):
        decode(_raw(rank_descriptor(), buffers=[huge] + desc["buffers"][1:]), RankDescriptor)


def test_envelope_checked_first():
    good = encode(ReleaseNotice(room=1, consumer_id="d", claim=TOKEN), LAYOUT.fingerprint)
    env = msgspec.msgpack.decode(good)
    with pytest.raises(MetadataError, match="version"):
        decode(msgspec.msgpack.encode([SCHEMA_VERSION + 1, *env[1:]]), ReleaseNotice)
    with pytest.raises(MetadataError, match="expected a RoomState"):
        decode(good, RoomState)
    with pytest.raises(IncompatibleLayoutError):
        decode(good, ReleaseNotice, "another-fingerprint")


def test_engine_descriptor_needs_every_rank():
    ranks = [rank_descriptor(r) for r in range(3)]
    EngineDescriptor("e0", 3, ranks)
    two = [msgspec.to_builtins(r, builtin_types=(bytes,)) for r in ranks[:2]]
    with pytest.raises(MetadataError, match="exactly 0..2"):
        decode(_raw(EngineDescriptor("e0", 3, ranks), ranks=two), EngineDescriptor)


def test_layout_spec_names_differing_fields():
    with pytest.raises(IncompatibleLayoutError, match="page_size") as info:
        LayoutSpec.of(LAYOUT.replace(page_size=8, size=256)).check_against(LAYOUT)
    assert info.value.differing == ("page_size",)


WIRE_TYPES = [
    RankDescriptor,
    RoomState,
    ReleaseNotice,
    ClaimRequest,
    ReleaseReply,
    ErrorReply,
    EngineDescriptor,
    MemoryDescriptor,
]


def test_claim_tokens_are_checked():
    assert claim_token(TOKEN) == TOKEN
    for bad in ("", "short", "Z" * 32, TOKEN + "/x", "0" * 65):
        with pytest.raises(MetadataError, match="claim token"):
            claim_token(bad)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.sampled_from(WIRE_TYPES))
def test_fuzz_arbitrary_bytes_only_raise_metadata_error(blob, kind):
    try:
        decode(blob, kind)
    except MetadataError:
        pass


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(WIRE_TYPES),
    st.dictionaries(
        st.sampled_from(
            [
                "room",
                "status",
                "src_pages",
                "ready_upto",
                "cp_rank",
                "cp_size",
                "buffers",
                "addr",
                "length",
                "kind",
                "layer_id",
                "item_len",
                "code",
                "message",
                "consumer_id",
                "engine_id",
                "ranks",
                "claim",
                "freed",
                "lineage",
            ]
        ),
        _values,
        max_size=6,
    ),
)
def test_fuzz_wrong_fields_and_types_only_raise_metadata_error(kind, body):
    env = Envelope(SCHEMA_VERSION, "", kind.__name__, msgspec.Raw(msgspec.msgpack.encode(body)))
    try:
        decode(msgspec.msgpack.encode(env), kind)
    except MetadataError:
        pass


def _ipc(rank: RankDescriptor, shrink: int = 0) -> IpcExport:
    slabs = []
    for kind in BufferKind:
        bufs = [b for b in rank.buffers if b.kind is kind]
        lo, hi = min(b.addr for b in bufs), max(b.addr + b.length for b in bufs)
        slabs.append(IpcSlab(kind=kind, addr=lo, length=hi - lo - shrink, alloc_offset=0, handle=bytes(64)))
    return IpcExport(host_id="h:1", gpu_uuid="GPU-1", slabs=slabs)


def test_ipc_slabs_must_hold_every_buffer_they_export():
    rank = rank_descriptor()
    ok = msgspec.structs.replace(rank, ipc=_ipc(rank))
    assert decode(encode(ok), RankDescriptor).ipc == ok.ipc
    bad = msgspec.to_builtins(_ipc(rank, shrink=1), builtin_types=(bytes,))
    with pytest.raises(MetadataError, match="outside its ipc slabs"):
        decode(_raw(rank, ipc=bad), RankDescriptor)
    short = msgspec.to_builtins(_ipc(rank), builtin_types=(bytes,))
    short["slabs"][0]["handle"] = bytes(63)
    with pytest.raises(MetadataError, match="handle"):
        decode(_raw(rank, ipc=short), RankDescriptor)


def test_the_gpu_lane_says_why_it_cannot_read_an_owner():
    import torch

    from transfer.lanes.cuda_ipc.lane import ipc_unreachable

    rank = rank_descriptor()
    assert "not on a GPU" in ipc_unreachable(rank, torch.device("cpu"))
    assert "no IPC handles" in ipc_unreachable(rank, torch.device("cuda", 0))
    other_host = msgspec.structs.replace(rank, ipc=_ipc(rank))
    assert "another host" in ipc_unreachable(other_host, torch.device("cuda", 0))


def test_a_fingerprint_must_match_the_layout_it_travels_with():
    with pytest.raises(MetadataError, match="fingerprint"):
        decode(_raw(rank_descriptor(), fingerprint="0" * 16), RankDescriptor)


def test_an_engines_allocations_export_as_slabs_of_either_kind():
    """Schema 10: a slab per allocation, of no kind, holding buffers of both kinds; every
    buffer must still lie inside one of them."""
    rank = rank_descriptor()
    slabs = [
        IpcSlab(addr=b.addr, length=b.length, alloc_offset=64 * i, handle=bytes([i % 256]) * 64)
        for i, b in enumerate(rank.buffers)
    ]
    ok = msgspec.structs.replace(rank, ipc=IpcExport(host_id="h:1", gpu_uuid="GPU-1", slabs=slabs))
    assert decode(encode(ok), RankDescriptor).ipc == ok.ipc
    short = msgspec.to_builtins(ok.ipc, builtin_types=(bytes,))
    for slab in short["slabs"]:
        slab["length"] -= 1  # every buffer's last byte outside every slab
    with pytest.raises(MetadataError, match="outside its ipc slabs"):
        decode(_raw(rank, ipc=short), RankDescriptor)


def test_vmm_memory_exports_as_spans_of_chunks_that_must_hold_every_buffer():
    """Schema 12: buffers in VMM memory go as spans of chunks (their descriptors handed out
    by the owner's socket); a buffer over a gap between chunks is refused, and so is a span
    without the socket."""
    rank = rank_descriptor()
    lo = min(b.addr for b in rank.buffers)
    hi = max(b.addr + b.length for b in rank.buffers)
    half = (hi - lo) // 2
    span = VmmSpan(addr=lo, chunks=[(0, half), (half, hi - lo - half)], key="k" * 32)
    ipc = IpcExport(host_id="h:1", gpu_uuid="GPU-1", slabs=[], vmm=[span], fd_socket="@pdkv-fd-test")
    ok = msgspec.structs.replace(rank, ipc=ipc)
    assert decode(encode(ok), RankDescriptor).ipc == ipc
    short = msgspec.to_builtins(ipc, builtin_types=(bytes,))
    short["vmm"][0]["chunks"][1] = (half + 64, hi - lo - half)  # a 64-byte gap between the chunks
    with pytest.raises(MetadataError, match="outside its ipc slabs and spans"):
        decode(_raw(rank, ipc=short), RankDescriptor)
    short = msgspec.to_builtins(ipc, builtin_types=(bytes,))
    del short["fd_socket"]
    with pytest.raises(MetadataError, match="socket"):
        decode(_raw(rank, ipc=short), RankDescriptor)
    short["slabs"], short["vmm"] = [], []
    with pytest.raises(MetadataError, match="at least one"):
        decode(_raw(rank, ipc=short), RankDescriptor)
