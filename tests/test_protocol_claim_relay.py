"""Claims in one round trip (issue 44): a decode asks the arbiter (the lowest CP rank) on its
claim channel, and the arbiter grants its own claim, relays it to the other ranks and
answers for all. Real processes (a registry, an engine of CP=3 whose ranks hold no claims
for the arbiter) and real sockets."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from typing import Any

import aiohttp
import msgspec
import pytest
import torch

from pdkv import DSAKVPool, RoomClaimedError, UnknownRoomError, tiny
from pdkv.errors import DeadlineExceeded, MetadataError, PeerLostError
from tests.rooms_helpers import UNTOUCHED, fragmented_pages, kv_is_exact, module_deployment, one_of_two_reads, prefill
from tests.scrape import histogram_totals
from transfer.app.router import Deployment, DeploymentSpec
from transfer.control import ControlClient, _Channel
from transfer.deadline import Deadline
from transfer.decode import DecodeFetcher
from transfer.metadata import ClaimAll, ClaimAllReply, ClaimRequest, OwnerRef, encode
from transfer.timeouts import Timeouts

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(
    engines=(3,),
    decoders=0,
    preset="tiny",
    prefill_pool_tokens=4096,
    decode_pool_tokens=8192,
    start_timeout=180,
    hold_claims=False,  # every claim relayed: the relay is what is tested here (held claims: test_protocol_held)
)
ENGINE = "prefill0"


deployment = module_deployment(SPEC)


async def _until_unpinned(deployment: Deployment, within: float = 10.0) -> None:
    end = time.monotonic() + within
    controls = deployment.engines[0].controls
    while True:
        stats = [await deployment.client.get_json(f"{c}/v1/stats") for c in controls]
        if all(s["pinned_pages"] == 0 for s in stats):
            return
        assert time.monotonic() < end, stats
        await asyncio.sleep(0.05)


def _record(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs of the control calls and requests this process makes to the owners' rooms."""
    sent: list[str] = []
    request, call = ControlClient.request, ControlClient.call

    async def on_request(self: ControlClient, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        if "/v1/rooms/" in url:
            sent.append(url)
        return await request(self, method, url, *args, **kwargs)

    async def on_call(self: ControlClient, url: str, *args: Any, **kwargs: Any) -> Any:
        sent.append(url)
        return await call(self, url, *args, **kwargs)

    monkeypatch.setattr(ControlClient, "request", on_request)
    monkeypatch.setattr(ControlClient, "call", on_call)
    return sent


async def _relays(deployment: Deployment, outcome: str = "ok") -> list[tuple[float, float]]:
    """Each rank's `pdkv_claim_relay_seconds` for this engine's relays of `outcome` (ok: every
    rank granted; refused): (count, sum), scraped from its `/metrics`."""
    texts = [await deployment.client.get_text(f"{c}/metrics") for c in deployment.engines[0].controls]
    return [histogram_totals(t, "pdkv_claim_relay_seconds", engine=ENGINE, outcome=outcome) for t in texts]


async def test_a_fetch_by_claims_makes_one_call_to_the_arbiter(deployment, monkeypatch):  # type: ignore[no-untyped-def]
    """The decode's only control message is its call to the lowest rank; the claims on the
    others are the arbiter's relays (still counted, one an owner; timed on the arbiter's
    `/metrics`), the read is proved by the pin words and released by notification."""
    n, room = 300, 9_000_000
    await prefill(deployment, deployment.engines[0], room, n)
    pool = DSAKVPool(tiny(size=8192))
    before = await _relays(deployment)
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        await fetcher.describe(ENGINE)  # looked up before: the lookup is not what is counted
        sent = _record(monkeypatch)
        t0 = time.perf_counter()
        result = await fetcher.fetch(ENGINE, room, fragmented_pages(pool, n, 1))
        took = time.perf_counter() - t0
    assert sent == [f"{deployment.engines[0].controls[0]}/v1/claims"]
    assert result.control_messages == 3 and kv_is_exact(pool, ENGINE, room, n, fragmented_pages(pool, n, 1))
    after = await _relays(deployment)
    assert after[0][0] == before[0][0] + 1  # the arbiter relayed this one claim, and timed it
    assert 0 < after[0][1] - before[0][1] < took  # inside the fetch's own time
    assert after[1:] == before[1:]  # the others relay nothing
    await _until_unpinned(deployment)


async def test_two_consumers_racing_for_a_room_one_wins_and_the_loser_gets_no_byte(deployment):  # type: ignore[no-untyped-def]
    """Two decodes fetch a single-consumer room by claims at once, as it is being prefilled:
    one reads it exact, the other is refused typed and its pool holds none of the room."""
    n = 300
    pools = [DSAKVPool(tiny(size=8192)) for _ in range(2)]
    async with (
        DecodeFetcher(pools[0], deployment.registry_url, ucx_workers=1) as a,
        DecodeFetcher(pools[1], deployment.registry_url, ucx_workers=1) as b,
    ):
        for i in range(6):
            room = 9_100_000 + i
            written = prefill(deployment, deployment.engines[0], room, n)
            await one_of_two_reads((a, b), pools, ENGINE, room, n, i, (RoomClaimedError, UnknownRoomError), written)
    await _until_unpinned(deployment)


async def test_a_call_of_another_schema_version_is_refused_typed(deployment):  # type: ignore[no-untyped-def]
    """A peer of another schema version gets a `MetadataError` naming the version, on the
    channel it opened (which stays open for its later calls); a rank asked to arbitrate for a
    lower one refuses, since every claimant must ask the same rank first."""
    controls = deployment.engines[0].controls
    fp = DSAKVPool(tiny(size=8192)).layout.fingerprint  # the engine's: a decode of its layout
    ask = ClaimRequest(room=9_200_000, consumer_id="old-decode", claim=secrets.token_hex(16))
    call = ClaimAll(ask=ask, others=[], budget_ms=2000)
    raw = msgspec.msgpack.decode(encode(call, fp))
    older = msgspec.msgpack.encode([raw[0] - 1, *raw[1:]])
    channel = _Channel(f"{controls[0]}/v1/claims", close_timeout=2.0)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(MetadataError, match="schema version"):
            await channel.call(older, lambda: session, Deadline.after(5))
        lower = ClaimAll(ask=ask, others=[OwnerRef(cp_rank=0, incarnation="abc")], budget_ms=2000)
        with pytest.raises(MetadataError, match="arbitrates only for distinct higher ranks"):
            await channel.call(encode(lower, fp), lambda: session, Deadline.after(5))
        await channel.aclose()
    client = ControlClient(Timeouts())
    try:  # the room was never published: UNKNOWN, nothing granted, nothing relayed
        reply = await client.call(f"{controls[0]}/v1/claims", call, ClaimAllReply, fingerprint=fp, timeout=5)
        assert reply.arbiter.status.value == "unknown" and reply.others == []
    finally:
        await client.aclose()


async def test_an_owner_that_never_answers_the_relay_fails_the_fetch_typed_in_time(deployment):  # type: ignore[no-untyped-def]
    """A non-arbiter rank stopped (its kernel takes connections, it answers nothing): the
    arbiter answers for it by the budget the decode gave, the decode's own try runs out with
    the fetch's deadline, and the fetch fails typed, its give-ups bounded by
    `Timeouts.request`, with no byte read. A give-up that could not reach the rank leaves the
    room pinned there (until its pin expires, as before); resumed, the rank takes the decode's
    `give_up_room`, and the room ends on every owner."""
    n, room, deadline, request = 300, 9_300_000, 1.5, 1.0
    await prefill(deployment, deployment.engines[0], room, n)
    stopped = next(c for c in deployment.launcher.children if c.name == f"{ENGINE}-cp2")
    pool = DSAKVPool(tiny(size=8192))
    pool.slab.fill_(UNTOUCHED)
    refused = await _relays(deployment, "refused")
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1, timeouts=Timeouts(request=request)) as f:
        await f.describe(ENGINE)
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises((DeadlineExceeded, PeerLostError)):
                await f.fetch(ENGINE, room, fragmented_pages(pool, n, 9), timeout=deadline)
            took = time.monotonic() - t0
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        await f.give_up_room(ENGINE, room, timeout=10)
    assert took < deadline + request + 1.0, took
    assert bool(torch.all(pool.slab == UNTOUCHED))
    assert (await _relays(deployment, "refused"))[0][0] == refused[0][0] + 1  # the arbiter's relay, unanswered
    await _until_unpinned(deployment)


