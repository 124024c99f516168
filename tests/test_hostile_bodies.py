"""Hostile request bodies against real services in their own processes, over real sockets.

Any body a service cannot decode is answered 400 with a `MetadataError` (409 with an
`IncompatibleLayoutError` for another layout's fingerprint), never a 5xx: nested 100k deep,
declaring lengths of 2^32-1, of the wrong types, truncated (issue 29.1). And 200 refused
64 MiB bodies leave each service's resident memory flat (issue 29.4).
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp
import msgspec
import pytest
import pytest_asyncio
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pdkv.errors import IncompatibleLayoutError, MetadataError
from tests.http_probe import MiB, rss_bytes, send_big
from tests.wire_helpers import TOKEN, rank_descriptor
from transfer.app.api import DecodeRequest, PrefillRequest
from transfer.app.router import Deployment, DeploymentSpec
from transfer.control import CONTENT_TYPE
from transfer.metadata import (
    SCHEMA_VERSION,
    ClaimRequest,
    EngineDescriptor,
    Envelope,
    ErrorReply,
    OwnerPin,
    ReleaseNotice,
    RoomTicket,
    decode,
    encode,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(engines=(1,), decoders=1, preset="tiny", prefill_pool_tokens=1024, decode_pool_tokens=1024)
DEPTH = 100_000

# Framings that are valid msgpack heads and lie, or nest without end.
DEEP = [
    b"\x91" * DEPTH + b"\xc0",  # one-element arrays
    b"\x81\xa1k" * DEPTH + b"\xc0",  # one-entry maps
    b"\x91\x81\xa1k" * (DEPTH // 2) + b"\xc0",  # both, alternating
    b"\xdc\x00\x01" * DEPTH + b"\xc0",  # array16 framing
    b"\x91" * DEPTH,  # and never closed
]
HUGE = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 2^32-1
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
    b"\xdc\xff\xff",  # array16 of 65535
    b"\xde\xff\xff",  # map16
    b"\xda\xff\xff",  # str16
]
ODD = [
    b"\xc1",  # never used
    b"\xd4\x01\x00",  # fixext1
    b"\xd6\xff\x00\x00\x00\x00",  # a timestamp
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # NaN
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # 2^64-1
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # -2^63
    b"\xc3",
    b"\xc0",
    b"\xa0",
    b"\x90",
    b"\x80",
]
FRAGMENTS = DEEP + HUGE + ODD


@dataclass(frozen=True)
class Target:
    """A service route that reads a body: where it is, what it decodes, the layout it expects."""

    name: str
    url: str
    method: str
    path: str
    valid: msgspec.Struct
    fingerprint: str | None

    @property
    def kind(self) -> type[msgspec.Struct]:
        return type(self.valid)

    def envelope(self, body: bytes) -> bytes:
        """`body` (any bytes) in the envelope this route expects."""
        head = (SCHEMA_VERSION, self.fingerprint or "", self.kind.__name__)
        return msgspec.msgpack.encode(Envelope(*head, msgspec.Raw(body)))

    def decodes(self, data: bytes) -> bool:
        """True if the service would accept `data` as its body (so it is not a hostile one)."""
        try:
            decode(data, self.kind, self.fingerprint)
        except (MetadataError, IncompatibleLayoutError):
            return False
        return True


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def deployment():
    async with Deployment(SPEC) as d:
        yield d


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def targets(deployment) -> dict[str, Target]:
    engine = await deployment.client.request("GET", f"{deployment.registry_url}/v1/engines/prefill0", EngineDescriptor)
    fp = engine.ranks[0].fingerprint
    control, intake, decoder = (
        deployment.engines[0].controls[0],
        deployment.engines[0].intake,
        deployment.decoders[0].url,
    )
    ticket = RoomTicket(engine_id="prefill0", room=5, src_pages=[3, 1, 2], pins=[OwnerPin(0, "abc", 1, 7)])
    return {
        t.name: t
        for t in (
            Target("registry", deployment.registry_url, "PUT", "/v1/engines/e0/ranks/0", rank_descriptor(0), None),
            Target("claim", control, "POST", "/v1/rooms/5/claim", ClaimRequest(5, "d", TOKEN), fp),
            Target("release", control, "POST", "/v1/rooms/5/release", ReleaseNotice(5, "d", TOKEN), fp),
            Target("intake", intake, "POST", "/v1/prefill", PrefillRequest(room=5, num_tokens=64), None),
            Target("decode", decoder, "POST", "/v1/decode", DecodeRequest("prefill0", 5, 64, ticket=ticket), None),
        )
    }


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def session():
    async with aiohttp.ClientSession() as s:
        yield s


async def _refused(session: aiohttp.ClientSession, target: Target, data: bytes) -> None:
    """Send `data` as `target`'s body: it must come back 400 MetadataError (409 for a layout)."""
    async with session.request(
        target.method, target.url + target.path, data=data, headers={"Content-Type": CONTENT_TYPE}
    ) as resp:
        status, payload = resp.status, await resp.read()
    where = f"{target.name}: HTTP {status} for {data[:48]!r}... ({len(data)} bytes)"
    assert status < 500, where
    err = decode(payload, ErrorReply)
    expected = "IncompatibleLayoutError" if status == 409 else "MetadataError"
    assert status in (400, 409) and expected in {err.code, *err.lineage}, where


async def _refused_unless_valid(session: aiohttp.ClientSession, target: Target, data: bytes) -> None:
    """`_refused`, for a body the service could not accept (one it could is not sent)."""
    valid = target.decodes(data)
    event("valid, not sent" if valid else "hostile, sent")  # --hypothesis-show-statistics
    if not valid:
        await _refused(session, target, data)


def _fields(msg: msgspec.Struct) -> dict[str, object]:
    return msgspec.to_builtins(msg, builtin_types=(bytes,))


