"""The decode's two protocols (claims, tickets) over fakes: no NIXL, no HTTP, no processes.

As vLLM's `FakeNixlWrapper` and httpx's `MockTransport` do, the protocols run against
stand-ins for what they drive: a `FakeLane` copying numpy "memory" (each read can be held
on a gate, made to fail, and finishes its in-flight copy when cancelled), a `FakeClient`
routing control requests to `FakeOwner`s, a `FakeFeed` (no pushed states: every wait
falls back to a poll; its `aborted` raises when the test says), and a `FakeUcx` for pin
words and notifications. Everything records into one `Timeline`, whose order is the clock:
tests assert what happened before what, never how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import msgspec
import numpy as np
import pytest

from pdkv.errors import ClaimLostError, ClosedError, PeerLostError, RoomAbortedError
from tests.wire_helpers import LAYOUT, rank_descriptor
from transfer.deadline import Deadline
from transfer.decode.claims import Claim, ClaimProtocol
from transfer.decode.landing import Landing
from transfer.decode.lease import RoomLease
from transfer.decode.owners import Owner
from transfer.decode.tasks import Activity, DecodeContext, Fetch
from transfer.decode.tickets import TicketProtocol
from transfer.lanes.base import Lane, ReadStats, Watch
from transfer.metadata import (
    ClaimRelease,
    ClaimRequest,
    OwnerPin,
    PinTable,
    RankDescriptor,
    ReleaseNotice,
    ReleaseReply,
    RoomState,
    RoomStatus,
    RoomTicket,
    TicketRelease,
    decode,
)
from transfer.results import FetchResult
from transfer.timeouts import Timeouts

T = TypeVar("T")
ROOM = 42
PAGE = 8  # bytes of one page of one layer in the fake memory
NUM_PAGES = LAYOUT.num_pages
LAYERS = LAYOUT.layer_num
SPANS = {0: range(0, 3), 1: range(3, 5), 2: range(5, 7)}  # as tests.wire_helpers.rank_descriptor
FP = LAYOUT.fingerprint


def source_memory(cp: int) -> np.ndarray:
    """An owner's pages, [layer, page, byte]: each page says whose, which layer, which page."""
    layer, page, byte = np.indices((LAYERS, NUM_PAGES, PAGE))
    mem = (cp * 97 + layer * 31 + page * 7 + byte * 3 + 1) % 251
    mem[..., 0], mem[..., 1], mem[..., 2] = cp, layer[..., 0], page[..., 0]
    return mem.astype(np.uint8)


SOURCE = {cp: source_memory(cp) for cp in SPANS}


def expected(dst: np.ndarray, src_of: dict[int, np.ndarray]) -> np.ndarray:
    """The decode's memory after a fetch of every layer: each owner's src pages in dst."""
    mem = np.zeros((LAYERS, NUM_PAGES, PAGE), np.uint8)
    for cp, span in SPANS.items():
        for layer in span:
            mem[layer, dst] = SOURCE[cp][layer, src_of[cp]]
    return mem


class Timeline:
    """Events in the order they happened; an event's index is its time."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def add(self, *event: Any) -> int:
        self.events.append(event)
        return len(self.events) - 1

    def where(self, *prefix: Any) -> list[int]:
        """Indices of the events starting with `prefix`."""
        return [i for i, e in enumerate(self.events) if e[: len(prefix)] == prefix]

    def first(self, *prefix: Any) -> int:
        found = self.where(*prefix)
        assert found, f"no event {prefix} in {self.events}"
        return found[0]

    def last(self, *prefix: Any) -> int:
        found = self.where(*prefix)
        assert found, f"no event {prefix} in {self.events}"
        return found[-1]


class Awaits:
    """The protocol's awaits on the fakes, in order; at the `cancel_at`-th, cancel `target`
    and hand that await a gate that never opens (so the cancellation lands right there)."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.labels: list[tuple[Any, ...]] = []
        self.cancel_at: int | None = None
        self.target: asyncio.Future[Any] | None = None
        self.fired = False
        self.never = asyncio.Event()

    def reach(self, *label: Any) -> asyncio.Event | None:
        if self.fired:
            return None  # what runs after the cancellation (give-ups) is not counted
        n = len(self.labels)
        self.labels.append(label)
        if n == self.cancel_at:
            assert self.target is not None
            self.fired = True
            self.timeline.add("cancel", *label)
            self.target.cancel()
            return self.never
        return None


# ---- the lane ------------------------------------------------------------------------------------


@dataclass
class FakePeer:
    cp_rank: int
    layers: range
    closed: bool = False


@dataclass
class FakeMerged:
    peers: tuple[FakePeer, ...]

    @property
    def shares(self) -> tuple[tuple[FakePeer, int], ...]:
        return tuple((p, PAGE * len(p.layers)) for p in self.peers)

    @property
    def page_bytes(self) -> int:
        return sum(b for _, b in self.shares)


