"""Claims held for the arbiter (issue 44): each rank above the arbiter holds one claim of a
whole room and tells the arbiter, which hands those to the room's first claimant, so that a
fetch by claims of a finished room is one round trip to one process, with no relay. Real
processes (a registry, an engine of CP=3), real sockets, real UCX reads."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

import msgspec
import pytest

from pdkv import ClaimLostError, DSAKVPool, RoomClaimedError, tiny
from pdkv.errors import MetadataError
from tests.rooms_helpers import fragmented_pages, kv_is_exact, module_deployment, one_of_two_reads, prefill
from tests.scrape import histogram_totals
from transfer.app.router import Deployment, DeploymentSpec
from transfer.control import ControlClient
from transfer.decode import DecodeFetcher
from transfer.metadata import (
    ClaimAll,
    ClaimAllReply,
    ClaimRequest,
    HeldClaim,
    HeldReply,
    OwnerPin,
    OwnerRef,
    ReleaseNotice,
    ReleaseReply,
    RoomState,
)
from transfer.prefill.held import pages_digest
from transfer.timeouts import Timeouts

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(
    engines=(3,), decoders=0, preset="tiny", prefill_pool_tokens=4096, decode_pool_tokens=8192, start_timeout=180
)
ENGINE = "prefill0"


deployment = module_deployment(SPEC)


async def _stats(deployment: Deployment) -> list[dict[str, int]]:
    return [await deployment.client.get_json(f"{c}/v1/stats") for c in deployment.engines[0].controls]


async def _relayed(deployment: Deployment) -> float:
    """The claims the arbiter relayed, as its `/metrics` counts them."""
    text = await deployment.client.get_text(f"{deployment.engines[0].controls[0]}/metrics")
    return histogram_totals(text, "pdkv_claim_relay_seconds", engine=ENGINE, outcome="ok")[0]


async def _until(deployment: Deployment, done, within: float = 15.0) -> list[dict[str, int]]:  # type: ignore[no-untyped-def]
    end = time.monotonic() + within
    while not done(stats := await _stats(deployment)):
        assert time.monotonic() < end, stats
        await asyncio.sleep(0.02)
    return stats


async def _whole(deployment: Deployment, room: int, n: int, consumers: int = 1) -> None:
    """Prefill `room`, then wait until the arbiter keeps both other ranks' held claims of it."""
    before = (await _stats(deployment))[0]["claims_held"]
    await prefill(deployment, deployment.engines[0], room, n, consumers)
    await _until(deployment, lambda s: s[0]["claims_held"] >= before + 2)


async def _unpinned(deployment: Deployment) -> None:
    await _until(deployment, lambda s: all(r["pinned_pages"] == 0 for r in s))


async def _handed_then_given_up(deployment: Deployment, room: int, consumer: str) -> str:
    """A claimant is handed `room`'s held claims (asserted), then gives its claim up on the
    arbiter unread, as a fetch whose answer was lost, or the arbiter for a claimant gone, does:
    its token."""
    controls = deployment.engines[0].controls
    fp = DSAKVPool(tiny(size=8192)).layout.fingerprint
    async with DecodeFetcher(DSAKVPool(tiny(size=8192)), deployment.registry_url, ucx_workers=1) as fetcher:
        ranks = await fetcher.describe(ENGINE)
    client = ControlClient(Timeouts())
    token = secrets.token_hex(16)
    try:
        ask = ClaimRequest(room=room, consumer_id=consumer, claim=token)
        others = [OwnerRef(cp_rank=r, incarnation=ranks[r].incarnation) for r in (1, 2)]
        call = ClaimAll(ask=ask, others=others, budget_ms=5000)
        reply = await client.call(f"{controls[0]}/v1/claims", call, ClaimAllReply, fingerprint=fp, timeout=10)
        assert all(o.claim is not None for o in reply.others)  # handed out
        notice = ReleaseNotice(room=room, consumer_id=consumer, claim=token, give_up=True)
        await client.request("POST", f"{controls[0]}/v1/rooms/{room}/release", ReleaseReply, notice, fingerprint=fp)
        return token
    finally:
        await client.aclose()


