"""The owners' control side: their rooms, the control client routing to them, the readiness feed."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pdkv.errors import PdkvError, RoomAbortedError
from tests.fakes.memory import FP, ROOM
from tests.fakes.timeline import Awaits, Timeline
from transfer.metadata import (
    ClaimAll,
    ClaimAllReply,
    ClaimRequest,
    OwnerClaim,
    OwnerPin,
    RankDescriptor,
    ReleaseNotice,
    ReleaseReply,
    RoomState,
    RoomStatus,
    error_reply,
)


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
        if self.refuse is not None and not body.give_up:
            raise self.refuse
        self.tokens.discard(body.claim)
        return ReleaseReply(room=ROOM, freed=self.freed, unreleased=0)


@dataclass(frozen=True)
class Request:
    op: str  # "claim", "poll", "release" or "give_up" (a release with give_up=True)
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
        if op == "release" and body.give_up:
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

    async def call(
        self, url: str, body: Any, kind: type, *, fingerprint: str, expect_fingerprint: str, timeout: float
    ) -> Any:
        """`ControlClient.call` on an owner's claim channel: a claim there, then (the arbiter)
        relayed to the ranks it names, each recorded as a claim of its own."""
        assert fingerprint == expect_fingerprint == FP and timeout > 0 and url.endswith("/v1/claims")
        assert isinstance(body, ClaimAll) and kind is ClaimAllReply
        base = url.removesuffix("/v1/claims")
        state = await self.request("POST", f"{base}/v1/rooms/{ROOM}/claim", RoomState, body.ask, **_fp(timeout))
        if state.status is RoomStatus.UNKNOWN or not body.others:
            return ClaimAllReply(arbiter=state, others=[])
        urls = {o.rank.cp_rank: url for url, o in self.by_url.items()}

        async def relay(cp: int) -> OwnerClaim:
            claimed = f"{urls[cp]}/v1/rooms/{ROOM}/claim"
            try:
                got = await self.request("POST", claimed, RoomState, body.ask, **_fp(timeout))
                return OwnerClaim(cp_rank=cp, state=got)
            except PdkvError as exc:
                return OwnerClaim(cp_rank=cp, error=error_reply(exc))

        others = await asyncio.gather(*(relay(o.cp_rank) for o in body.others))
        return ClaimAllReply(arbiter=state, others=list(others))

    def of(self, cp: int, *ops: str) -> list[Request]:
        return [r for r in self.requests if r.cp == cp and r.op in ops]


def _fp(timeout: float) -> dict[str, Any]:
    return {"fingerprint": FP, "expect_fingerprint": FP, "timeout": timeout}


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