def _map_with(fields: dict[str, object], key: str, raw_value: bytes) -> bytes:
    """The message's map with `key` set to `raw_value`, a msgpack fragment taken as it is."""
    rest = {k: v for k, v in fields.items() if k != key}
    head = msgspec.msgpack.encode(rest)
    body = head[1:] if len(rest) < 16 else head[3:]  # past a fixmap's or a map 16's header
    count = len(rest) + 1
    header = bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big")
    return header + body + msgspec.msgpack.encode(key) + raw_value


def _hand_made(target: Target) -> list[bytes]:
    """Every fragment as the body, as each field's value, as an unknown field's, after the
    body; in each slot of the envelope; and every cut of a valid message."""
    fields, good = _fields(target.valid), encode(target.valid, target.fingerprint or "")
    out: list[bytes] = [b"", b"garbage", b"\x94", good + b"\x00", good[:-1]]
    for frag in FRAGMENTS:
        out.append(target.envelope(frag))
        out += [target.envelope(_map_with(fields, key, frag)) for key in [*fields, "zzz"]]
        out.append(target.envelope(msgspec.msgpack.encode(fields) + frag))
        head = [SCHEMA_VERSION, target.fingerprint or "", target.kind.__name__]
        for slot in range(4):
            parts = [msgspec.msgpack.encode(v) for v in head] + [msgspec.msgpack.encode(fields)]
            parts[slot] = frag
            out.append(b"\x94" + b"".join(parts))
        out.append(b"\x95" + b"".join(msgspec.msgpack.encode(v) for v in head) + msgspec.msgpack.encode(fields) + frag)
        out.append(frag + good)
    out.append(b"\x91" * DEPTH + good)  # the whole envelope nested
    out.append(msgspec.msgpack.encode({"version": SCHEMA_VERSION, "body": fields}))  # a map, not an array
    step = max(1, len(good) // 200)
    out += [good[:n] for n in range(0, len(good), step)]
    return [data for data in out if not target.decodes(data)]


@pytest.mark.parametrize("name", ["registry", "claim", "release", "intake", "decode"])
async def test_hand_made_hostile_bodies_are_refused_with_400(targets, session, name):
    target = targets[name]
    cases = _hand_made(target)
    assert len(cases) > 200
    for data in cases:
        await _refused(session, target, data)
    async with session.get(f"{target.url}/metrics") as resp:  # and the service still serves
        assert resp.status == 200


# ---- hypothesis: mutations of valid bodies, wrong types, odd envelope heads ---------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
)
_names = st.sampled_from(["registry", "claim", "release", "intake", "decode"])


@st.composite
def _mutated(draw, good: bytes) -> bytes:
    data = bytearray(good)
    for _ in range(draw(st.integers(1, 4))):
        op, at = draw(st.sampled_from(["set", "insert", "delete", "cut", "splice"])), draw(st.integers(0, len(data)))
        if op == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.sampled_from(FRAGMENTS))
    return bytes(data)


@settings(max_examples=400, deadline=None)
@given(name=_names, data=st.data())
async def test_fuzz_mutated_bodies_are_refused_with_400(targets, session, name, data):
    target = targets[name]
    body = data.draw(_mutated(encode(target.valid, target.fingerprint or "")))
    await _refused_unless_valid(session, target, body)


@settings(max_examples=300, deadline=None)
@given(name=_names, data=st.data())
async def test_fuzz_fields_of_the_wrong_type_are_refused_with_400(targets, session, name, data):
    target = targets[name]
    fields = _fields(target.valid)
    changed = data.draw(st.dictionaries(st.sampled_from([*fields, "zzz"]), _values, min_size=1, max_size=3))
    nest = data.draw(st.integers(0, 3))  # the whole body wrapped in arrays, sometimes
    body = msgspec.msgpack.encode({**fields, **changed})
    body = target.envelope(b"\x91" * nest + body)
    await _refused_unless_valid(session, target, body)


@settings(max_examples=200, deadline=None)
@given(name=_names, head=st.lists(_values, min_size=0, max_size=6), body_first=st.booleans())
async def test_fuzz_envelope_heads_are_refused_with_400(targets, session, name, head, body_first):
    target = targets[name]
    body = msgspec.Raw(msgspec.msgpack.encode(_fields(target.valid)))
    data = msgspec.msgpack.encode([body, *head] if body_first else [*head, body])
    await _refused_unless_valid(session, target, data)


# ---- memory: refused 64 MiB bodies (issue 29.4) ---------------------------------------------


def _services(deployment) -> list[tuple[str, int, str, str, str]]:  # type: ignore[no-untyped-def]
    """(name, pid, url, method, a path that reads a body) for each kind of service process."""
    child = {c.name: c for c in deployment.launcher.children}
    return [
        ("registry", child["registry"].pid, deployment.registry_url, "PUT", "/v1/engines/e9/ranks/0"),
        ("exporter", child["prefill0-cp0"].pid, deployment.engines[0].controls[0], "POST", "/v1/rooms/5/claim"),
        ("decode", child["decode0"].pid, deployment.decoders[0].url, "POST", "/v1/decode"),
    ]


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
async def test_200_refused_64mib_bodies_leave_every_service_flat(deployment, chunked):
    for name, pid, url, method, path in _services(deployment):
        for _ in range(20):  # warm-up
            assert await send_big(url, path, 64 * MiB, chunked=chunked, method=method) == 413, name
        before = rss_bytes(pid)
        for _ in range(200):
            assert await send_big(url, path, 64 * MiB, chunked=chunked, method=method) == 413, name
        grown = rss_bytes(pid) - before
        assert grown < 16 * MiB, f"{name} grew by {grown / MiB:.1f} MiB over 200 refused bodies"