async def test_the_first_claimant_of_a_whole_room_reads_it_with_no_relay(deployment):  # type: ignore[no-untyped-def]
    """Its one control message is the call to the arbiter, which relays nothing: it answers
    with the claims the other ranks hold; the read is exact, proved by the pin words, and
    the notifications under the held tokens release the room on every rank."""
    n, room = 300, 9_500_000
    await _whole(deployment, room, n)
    relayed, handed = await _relayed(deployment), (await _stats(deployment))[0]["claims_handed_out"]
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        result = await fetcher.fetch(ENGINE, room, fragmented_pages(pool, n, 1))
    assert result.control_messages == 1 and kv_is_exact(pool, ENGINE, room, n, fragmented_pages(pool, n, 1))
    assert await _relayed(deployment) == relayed
    assert (await _stats(deployment))[0]["claims_handed_out"] == handed + 1
    stats = await _until(deployment, lambda s: all(r["pinned_pages"] == 0 for r in s))
    assert all(r["aborted"] == 0 and r["expired"] == 0 for r in stats)  # released, by the held tokens too


async def test_two_consumers_racing_for_a_whole_room_one_reads_it_and_the_loser_gets_no_byte(deployment):  # type: ignore[no-untyped-def]
    n = 300
    pools = [DSAKVPool(tiny(size=8192)) for _ in range(2)]
    async with (
        DecodeFetcher(pools[0], deployment.registry_url, ucx_workers=1) as a,
        DecodeFetcher(pools[1], deployment.registry_url, ucx_workers=1) as b,
    ):
        for i in range(4):
            room = 9_510_000 + i
            await _whole(deployment, room, n)
            await one_of_two_reads((a, b), pools, ENGINE, room, n, i, (RoomClaimedError,))
    await _unpinned(deployment)


async def test_a_second_reader_is_relayed_beside_the_claims_handed_to_the_first(deployment):  # type: ignore[no-untyped-def]
    """A room published for two consumers: the first gets the held claims, the second is
    relayed, and the ranks grant it beside them (the held claim is the first reader's, not taken over); both
    read it exact, and the room ends once both released."""
    n, room = 300, 9_520_000
    await _whole(deployment, room, n, consumers=2)
    relayed = await _relayed(deployment)
    pools = [DSAKVPool(tiny(size=8192)) for _ in range(2)]
    async with (
        DecodeFetcher(pools[0], deployment.registry_url, ucx_workers=1) as a,
        DecodeFetcher(pools[1], deployment.registry_url, ucx_workers=1) as b,
    ):
        first = await a.fetch(ENGINE, room, fragmented_pages(pools[0], n, 5))
        second = await b.fetch(ENGINE, room, fragmented_pages(pools[1], n, 6))
    assert first.control_messages == 1 and second.control_messages == 3  # one call; one call and two relays
    assert await _relayed(deployment) == relayed + 1
    assert kv_is_exact(pools[0], ENGINE, room, n, fragmented_pages(pools[0], n, 5))
    assert kv_is_exact(pools[1], ENGINE, room, n, fragmented_pages(pools[1], n, 6))
    await _unpinned(deployment)


async def test_a_room_claimed_while_it_is_written_is_read_once_however_its_claims_meet_the_held_ones(deployment):  # type: ignore[no-untyped-def]
    """A claim asked as the room is written: on the arbiter it finds the room unpublished,
    unfinished (relayed; a rank where the room is not published yet is claimed by the decode,
    and that claim takes the place of any the rank held meanwhile) or whole with the claims
    held (handed out), by the timing. Either way exactly one of the two, the read is exact and
    the room ends released on every rank, nothing aborted."""
    n, room = 600, 9_530_000
    before = await _stats(deployment)
    relayed = await _relayed(deployment)
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        fetch = asyncio.create_task(fetcher.fetch(ENGINE, room, fragmented_pages(pool, n, 7), timeout=30))
        await asyncio.sleep(0.05)  # the decode's claim is the room's first, in any order with the prefill
        await prefill(deployment, deployment.engines[0], room, n)
        await fetch
    assert kv_is_exact(pool, ENGINE, room, n, fragmented_pages(pool, n, 7))
    after = await _unpinned_stats(deployment)
    handed = after[0]["claims_handed_out"] - before[0]["claims_handed_out"]
    assert sorted([await _relayed(deployment) - relayed, handed]) == [0, 1]
    assert [r["released"] - b["released"] for r, b in zip(after, before)] == [1, 1, 1]
    assert [r["aborted"] - b["aborted"] for r, b in zip(after, before)] == [0, 0, 0]