class FakeLane:
    """A lane over numpy memory. A read of cp rank r waits on `gates[r]` (if any), then
    fails with `errors[r]` (if any) or copies. Cancelled, it finishes its in-flight copy
    before raising, which takes `cancel_turns` turns of the loop (`drain`: it first waits
    for its gate, as a real READ runs to its end). No byte lands once a read has ended."""

    def __init__(self, timeline: Timeline, mem: np.ndarray, *, merges: bool = False, name: str = "fake") -> None:
        self.name, self.merges = name, merges
        self.timeline, self.mem = timeline, mem
        self.gates: dict[int, asyncio.Event] = {}
        self.errors: dict[int, BaseException] = {}
        self.drain = False
        self.cancel_turns = 20  # loop turns a cancelled read's in-flight copy takes to end
        self.points: Awaits | None = None
        self.in_flight = 0
        self.reads: list[tuple[int, range]] = []  # (cp rank, layers) of each plain read
        self.merged_calls: list[tuple[int, ...]] = []
        self.heard: asyncio.Event | None = None  # set: a read's end reaches its task only then

    def reach(self, rank: RankDescriptor) -> str | None:
        return None

    async def open(self, rank: RankDescriptor, pairs: Any) -> FakePeer:
        return FakePeer(rank.cp_rank, range(rank.layer_start, rank.layer_end))

    async def close(self, peer: FakePeer) -> None:
        peer.closed = True

    def group(self, expected: int) -> None:
        return None

    def merged(self, peers: tuple[FakePeer, ...]) -> FakeMerged | None:
        return FakeMerged(peers) if self.merges else None

    def prime(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def read(
        self, peer: FakePeer, layers: range, src: np.ndarray, dst: np.ndarray, deadline: Deadline
    ) -> ReadStats:
        assert not peer.closed
        assert peer.layers.start <= layers.start < layers.stop <= peer.layers.stop, (peer, layers)
        self.reads.append((peer.cp_rank, layers))
        return await self._move([(peer.cp_rank, layers)], src, dst)

    async def read_merged(
        self, merged: FakeMerged, src: np.ndarray, dst: np.ndarray, dst_below: int, watch: Watch | None = None
    ) -> float:
        assert int(dst.max()) < dst_below
        self.merged_calls.append(tuple(p.cp_rank for p in merged.peers))
        return (await self._move([(p.cp_rank, p.layers) for p in merged.peers], src, dst, watch)).seconds

    async def _move(
        self, parts: list[tuple[int, range]], src: np.ndarray, dst: np.ndarray, watch: Watch | None = None
    ) -> ReadStats:
        assert src.shape == dst.shape and src.dtype == dst.dtype == np.int64
        cps = tuple(cp for cp, _ in parts)
        gates = [self.gates[cp] for cp in cps if cp in self.gates]
        if self.points is not None and (point := self.points.reach("read", *cps)) is not None:
            gates.append(point)
        self.timeline.add("read", cps, tuple((cp, layers.start, layers.stop) for cp, layers in parts))
        self.in_flight += 1
        try:
            try:
                for gate in gates:
                    await gate.wait()
                if not gates:
                    await asyncio.sleep(0)
            except asyncio.CancelledError:
                if self.drain:
                    await _uncancellable(gates)
                for _ in range(self.cancel_turns):  # the in-flight copy takes a while to end
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.sleep(0)
                self._land(parts, src, dst)  # the in-flight copy ends before the read does
                self.timeline.add("read_cancelled", cps)
                raise
            error = next((self.errors[cp] for cp in cps if cp in self.errors), None)
            if error is not None:
                self.timeline.add("read_failed", cps)
                raise error
            self._land(parts, src, dst)
            if watch is not None:  # as the GPU lane's waiting thread does, before its loop hears
                self.timeline.add("told", watch.landed())
            if self.heard is not None:  # the loop hears of the landing only once it is set
                await _uncancellable([self.heard])
        finally:
            self.in_flight -= 1
            self.timeline.add("read_end", cps)
        nbytes = sum(len(layers) for _, layers in parts) * src.size * PAGE
        return ReadStats(nbytes, 0, 1e-6)

    def _land(self, parts: list[tuple[int, range]], src: np.ndarray, dst: np.ndarray) -> None:
        for cp, layers in parts:
            for layer in layers:
                self.mem[layer, dst] = SOURCE[cp][layer, src]
            self.timeline.add("landed", cp, layers.start, layers.stop)


async def _uncancellable(gates: list[asyncio.Event]) -> None:
    """Wait for every gate, whatever cancels us meanwhile."""
    for gate in gates:
        while not gate.is_set():
            try:
                await gate.wait()
            except asyncio.CancelledError:
                continue


# ---- the owners' control side --------------------------------------------------------------------


@dataclass
class FakeOwner:
    """One CP rank's room as its control service would answer for it."""

    timeline: Timeline
    rank: RankDescriptor
    src_pages: list[int]
    ready_upto: int
    unknown: int = 0  # claims answered UNKNOWN before the room appears
    freed: bool = True  # what its releases answer
    refuse: BaseException | None = None  # its (non give-up) releases raise this
    hold_claims: asyncio.Event | None = None  # claims wait for this before they are answered
    script: list[int] = field(default_factory=list)  # each poll first makes layers up to the next ready
    tokens: set[str] = field(default_factory=set)  # claims granted and not yet released
    moved: asyncio.Event = field(default_factory=asyncio.Event)
    pin: OwnerPin | None = None  # named in its states once the room is whole, as a pinning owner does

    @property
    def cp(self) -> int:
        return self.rank.cp_rank

    def state(self) -> RoomState:
        status = RoomStatus.READY if self.ready_upto >= self.rank.layer_end else RoomStatus.PENDING
        pin = self.pin if status is RoomStatus.READY else None
        return RoomState(room=ROOM, status=status, src_pages=self.src_pages, ready_upto=self.ready_upto, pin=pin)

    def advance(self, upto: int) -> None:
        self.ready_upto = upto
        self.timeline.add("ready", self.cp, upto)
        self.moved.set()
        self.moved = asyncio.Event()

    async def handle(self, op: str, body: Any, query: dict[str, list[str]]) -> Any:
        if op == "claim":
            assert isinstance(body, ClaimRequest) and body.room == ROOM
            if self.hold_claims is not None:
                await self.hold_claims.wait()
            if self.unknown > 0:
                self.unknown -= 1
                return RoomState(room=ROOM, status=RoomStatus.UNKNOWN)
            self.tokens.add(body.claim)
            return self.state()
        if op == "poll":
            assert body is None and query["claim"][0] in self.tokens
            after = int(query["after"][0])
            if self.script:
                self.advance(self.script.pop(0))
            while self.ready_upto <= after and self.ready_upto < self.rank.layer_end:
                await self.moved.wait()
            return self.state()
        assert op == "release" and isinstance(body, ReleaseNotice) and body.room == ROOM
        if self.refuse is not None and not body.abort:
            raise self.refuse
        self.tokens.discard(body.claim)
        return ReleaseReply(room=ROOM, freed=self.freed, unreleased=0)


@dataclass(frozen=True)
class Request:
    op: str  # "claim", "poll", "release" or "give_up" (a release with abort=True)
    cp: int
    after: int | None = None  # a poll's `after`


class FakeClient:
    """`ControlClient.request` routed by URL to fake owners; records every request in order."""

    def __init__(self, timeline: Timeline, owners: dict[int, FakeOwner]) -> None:
        self.timeline = timeline
        self.by_url = {o.rank.control_url: o for o in owners.values()}
        self.requests: list[Request] = []
        self.points: Awaits | None = None

    async def request(
        self,
        method: str,
        url: str,
        kind: type,
        body: Any,
        *,
        fingerprint: str,
        expect_fingerprint: str,
        timeout: float,
    ) -> Any:
        assert fingerprint == expect_fingerprint == FP and timeout > 0
        parts = urlsplit(url)
        owner = self.by_url[f"{parts.scheme}://{parts.netloc}"]
        path = parts.path.split("/")
        assert path[:3] == ["", "v1", "rooms"] and int(path[3]) == ROOM, url
        query = parse_qs(parts.query)
        op = path[4] if len(path) > 4 else "poll"
        expect = {"claim": ("POST", RoomState), "poll": ("GET", RoomState), "release": ("POST", ReleaseReply)}[op]
        assert (method, kind) == expect, (method, kind, url)
        if op == "release" and body.abort:
            op = "give_up"
        req = Request(op, owner.cp, int(query["after"][0]) if op == "poll" else None)
        self.requests.append(req)
        self.timeline.add("request", op, owner.cp)
        gate = self.points.reach(op, owner.cp) if self.points is not None else None
        if gate is not None and op == "release":
            gate = None  # a release once sent is seen through (the protocol shields it): it is answered
        try:
            await (gate.wait() if gate is not None else asyncio.sleep(0))
            answer = await owner.handle("release" if op == "give_up" else op, body, query)
        except asyncio.CancelledError:
            self.timeline.add("request_cancelled", op, owner.cp)
            raise
        except Exception as exc:
            self.timeline.add("refused", op, owner.cp, type(exc).__name__)
            raise
        self.timeline.add("answer", op, owner.cp)
        return answer

    def of(self, cp: int, *ops: str) -> list[Request]:
        return [r for r in self.requests if r.cp == cp and r.op in ops]


class FakeFeed:
    """A readiness feed with no stream up: `wait` says nothing was pushed (the protocol
    polls); `aborted` raises `RoomAbortedError` once the test sets `abort`."""

    def __init__(self, timeline: Timeline, owners: dict[int, FakeOwner]) -> None:
        self.timeline = timeline
        self.cp_of = {o.rank.control_url: cp for cp, o in owners.items()}
        self.wanted: Counter[tuple[str, int]] = Counter()
        self.abort = asyncio.Event()
        self.watches = 0
        self.points: Awaits | None = None

    def want(self, url: str, room: int) -> None:
        self.wanted[(url, room)] += 1

    def forget(self, url: str, room: int) -> None:
        self.wanted.pop((url, room), None)

    def latest(self, url: str, room: int) -> RoomState | None:
        return None

    def lost(self, url: str) -> bool:  # a fake owner's stream never falls silent
        return False

    async def wait(self, url: str, room: int, after: int, timeout: float, after_pages: int = -1) -> RoomState | None:
        gate = self.points.reach("wait", self.cp_of[url]) if self.points is not None else None
        if gate is not None:
            await gate.wait()
        return None

    def aborted(self, urls: dict[str, int], room: int) -> Any:
        return self._aborted(urls, room)

    async def _aborted(self, urls: dict[str, int], room: int) -> None:
        self.watches += 1
        await self.abort.wait()
        self.timeline.add("aborted")
        raise RoomAbortedError(f"room {room} was aborted on cp rank {min(urls.values())}")


# ---- the ticket's pins ---------------------------------------------------------------------------


class FakePins:
    """An owner's pin table mapped here (`Owner.pins`)."""

    def __init__(self, timeline: Timeline, cp: int, words: dict[int, int]) -> None:
        self.timeline, self.cp, self.words = timeline, cp, words
        self.closed = False

    def word(self, slot: int) -> int:
        self.timeline.add("pin_word", self.cp)
        return self.words.get(slot, 0)

    def close(self) -> None:
        self.closed = True


class FakeUcx:
    """In place of `UcxLane` for tickets: remote pin words by address, notifications recorded."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline
        self.words: dict[int, int] = {}  # address -> int64 word
        self.cp_of: dict[str, int] = {}  # agent name -> cp rank
        self.notified: list[tuple[str, bytes]] = []
        self.closed = False

    async def read_word(self, agent: str, addr: int, window: Any, deadline: Deadline) -> None:
        self.timeline.add("pin_read", self.cp_of[agent])
        await asyncio.sleep(0)
        for i in range(len(window)):
            window[i] = self.words.get(addr + 8 * i, 0)

    def notify(self, messages: list[tuple[str, bytes]]) -> None:
        self.timeline.add("notify", tuple(self.cp_of[agent] for agent, _ in messages))
        self.notified.extend(messages)

    def connected(self, agent: str) -> bool:
        return agent in self.cp_of

    def releases(self) -> dict[int, TicketRelease]:
        return {self.cp_of[agent]: decode(body, TicketRelease, FP) for agent, body in self.notified}


# ---- a world of three owners ---------------------------------------------------------------------


def pin_table(cp: int) -> PinTable:
    return PinTable(addr=1 << 20 | cp << 16, slots=64, host_id="another-host", pid=1, fd=3, tag=1)


def nonce(cp: int) -> int:
    return 0x5EED0000 + cp


SLOT = 9


@dataclass
class World:
    timeline: Timeline
    owners: dict[int, Owner]
    fake: dict[int, FakeOwner]
    lane: FakeLane
    merging: FakeLane
    client: FakeClient
    feed: FakeFeed
    ctx: DecodeContext
    mem: np.ndarray
    dst: np.ndarray
    points: Awaits

    def job(self) -> Fetch:
        return Fetch("e0", ROOM, self.dst, Deadline.after(300), time.perf_counter())

    def claims(self) -> ClaimProtocol:
        return ClaimProtocol(self.ctx)


async def world(
    *,
    ready: dict[int, int] | None = None,
    src_pages: dict[int, list[int]] | None = None,
    dst: list[int] | None = None,
    pins: bool = False,
    merged: tuple[int, ...] = (),
) -> World:
    """Three owners (cp ranks 0..2 of tests.wire_helpers' layout), every layer ready unless
    `ready` says how far (a layer index) for some; one `FakeLane` reads them all, but the
    `merged` ranks, which one that reads several together (`World.merging`) reads."""
    timeline = Timeline()
    mem = np.zeros((LAYERS, NUM_PAGES, PAGE), np.uint8)
    lane, merging = FakeLane(timeline, mem), FakeLane(timeline, mem, merges=True, name="merging")
    dst_ids = np.asarray(dst if dst is not None else [7, 3, 60, 11, 0], np.int64)
    fakes, owners = {}, {}
    for cp, span in SPANS.items():
        rank = rank_descriptor(
            cp,
            control_url=f"http://owner{cp}.test:8000",
            agent_name=f"e0.cp{cp}.abc",
            pins=pin_table(cp) if pins else None,
        )
        pages = (
            src_pages[cp] if src_pages is not None else [(5 * cp + 2 * i + 1) % NUM_PAGES for i in range(len(dst_ids))]
        )
        fakes[cp] = FakeOwner(timeline, rank, pages, (ready or {}).get(cp, span.stop))
        own_lane = merging if cp in merged else lane
        owners[cp] = Owner(rank, {}, lane=own_lane, peer=await own_lane.open(rank, {}))
    client, feed = FakeClient(timeline, fakes), FakeFeed(timeline, fakes)
    pool = SimpleNamespace(layout=LAYOUT)
    ctx = DecodeContext(pool, Timeouts(), "decode-test", client, feed)  # type: ignore[arg-type]
    points = Awaits(timeline)
    client.points = feed.points = lane.points = points
    return World(timeline, owners, fakes, lane, merging, client, feed, ctx, mem, dst_ids, points)


async def until(condition: Any, what: str = "condition", spins: int = 1000) -> None:
    """Let the loop run until `condition()` holds (a bounded number of turns, not a time)."""
    for _ in range(spins):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what} never held")


async def settle(spins: int = 50) -> None:
    for _ in range(spins):
        await asyncio.sleep(0)


async def reported(w: World, work: Awaitable[T]) -> T:
    """`work`'s outcome, marked ("outcome") in the timeline as it reaches its caller."""
    try:
        return await work
    finally:
        w.timeline.add("outcome")


def assert_nothing_after(w: World, outcome: int) -> None:
    """No byte landed, and no read was in flight, once the outcome was reported."""
    assert not [e for e in w.timeline.events[outcome:] if e[0] in ("landed", "read")], w.timeline.events[outcome:]
    assert w.lane.in_flight == w.merging.in_flight == 0


def assert_given_up_once(w: World, released: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Every rank a claim request went to got exactly one release request: its own release
    (`released`) or else one give-up; a rank never asked got none."""
    for cp in SPANS:
        asked = bool(w.client.of(cp, "claim"))
        releases, give_ups = w.client.of(cp, "release"), w.client.of(cp, "give_up")
        if not asked:
            assert not releases and not give_ups, cp
        elif cp in released:
            assert len(releases) == 1 and not give_ups, (cp, w.client.requests)
        else:
            assert not releases and len(give_ups) == 1, (cp, w.client.requests)


# ---- 1. claims ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("freed", [(True, True, True), (True, False, True)])
async def test_claims_arbiter_first_read_then_release(freed: tuple[bool, ...]) -> None:
    pages = {0: [1, 2, 3, 4, 5], 1: [64, 10, 20, 30, 40], 2: [9, 8, 7, 6, 5]}  # each owner's own pages
    w = await world(src_pages=pages, dst=[0, 63, 5, 17, 2])
    for cp, f in enumerate(freed):
        w.fake[cp].freed = f
    assert isinstance(w.lane, Lane)

    result = await reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job()))

    t, reqs = w.timeline, w.client.requests
    # The lowest CP rank is claimed, and answers, before any other rank is asked anything.
    assert reqs[0] == Request("claim", 0)
    others = [i for i, e in enumerate(t.events) if e[0] == "request" and e[2] != 0]
    assert t.first("answer", "claim", 0) < min(others)
    # Each owner: claimed once, read whole, then released (after its last byte landed).
    for cp, span in SPANS.items():
        assert w.client.of(cp, "claim") == [Request("claim", cp)]
        assert w.client.of(cp, "release", "give_up") == [Request("release", cp)]
        assert t.last("landed", cp) < t.first("request", "release", cp)
        assert [(c, ly) for c, ly in w.lane.reads if c == cp] == [(cp, span)]
        assert not w.fake[cp].tokens  # nothing left pinned
    assert len(reqs) == 6
    # Byte for byte: every owner's own source pages of every layer, in the destination pages.
    np.testing.assert_array_equal(w.mem, expected(w.dst, {cp: np.asarray(p) for cp, p in pages.items()}))
    # The result.
    assert result.room == ROOM and result.engine_id == "e0"
    assert result.nbytes == LAYERS * len(w.dst) * PAGE
    assert result.control_messages == 6
    assert [(s.cp_rank, s.layers, s.nbytes, s.reads, s.path) for s in result.owners] == [
        (cp, (span.start, span.stop), len(span) * len(w.dst) * PAGE, 1, "fake") for cp, span in SPANS.items()
    ]
    assert result.freed_on == tuple(cp for cp, f in enumerate(freed) if f)
    assert result.freed is all(freed)
    assert not w.feed.wanted  # every room it wanted pushed, forgotten


# ---- 2. layers arriving in steps -----------------------------------------------------------------


async def test_claims_read_layers_in_batches_as_they_become_ready() -> None:
    w = await world(ready={0: 0, 1: 3})  # rank 0: nothing ready; rank 1: nothing; rank 2: all
    w.fake[1].unknown = 1  # rank 1's room is published only at its second claim
    for cp, f in w.fake.items():
        w.timeline.add("ready", cp, f.ready_upto)
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))

    def read_of(cp: int) -> list[range]:
        return [ly for c, ly in w.lane.reads if c == cp]

    await until(lambda: read_of(2) and len(w.client.of(0, "poll")) == 1 and len(w.client.of(1, "poll")) == 1)
    assert read_of(0) == read_of(1) == []
    steps = [
        (0, 1, [range(0, 1)]),
        (1, 4, [range(3, 4)]),
        (0, 3, [range(0, 1), range(1, 3)]),
        (1, 5, [range(3, 4), range(4, 5)]),
    ]
    for cp, upto, reads in steps:
        w.fake[cp].advance(upto)
        done = (cp, reads)
        await until(lambda d=done: read_of(d[0]) == d[1] and w.timeline.where("landed", d[0], d[1][-1].start))
        await settle()
        assert read_of(cp) == reads  # one batch for what became ready (two layers at once too)
    result = await fetch

    # Nothing was read before it was ready: every read's layers were ready at the time.
    for i, event in enumerate(w.timeline.events):
        if event[0] == "read":
            for cp, _start, stop in event[2]:
                ready_then = max(e[2] for e in w.timeline.events[:i] if e[:2] == ("ready", cp))
                assert stop <= ready_then, (event, ready_then)
    # Each poll asked past what was already read; rank 1 claimed twice (UNKNOWN, then PENDING).
    assert [r.after for r in w.client.of(0, "poll")] == [0, 1]
    assert [r.after for r in w.client.of(1, "poll")] == [3, 4]
    assert len(w.client.of(1, "claim")) == 2 and not w.client.of(2, "poll")
    for cp in SPANS:
        assert w.timeline.last("landed", cp) < w.timeline.first("request", "release", cp)
    np.testing.assert_array_equal(w.mem, expected(w.dst, {cp: np.asarray(f.src_pages) for cp, f in w.fake.items()}))
    assert [s.reads for s in result.owners] == [2, 2, 1]
    assert result.control_messages == len(w.client.requests) == 4 + 4 + 3
    assert result.freed and result.freed_on == (0, 1, 2)


# ---- 3. a slow read and a refused release --------------------------------------------------------


async def test_claims_refused_release_raises_after_the_slow_read_ended() -> None:
    w = await world()
    w.lane.gates[0] = slow = asyncio.Event()
    w.lane.drain = True  # cancelled, the slow read still runs to its end
    w.fake[1].refuse = ClaimLostError("room 42: the claim is unknown on cp rank 1")
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))

    try:
        await until(lambda: w.timeline.where("refused", "release", 1), "rank 1 refused")
        await settle()
        assert w.lane.in_flight == 1 and not w.timeline.where("landed", 0)
        assert not fetch.done()  # the refusal is known, but rank 0's read has not ended
    finally:
        slow.set()  # a drained read waits for it whatever cancels it: never leave it shut
    with pytest.raises(ClaimLostError, match="cp rank 1"):
        await fetch
    outcome = w.timeline.first("outcome")

    t = w.timeline
    assert t.first("refused", "release", 1) < t.first("landed", 0) < t.first("read_end", (0,)) < outcome
    assert t.where("read_cancelled", (0,))
    assert_nothing_after(w, outcome)
    # Rank 1 was released (refused); rank 0 given up; rank 2 either released or given up, once.
    assert w.client.of(1, "release") == [Request("release", 1)] and not w.client.of(1, "give_up")
    assert w.client.of(0, "give_up") == [Request("give_up", 0)] and not w.client.of(0, "release")
    assert len(w.client.of(2, "release", "give_up")) == 1
    assert not w.fake[0].tokens


# ---- 4. cancellation at every await ---------------------------------------------------------------


async def _await_scenario(cancel_at: int | None) -> tuple[World, BaseException | None]:
    """Rank 0 ready; rank 1 half ready (one poll); rank 2 published at its second claim."""
    w = await world(ready={1: 4})
    w.fake[1].script = [5]
    w.fake[2].unknown = 1
    w.points.cancel_at = cancel_at
    fetch = asyncio.ensure_future(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))
    w.points.target = fetch
    outcome: BaseException | None = None
    try:
        await fetch
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        outcome = exc
    return w, outcome


def _count_awaits() -> list[tuple[Any, ...]]:
    w, outcome = asyncio.run(_await_scenario(None))
    assert outcome is None
    return w.points.labels


AWAITS = _count_awaits()


def test_await_scenario_awaits_every_kind() -> None:
    kinds = Counter(label[0] for label in AWAITS)
    assert kinds == {"claim": 4, "read": 4, "wait": 1, "poll": 1, "release": 3}, AWAITS


@pytest.mark.parametrize("n", range(len(AWAITS)), ids=[f"{i}-{'.'.join(map(str, a))}" for i, a in enumerate(AWAITS)])
async def test_claims_cancelled_at_every_await(n: int) -> None:
    w, outcome = await _await_scenario(n)

    assert isinstance(outcome, asyncio.CancelledError), outcome
    assert w.points.fired and w.points.labels[n] == AWAITS[n]
    assert_nothing_after(w, w.timeline.last("outcome"))
    released = {cp for cp in SPANS if w.client.of(cp, "release")}
    assert_given_up_once(w, released)
    # Releases are asked only after a rank's last byte landed, and a give-up only after the cancel.
    for cp in released:
        assert w.timeline.last("landed", cp) < w.timeline.first("request", "release", cp)
    cancel = w.timeline.first("cancel")
    assert all(i > cancel for i in w.timeline.where("request", "give_up"))
    assert not w.feed.wanted
    assert all(not f.tokens for f in w.fake.values())  # nothing left pinned, a release cut off too


# ---- 5. the room aborted mid-read ----------------------------------------------------------------


async def test_claims_room_aborted_mid_read() -> None:
    w = await world()
    for cp in SPANS:
        w.lane.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))
    await until(lambda: w.lane.in_flight == 3, "three reads in flight")
    assert w.feed.watches == 1 and not w.timeline.where("landed")
    w.feed.abort.set()
    with pytest.raises(RoomAbortedError):
        await fetch
    outcome = w.timeline.first("outcome")

    t = w.timeline
    for cp in SPANS:
        assert t.first("aborted") < t.first("read_cancelled", (cp,)) < outcome
        assert t.first("landed", cp) < t.first("read_cancelled", (cp,))  # its in-flight copy first
        assert all(i > t.first("read_end", (cp,)) for i in t.where("request", "give_up", cp))
    assert_nothing_after(w, outcome)
    assert_given_up_once(w)
    assert all(not f.tokens for f in w.fake.values())
    assert not w.feed.wanted


# ---- 6. tickets ------------------------------------------------------------------------------------


async def ticket_world(
    *, merged: tuple[int, ...] = (), mapped: tuple[int, ...] = (0, 1)
) -> tuple[World, FakeUcx, TicketProtocol, RoomTicket]:
    """Three pinned owners: `mapped` ranks' pin tables mapped here (the rest READ over
    UCX); `merged` ranks on a lane that reads them together, the rest on a plain one."""
    w = await world(pins=True, merged=merged)
    ucx = FakeUcx(w.timeline)
    for cp, o in w.owners.items():
        ucx.cp_of[o.rank.agent_name] = cp
        if cp in mapped:
            o.pins = FakePins(w.timeline, cp, {SLOT: nonce(cp)})  # type: ignore[assignment]
        else:
            assert o.rank.pins is not None
            ucx.words[o.rank.pins.addr + 8 * SLOT] = nonce(cp)
    src = w.fake[0].src_pages
    pins = [OwnerPin(cp_rank=cp, incarnation="abc", slot=SLOT, nonce=nonce(cp)) for cp in SPANS]
    ticket = RoomTicket(engine_id="e0", room=ROOM, src_pages=src, pins=pins)
    return w, ucx, TicketProtocol(w.ctx, ucx), ticket  # type: ignore[arg-type]


def pin_checks(t: Timeline, cp: int) -> list[int]:
    return t.where("pin_word", cp) + t.where("pin_read", cp)


async def test_ticket_reads_every_owner_at_once_then_proves_each_pin() -> None:
    w, ucx, tickets, ticket = await ticket_world(mapped=(0, 1))
    for cp in SPANS:
        w.lane.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, tickets.fetch(w.owners, ticket, w.job())))
    await until(lambda: w.lane.in_flight == 3, "every read started")
    assert not w.timeline.where("landed")  # all three reads started before any completed
    for cp in (2, 0, 1):  # completions in an order of the test's choosing
        w.lane.gates[cp].set()
        await settle(5)
    result = await fetch
    outcome = w.timeline.first("outcome")
    await settle(5)

    t = w.timeline
    for cp in SPANS:
        (check,) = pin_checks(t, cp)
        assert t.last("landed", cp) < check < outcome  # each pin word after its own data
    assert t.where("pin_read", 2) and not t.where("pin_word", 2)  # rank 2's table is not mapped here
    assert ucx.releases() == {cp: TicketRelease(room=ROOM, slot=SLOT, nonce=nonce(cp)) for cp in SPANS}
    assert t.first("notify") > outcome  # released only after the fetch returned to its caller
    assert not w.client.requests  # a ticket asks nobody
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))
    assert result.control_messages == 0 and not result.freed
    assert result.nbytes == LAYERS * len(w.dst) * PAGE
    assert [(s.cp_rank, s.layers) for s in result.owners] == [(cp, (s.start, s.stop)) for cp, s in SPANS.items()]


async def test_ticket_releases_wait_out_their_delay_unless_flushed() -> None:
    w, ucx, _, ticket = await ticket_world()
    tickets = TicketProtocol(w.ctx, ucx, release_delay=0.2)  # type: ignore[arg-type]
    await tickets.fetch(w.owners, ticket, w.job())
    await settle(20)
    assert not ucx.notified  # a caller on another thread sees the outcome first
    await asyncio.sleep(0.3)
    assert set(ucx.releases()) == set(SPANS)
    tickets.releases.close()  # no owner here clears a word: its releases would be sent again

    ucx.notified.clear()
    tickets = TicketProtocol(w.ctx, ucx, release_delay=60)  # type: ignore[arg-type]
    await tickets.fetch(w.owners, ticket, w.job())
    tickets.flush()  # the fetcher closes: nothing may be left to the pins' expiry
    assert set(ucx.releases()) == set(SPANS)
    tickets.flush()
    assert len(ucx.notified) == len(SPANS)  # sent once


def pinned_lease(w: World, claim: Claim) -> tuple[RoomLease, FakeUcx]:
    """A lease on `w`'s room under `claim`, each owner pinning it (its pin table mapped here)."""
    activity = Activity("decode-test")
    activity.open = True
    ucx = FakeUcx(w.timeline)
    for cp, o in w.owners.items():
        ucx.cp_of[o.rank.agent_name] = cp
        w.fake[cp].pin = OwnerPin(cp_rank=cp, incarnation="abc", slot=SLOT, nonce=nonce(cp))
        o.pins = FakePins(w.timeline, cp, {SLOT: nonce(cp)})  # type: ignore[assignment]
    lease = RoomLease(w.ctx, activity, w.claims(), TicketProtocol(w.ctx, ucx), "e0", w.owners, claim)  # type: ignore[arg-type]
    return lease, ucx


@pytest.mark.parametrize("cleared", [False, True], ids=["proved", "pin-cleared"])
async def test_lease_read_as_written_is_proved_by_pin_words_not_release_round_trips(cleared: bool) -> None:
    """A room claimed before it was whole is read by claims as its layers come; once every
    owner's last state names its pin, the read is proved by the pin words after the data and
    the claims released by notifications: no release request. A pin word cleared meanwhile
    fails the read and gives the claims up."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same), ready={0: 1, 2: 7})
    claim = Claim(ROOM)
    lease, ucx = pinned_lease(w, claim)
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    assert lease._prepared_read() is None  # not whole at the claim: read by claims
    w.fake[0].script, w.fake[2].script = [SPANS[0].stop], [SPANS[2].stop]  # the rest comes while it is read
    if cleared:
        w.owners[1].pins.words[SLOT] = 0  # type: ignore[union-attr]
        with pytest.raises(ClaimLostError, match="cp rank 1 "):
            await lease.read_once(w.dst)
        assert not ucx.notified and all(w.client.of(cp, "give_up") for cp in SPANS)
        return
    result = await lease.read_once(w.dst)
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(same))))
    t = w.timeline
    for cp in SPANS:
        assert t.last("landed", cp) < t.first("pin_word", cp)  # each word after its owner's data
        assert not w.client.of(cp, "release") and not w.client.of(cp, "give_up")
    await asyncio.sleep(0)
    assert {ucx.cp_of[agent] for agent, _ in ucx.notified} == set(SPANS)  # released by notifications
    assert all(decode(body, ClaimRelease, FP).claim == claim.token for _, body in ucx.notified)
    assert not result.freed and result.freed_on == ()
    await lease.release()  # as leaving `async with lease` does: released already, nothing asked
    await lease.give_up()
    assert not any(w.client.of(cp, "release") or w.client.of(cp, "give_up") for cp in SPANS)


async def test_lease_released_by_notifications_is_released_at_once_for_its_holder() -> None:
    """The notifications of a read proved by pin words may leave a moment after it returned;
    the claim counts as released from the return, so a `release` or `give_up` right after
    asks no owner (a release request racing the notification could fail a proved read, a
    give-up would abort a room that was read)."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same))
    claim = Claim(ROOM)
    lease, ucx = pinned_lease(w, claim)
    lease._tickets.release_delay = 60  # the notifications wait: the holder acts first
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    await lease.read_once(w.dst)  # read as a ticket's: the room was whole at the claim
    assert await lease.release() is False
    await lease.give_up()
    assert not any(w.client.of(cp, "release") or w.client.of(cp, "give_up") for cp in SPANS)
    lease._tickets.flush()
    assert {ucx.cp_of[agent] for agent, _ in ucx.notified} == set(SPANS)


@pytest.mark.parametrize("whole", [True, False], ids=["as-a-ticket", "by-claims"])
async def test_lease_whose_owner_was_forgotten_fails_its_read_typed_and_gives_up(whole: bool) -> None:
    """An owner forgotten between the claim and its lease (its engine re-registered, a peer
    lost) leaves the lease unprepared rather than failing the claim with its room held; the
    read then fails typed and gives the claims up, whether the room reads as a ticket's (its
    claim answers named the pins) or by claims."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same))
    claim = Claim(ROOM)
    if whole:
        pinned_lease(w, claim)  # the owners pin: their claim answers name the pins
    await w.claims().claim_all(w.owners, claim, w.job().deadline)
    w.owners[1].lane = None
    lease, _ = pinned_lease(w, claim)
    assert lease._prepared is None or not whole  # the preparation failed quietly, at the claim
    with pytest.raises(PeerLostError):
        await lease.read_once(w.dst)
    assert all(w.client.of(cp, "give_up") for cp in SPANS)


async def test_lease_whose_owner_names_another_ranks_pin_reads_by_claims() -> None:
    """A claim answer whose pin is another rank's does not make the room read as a
    ticket's (that read would look the owner's pin up and fail untyped): it is read by
    claims, which need no pin, byte for byte."""
    same = [1, 4, 9, 16, 25]
    w = await world(pins=True, src_pages=dict.fromkeys(SPANS, same))
    claim = Claim(ROOM)
    claims = w.claims()
    await claims.claim_all(w.owners, claim, w.job().deadline)
    for cp, state in claim.states.items():
        other = (cp + 1) % len(SPANS)
        pin = OwnerPin(cp_rank=other, incarnation="abc", slot=SLOT, nonce=nonce(other))
        claim.states[cp] = msgspec.structs.replace(state, pin=pin)
    activity = Activity("decode-test")
    activity.open = True
    ucx = FakeUcx(w.timeline)
    lease = RoomLease(w.ctx, activity, claims, TicketProtocol(w.ctx, ucx), "e0", w.owners, claim)  # type: ignore[arg-type]
    assert lease._prepared_read() is None
    result = await lease.read_once(w.dst)
    assert result.freed and not ucx.notified  # released by claims, not by notifications
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(same))))


@pytest.mark.parametrize("mapped", [(0, 1, 2), ()], ids=["mapped", "read"])
async def test_ticket_cleared_pin_word_fails_and_releases_at_once(mapped: tuple[int, ...]) -> None:
    w, ucx, tickets, ticket = await ticket_world(mapped=mapped)
    if 1 in mapped:
        w.owners[1].pins.words[SLOT] = 0  # type: ignore[union-attr]
    else:
        ucx.words[pin_table(1).addr + 8 * SLOT] = 0
    w.lane.gates[2] = asyncio.Event()  # rank 2 still reading when rank 1's pin fails
    with pytest.raises(ClaimLostError, match="cp rank 1 "):
        await reported(w, tickets.fetch(w.owners, ticket, w.job()))
    outcome = w.timeline.first("outcome")

    t = w.timeline
    assert t.first("read_cancelled", (2,)) < t.first("notify") < outcome  # released at once, reads ended
    assert ucx.releases() == {cp: TicketRelease(room=ROOM, slot=SLOT, nonce=nonce(cp)) for cp in SPANS}
    assert_nothing_after(w, outcome)
    await settle(5)
    assert len(ucx.notified) == 3  # and once only


async def test_ticket_merged_lane_reads_its_owners_in_one_call() -> None:
    w, ucx, tickets, ticket = await ticket_world(merged=(0, 1, 2), mapped=(0, 1, 2))
    merging = w.merging
    result = await reported(w, tickets.fetch(w.owners, ticket, w.job()))
    outcome = w.timeline.first("outcome")
    await settle(5)

    assert merging.merged_calls == [(0, 1, 2)] and not merging.reads and not w.lane.reads
    t = w.timeline
    for cp in SPANS:
        assert t.last("landed", cp) < t.first("pin_word", cp) < outcome < t.first("notify")
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))
    assert [(s.cp_rank, s.layers, s.nbytes, s.path) for s in result.owners] == [
        (cp, (s.start, s.stop), len(s) * PAGE * len(w.dst), "merging") for cp, s in SPANS.items()
    ]
    assert result.nbytes == LAYERS * len(w.dst) * PAGE
    assert len(ucx.notified) == 3


async def landed_read(
    aux: bytes | None = None, before_the_data: Callable[[World], None] | None = None
) -> tuple[World, Landing, asyncio.Task[FetchResult]]:
    """A merged read of every owner (pin tables mapped) with a landing, stopped where its
    bytes have landed and the lane has told the landing, but its task has not heard yet (a
    GPU kernel that has passed). `before_the_data` runs while the read is in flight."""
    w, ucx, _, ticket = await ticket_world(merged=(0, 1, 2), mapped=(0, 1, 2))
    tickets = TicketProtocol(w.ctx, ucx, release_delay=60)  # type: ignore[arg-type]  # a synchronous caller's
    merging, landing = w.merging, Landing()
    merging.gates[0], merging.heard = asyncio.Event(), asyncio.Event()
    job = Fetch("e0", ROOM, w.dst, Deadline.after(300), time.perf_counter(), landing)
    read = asyncio.create_task(reported(w, tickets.read(tickets.prepare(w.owners, ticket, aux), job)))
    await until(lambda: merging.in_flight == 1, "the read launched")
    assert landing.told() is None  # launched, not landed
    if before_the_data is not None:
        before_the_data(w)
    merging.gates[0].set()
    await until(lambda: w.timeline.where("told"), "the lane told the landing")
    return w, landing, read


async def test_a_landing_holds_a_merged_reads_result_before_its_task_hears_and_the_proof_is_made_once() -> None:
    w, landing, read = await landed_read(aux=b"first token")
    seen = landing.told()  # as a scheduler's poll finds it, before the decode's loop hears of the landing
    assert seen is not None and not read.done() and w.timeline.where("told", True)
    assert (seen.room, seen.nbytes, seen.aux) == (ROOM, LAYERS * len(w.dst) * PAGE, b"first token")
    t = w.timeline
    assert all(t.last("landed", cp) < t.first("pin_word", cp) < t.first("told") for cp in SPANS)  # after the data
    src = np.asarray(w.fake[0].src_pages)
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, src)))
    for o in w.owners.values():  # the room ends on its owners after it was proved: too late to matter
        o.pins.words.clear()  # type: ignore[union-attr]
    w.merging.heard.set()
    result = await read
    assert len(t.where("pin_word")) == len(SPANS)  # proved once, by the lane's thread; the task followed it
    assert result is seen  # one result, timed where it was proved
    await settle(5)
    assert t.where("notify", tuple(SPANS))  # released at once: the caller was told before the loop heard


def _abort_on_cp1(w: World) -> None:
    w.owners[1].pins.words.clear()  # type: ignore[union-attr]


async def test_a_landing_whose_pin_word_was_cleared_during_the_read_never_holds_a_result() -> None:
    w, landing, read = await landed_read(before_the_data=_abort_on_cp1)
    assert w.timeline.where("told", False) and landing.told() is None  # refused: nothing for the caller
    w.merging.heard.set()
    with pytest.raises(ClaimLostError):
        await read
    assert len(w.timeline.where("pin_word", 1)) == 1  # the task took the lane thread's verdict
    assert landing.told() is None


def _forget_cp1(w: World) -> None:
    owner = w.owners[1]
    owner.pins.close()  # type: ignore[union-attr]  # as `Owners` forgets an engine (another fetch lost its peer)
    owner.pins = None


async def test_a_landed_read_whose_owner_was_forgotten_meanwhile_fails_typed() -> None:
    """An owner forgotten while the kernel ran (its table dropped) cannot be proved by a
    load: neither the lane's thread nor the loop passes the read."""
    w, landing, read = await landed_read(before_the_data=_forget_cp1)
    assert w.timeline.where("told", False) and landing.told() is None
    w.merging.heard.set()
    with pytest.raises(PeerLostError, match="cp rank 1"):
        await read


async def test_ticket_merged_and_plain_lanes_read_at_once() -> None:
    w, ucx, tickets, ticket = await ticket_world(merged=(0, 2), mapped=(0, 2))
    merging = w.merging
    for cp in SPANS:
        w.lane.gates[cp] = merging.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, tickets.fetch(w.owners, ticket, w.job())))
    await until(lambda: merging.in_flight == 1 and w.lane.in_flight == 1, "both reads started")
    assert not w.timeline.where("landed")
    for gate in merging.gates.values():
        gate.set()
    result = await fetch

    assert merging.merged_calls == [(0, 2)] and w.lane.reads == [(1, SPANS[1])]
    assert [s.cp_rank for s in result.owners] == [0, 1, 2]
    assert [s.path for s in result.owners] == ["merging", "fake", "merging"]
    np.testing.assert_array_equal(w.mem, expected(w.dst, dict.fromkeys(SPANS, np.asarray(ticket.src_pages))))