async def test_a_call_on_a_kept_channel_that_died_unseen_is_made_again_on_a_new_one(deployment):  # type: ignore[no-untyped-def]
    """A kept channel can die without the decode seeing it (a link cut and back: the owner
    dropped it meanwhile): the call it loses is made once more on a new channel, not failed
    (a claim is idempotent). An owner's own refusal is not made again."""
    controls = deployment.engines[0].controls
    fp = DSAKVPool(tiny(size=8192)).layout.fingerprint
    ask = ClaimRequest(room=9_400_000, consumer_id="kept-decode", claim=secrets.token_hex(16))
    call = ClaimAll(ask=ask, others=[], budget_ms=100)
    url = f"{controls[0]}/v1/claims"
    client = ControlClient(Timeouts())
    try:
        assert (
            await client.call(url, call, ClaimAllReply, fingerprint=fp, timeout=5)
        ).arbiter.status.value == "unknown"
        kept = client._channels[url]
        assert kept._ws is not None
        kept._ws._response.connection.transport.abort()  # dead, and nothing read yet says so
        assert not kept.closed
        reply = await client.call(url, call, ClaimAllReply, fingerprint=fp, timeout=5)
        assert reply.arbiter.status.value == "unknown"
        assert kept.closed and client._channels[url] is not kept
        lower = ClaimAll(ask=ask, others=[OwnerRef(cp_rank=0, incarnation="abc")], budget_ms=100)
        fresh = client._channels[url]
        with pytest.raises(MetadataError, match="arbitrates only"):
            await client.call(url, lower, ClaimAllReply, fingerprint=fp, timeout=5)
        assert client._channels[url] is fresh and not fresh.closed  # a refusal keeps the channel
    finally:
        await client.aclose()