async def _unpinned_stats(deployment: Deployment) -> list[dict[str, int]]:
    return await _until(deployment, lambda s: all(r["pinned_pages"] == 0 for r in s))


async def test_a_ticket_takes_the_place_of_the_claims_held_for_the_arbiter(deployment):  # type: ignore[no-untyped-def]
    """The router's path: the prefill's reply carries the ticket, each rank's part of it taking
    the place of the claim it held; the ticket's fetch reads it exact and ends it everywhere."""
    n, room = 300, 9_540_000
    reply = await prefill(deployment, deployment.engines[0], room, n, ticket=True)
    assert reply.ticket is not None
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        result = await fetcher.fetch(ENGINE, room, fragmented_pages(pool, n, 8), ticket=reply.ticket)
    assert result.control_messages == 0 and kv_is_exact(pool, ENGINE, room, n, fragmented_pages(pool, n, 8))
    stats = await _unpinned_stats(deployment)
    assert all(r["tickets_out"] == 0 and r["aborted"] == 0 and r["expired"] == 0 for r in stats)


async def test_a_held_claim_is_kept_only_from_a_higher_rank_and_a_forged_one_proves_nothing(deployment):  # type: ignore[no-untyped-def]
    """A rank keeps held claims for higher ranks only (refused typed otherwise). One sent in a
    rank's name with another nonce than its pin word holds is handed out like any other, and
    the fetch that got it fails typed at the proof, never reporting the room read."""
    n, room = 300, 9_550_000
    controls = deployment.engines[0].controls
    pool = DSAKVPool(tiny(size=8192))
    fp = pool.layout.fingerprint
    await _whole(deployment, room, n)
    client = ControlClient(Timeouts())
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        incarnation = (await fetcher.describe(ENGINE))[2].incarnation
        try:
            state = await client.request("GET", f"{controls[2]}/v1/rooms/{room}", RoomState)  # rank 2's room
            pin = OwnerPin(cp_rank=2, incarnation=incarnation, slot=0, nonce=12345)
            forged = HeldClaim(
                cp_rank=2,
                incarnation=incarnation,
                claim=secrets.token_hex(16),
                state=msgspec.structs.replace(state, pin=pin, src_pages=[]),
                pages=pages_digest(state.src_pages),
            )
            lower = msgspec.structs.replace(forged, cp_rank=0)
            with pytest.raises(MetadataError, match="higher ranks only"):
                await client.call(f"{controls[0]}/v1/claims", lower, HeldReply, fingerprint=fp, timeout=5)
            kept = await client.call(f"{controls[0]}/v1/claims", forged, HeldReply, fingerprint=fp, timeout=5)
            assert kept.kept
        finally:
            await client.aclose()
        with pytest.raises(ClaimLostError):
            await fetcher.fetch(ENGINE, room, fragmented_pages(pool, n, 9), timeout=10)
        await fetcher.give_up_room(ENGINE, room, timeout=10)
    await _unpinned(deployment)


async def test_a_give_up_of_a_claim_never_seen_takes_nothing_from_the_reader_handed_the_held_claims(deployment):  # type: ignore[no-untyped-def]
    """A room for two: A gets the held claims, B is relayed, gives up, then gives the room up
    on every rank (as an aborted SGLang request does, with a claim no rank saw). A's claims
    stand: it reads the room exact and releases it."""
    n, room = 300, 9_560_000
    await _whole(deployment, room, n, consumers=2)
    pools = [DSAKVPool(tiny(size=8192)) for _ in range(2)]
    async with (
        DecodeFetcher(pools[0], deployment.registry_url, ucx_workers=1) as a,
        DecodeFetcher(pools[1], deployment.registry_url, ucx_workers=1) as b,
    ):
        handed = (await _stats(deployment))[0]["claims_handed_out"]
        lease = await a.claim(ENGINE, room, timeout=20)
        assert (await _stats(deployment))[0]["claims_handed_out"] == handed + 1
        other = await b.claim(ENGINE, room, timeout=20)
        await other.give_up()
        await b.give_up_room(ENGINE, room, timeout=10)
        pages = fragmented_pages(pools[0], n, 10)
        await lease.read(pages)
        assert await lease.release() and kv_is_exact(pools[0], ENGINE, room, n, pages)
    await _unpinned(deployment)