# ---- 7. the fetcher closed mid-fetch -----------------------------------------------------------------


@pytest.mark.parametrize("phase", ["arbiter_claim", "reads"])
async def test_claims_cancel_all_raises_closed(phase: str) -> None:
    w = await world()
    if phase == "arbiter_claim":
        w.fake[0].hold_claims = asyncio.Event()
    for cp in SPANS:
        w.lane.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, w.claims().fetch(w.owners, Claim(ROOM), w.job())))
    if phase == "arbiter_claim":
        await until(lambda: w.client.requests == [Request("claim", 0)])
    else:
        await until(lambda: w.lane.in_flight == 3, "three reads in flight")
    w.ctx.tasks.cancel_all()
    with pytest.raises(ClosedError):
        await fetch
    outcome = w.timeline.first("outcome")

    assert_nothing_after(w, outcome)
    assert_given_up_once(w)
    if phase == "arbiter_claim":  # no other rank was asked: only the lowest one is given up
        assert [r.cp for r in w.client.requests if r.op == "give_up"] == [0]
    else:
        assert all(not f.tokens for f in w.fake.values())


async def test_ticket_cancel_all_raises_closed_and_releases() -> None:
    w, ucx, tickets, ticket = await ticket_world()
    for cp in SPANS:
        w.lane.gates[cp] = asyncio.Event()
    fetch = asyncio.create_task(reported(w, tickets.fetch(w.owners, ticket, w.job())))
    await until(lambda: w.lane.in_flight == 3, "every read started")
    w.ctx.tasks.cancel_all()
    with pytest.raises(ClosedError):
        await fetch
    outcome = w.timeline.first("outcome")
    assert_nothing_after(w, outcome)
    assert w.timeline.first("notify") < outcome and len(ucx.notified) == 3