async def test_calls_that_lose_one_channel_together_make_their_calls_again_on_one_new_channel(  # type: ignore[no-untyped-def]
    deployment, monkeypatch
):
    """Calls waiting on a kept channel when it breaks (each for a room not published, which
    the owner waits for within the call's budget) are each made again, all on one new
    channel: none is left open beside it, where `aclose` would not close it."""
    import transfer.control as control

    opened: list[_Channel] = []

    class Counted(_Channel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            opened.append(self)

    monkeypatch.setattr(control, "_Channel", Counted)
    fp = DSAKVPool(tiny(size=8192)).layout.fingerprint
    url = f"{deployment.engines[0].controls[0]}/v1/claims"

    def waiting(i: int) -> ClaimAll:
        ask = ClaimRequest(room=9_500_000 + i, consumer_id="racing", claim=secrets.token_hex(16))
        return ClaimAll(ask=ask, others=[], budget_ms=400)

    client = ControlClient(Timeouts())
    try:
        await client.call(url, waiting(9), ClaimAllReply, fingerprint=fp, timeout=5)
        kept = client._channels[url]
        assert kept._ws is not None
        calls = [
            asyncio.ensure_future(client.call(url, waiting(i), ClaimAllReply, fingerprint=fp, timeout=5))
            for i in range(4)
        ]
        await asyncio.sleep(0.1)  # sent, and waited on by the owner
        assert len(kept._pending) == 4
        kept._ws._response.connection.transport.abort()  # the reader hears it: every call on it fails at once
        replies = await asyncio.gather(*calls)
        assert [r.arbiter.status.value for r in replies] == ["unknown"] * 4
        assert len(opened) == 2 and opened[0] is kept and client._channels[url] is opened[1]
        assert kept.closed and not opened[1].closed
    finally:
        await client.aclose()