async def test_a_group_of_readers_is_relayed_so_that_every_rank_counts_it(deployment):  # type: ignore[no-untyped-def]
    """Two readers of a room published for one (a decode's attention-TP ranks): the first
    claim names the group, which must reach every rank, so it is relayed, held claims or not;
    both read it exact, and it ends once both released."""
    n, room = 300, 9_570_000
    await _whole(deployment, room, n)
    pools = [DSAKVPool(tiny(size=8192)) for _ in range(2)]
    async with (
        DecodeFetcher(pools[0], deployment.registry_url, ucx_workers=1) as a,
        DecodeFetcher(pools[1], deployment.registry_url, ucx_workers=1) as b,
    ):
        first = await a.fetch(ENGINE, room, fragmented_pages(pools[0], n, 11), readers=2, timeout=20)
        second = await b.fetch(ENGINE, room, fragmented_pages(pools[1], n, 12), readers=2, timeout=20)
    assert first.control_messages == 3 and second.control_messages == 3
    assert kv_is_exact(pools[0], ENGINE, room, n, fragmented_pages(pools[0], n, 11))
    assert kv_is_exact(pools[1], ENGINE, room, n, fragmented_pages(pools[1], n, 12))
    await _unpinned(deployment)


async def test_a_room_given_up_before_any_claim_ends_on_every_rank_at_once(deployment):  # type: ignore[no-untyped-def]
    """Its decode gives a finished room up unread (an aborted request): the arbiter returns the
    claims the others held for it as its own room ends, and every rank ends it aborted now,
    not at its pin's expiry."""
    n, room = 300, 9_580_000
    await _whole(deployment, room, n)
    before = await _stats(deployment)
    async with DecodeFetcher(DSAKVPool(tiny(size=8192)), deployment.registry_url, ucx_workers=1) as fetcher:
        await fetcher.give_up_room(ENGINE, room, timeout=10)
    after = await _until(deployment, lambda s: all(r["pinned_pages"] == 0 for r in s), within=10)
    assert [r["aborted"] - b["aborted"] for r, b in zip(after, before)] == [1, 1, 1]
    assert all(r["expired"] == b["expired"] for r, b in zip(after, before))


async def test_a_claimant_whose_answer_was_lost_gives_the_room_up_on_every_rank(deployment):  # type: ignore[no-untyped-def]
    """The arbiter handed the held claims out, but its answer never reached the claimant,
    which gives its own token up everywhere (as a fetch whose call failed does): that frees
    nothing on the other ranks (it never learnt their tokens), but the arbiter, its room
    ended unread, gives the handed claims back, and every rank ends the room now, not at its
    pin's expiry."""
    n, room = 300, 9_590_000
    await _whole(deployment, room, n)
    before = await _stats(deployment)
    token = await _handed_then_given_up(deployment, room, "lost-answer")
    notice = ReleaseNotice(room=room, consumer_id="lost-answer", claim=token, give_up=True)
    fp = DSAKVPool(tiny(size=8192)).layout.fingerprint
    client = ControlClient(Timeouts())
    try:  # the token it knows holds nothing there: refused, or the room ended already
        for control in deployment.engines[0].controls[1:]:
            with contextlib.suppress(ClaimLostError):
                await client.request("POST", f"{control}/v1/rooms/{room}/release", ReleaseReply, notice, fingerprint=fp)
    finally:
        await client.aclose()
    after = await _until(deployment, lambda s: all(r["pinned_pages"] == 0 for r in s), within=10)
    assert [r["aborted"] - b["aborted"] for r, b in zip(after, before)] == [1, 1, 1]


async def test_the_claims_handed_to_a_claimant_that_gave_up_go_back_while_another_reads_on(deployment):  # type: ignore[no-untyped-def]
    """A room for two: the first claimant is handed the held claims and gives its claim up on
    the arbiter unread (as the arbiter does for a claimant whose stream is lost); the arbiter
    gives those claims back at once, the second reader is relayed and reads it exact, and
    the room ends released on every rank, not at its pin's expiry."""
    n, room = 300, 9_600_000
    await _whole(deployment, room, n, consumers=2)
    await _handed_then_given_up(deployment, room, "gone")
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        pages = fragmented_pages(pool, n, 13)
        await fetcher.fetch(ENGINE, room, pages, timeout=20)
    assert kv_is_exact(pool, ENGINE, room, n, pages)
    await _until(deployment, lambda s: all(r["pinned_pages"] == 0 for r in s), within=10)
