"""Real processes over loopback UCX: a registry, prefill engines of CP 1-4, two decoders.

Every fetched byte of every layer is checked by the decode worker against the function
the prefill wrote it from; a mismatch fails the request, and these tests assert success.
"""

import asyncio

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch

from pdkv import (
    ClaimLostError,
    ClosedError,
    DSAKVPool,
    IncompatibleLayoutError,
    InvalidPagesError,
    MetadataError,
    NotReadyError,
    PageRangeError,
    RoomClaimedError,
    UnknownRoomError,
    tiny,
)
from tests import children
from tests.http_probe import rss_bytes, send_big
from tests.rooms_helpers import fetch_in_own_process, fragmented_pages, kv_is_exact, prefill
from tests.wire_helpers import rank_descriptor
from transfer.app.api import DecodeReply, DecodeRequest, PrefillReply, PrefillRequest
from transfer.app.router import Deployment, DeploymentSpec
from transfer.app.synthetic import RequestContent, fragmented_page_order, request_seed
from transfer.decode import DecodeFetcher, FetchResult
from transfer.metadata import RoomStatus
from transfer.timeouts import Timeouts

pytestmark = pytest.mark.asyncio(loop_scope="module")

LAYERS = 7  # divides evenly by none of 2, 3, 4
SPEC = DeploymentSpec(
    engines=(1, 2, 3, 4),
    decoders=2,
    preset="tiny",
    prefill_pool_tokens=4096,
    decode_pool_tokens=8192,
    layer_delay=0.005,
    start_timeout=180,
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def deployment():
    async with Deployment(SPEC) as d:
        yield d
    codes = d.launcher.children
    assert all(c.popen.returncode == 0 for c in codes), {c.name: c.popen.returncode for c in codes}


async def _until_unpinned(deployment, engine, within: float = 10.0) -> list[dict]:
    """Each of `engine`'s ranks' stats once none pins a page (a release by notification lands
    a moment after the fetch returned); fails after `within` seconds."""
    end = asyncio.get_running_loop().time() + within
    while True:
        stats = [await deployment.client.get_json(f"{c}/v1/stats") for c in engine.controls]
        if all(s["pinned_pages"] == 0 for s in stats):
            return stats
        assert asyncio.get_running_loop().time() < end, stats
        await asyncio.sleep(0.05)


def _ok(outcomes):
    bad = [o for o in outcomes if not o.ok]
    assert not bad, bad[:3]
    for o in outcomes:
        layout = tiny()
        assert o.decode.verified_bytes == o.num_tokens * LAYERS * (layout.kv_token_bytes + layout.index_token_bytes)


@pytest.mark.parametrize("engine", ["prefill0", "prefill1", "prefill2", "prefill3"])
async def test_each_cp_size_assembles_every_layer_byte_exact(deployment, engine):
    outcomes = [await deployment.submit(n, engine_id=engine) for n in (1, 4, 37, 129, 300)]
    _ok(outcomes)


async def test_32_rooms_concurrently_into_one_decode(deployment):
    _ok(await asyncio.gather(*(deployment.submit(10 + 5 * i, engine_id="prefill3", decoder=0) for i in range(32))))


async def test_two_decoders_fetch_from_one_engine(deployment):
    _ok(await asyncio.gather(*(deployment.submit(50 + i, engine_id="prefill2", decoder=i % 2) for i in range(12))))


async def test_release_frees_pages_everywhere_and_reuse_is_clean(deployment):
    # 60 rooms of 50 pages through a pool of 1023 pages: every page is reused many times.
    _ok([await deployment.submit(200, engine_id="prefill2") for _ in range(60)])
    stats = await _settled(deployment)
    assert all(s["pinned_pages"] == 0 and s["live_rooms"] == 0 for s in stats["prefill"])
    assert all(s["pages_in_use"] == 0 for s in stats["decode"])
    assert sum(s["published"] for s in stats["prefill"]) == sum(s["released"] for s in stats["prefill"])


async def _settled(deployment, within: float = 5.0):  # type: ignore[no-untyped-def]
    """Stats once no room is pinned: a ticket's release travels after its fetch returned."""
    for _ in range(int(within / 0.05)):
        stats = await deployment.stats()
        if all(s["pinned_pages"] == 0 for s in stats["prefill"]):
            break
        await asyncio.sleep(0.05)
    return stats


async def test_second_fetch_of_a_released_room_fails_clearly(deployment):
    done = await deployment.submit(20, engine_id="prefill1")
    assert done.ok
    again = DecodeRequest(engine_id="prefill1", room=done.room, num_tokens=20)
    # Its ticket held the one claim: refused while its release is on the way, unknown after.
    with pytest.raises((UnknownRoomError, RoomClaimedError), match="released|taken"):
        await deployment.client.request("POST", f"{deployment.decoders[0].url}/v1/decode", DecodeReply, again)


async def test_one_owner_read_is_split_over_workers_byte_exact(deployment):
    """More UCX workers than owners: each owner's READ is cut into pieces posted at once."""
    engine, room, n = deployment.engines[0], 4242, 1000  # CP=1: one owner, four workers
    await deployment.client.request(
        "POST", f"{engine.intake}/v1/prefill", PrefillReply, PrefillRequest(room=room, num_tokens=n, ticket=False)
    )
    pool = DSAKVPool(tiny(size=8192))
    pages = fragmented_page_order(np.arange(pool.layout.num_pages), np.random.default_rng(3))[
        : -(-n // pool.layout.page_size)
    ]
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=4) as fetcher:
        reads = []
        inner = fetcher.transport.read

        async def spy(*args, **kwargs):
            reads.append(await inner(*args, **kwargs))
            return reads[-1]

        fetcher.transport.read = spy
        result = await fetcher.fetch("prefill0", room, pages)
    assert max(x.pieces for x in reads) == 4 and result.nbytes == sum(x.nbytes for x in reads)
    content = RequestContent(request_seed("prefill0", room), n)
    assert content.mismatched_layers(pool, torch.from_numpy(pages)) == []


async def test_fetch_starts_before_the_last_layer_is_ready(deployment):
    # What the router does with DeploymentSpec(overlap=True): both legs at once, no ticket.
    room = 5_100_000
    ask = DecodeRequest(engine_id="prefill0", room=room, num_tokens=64)
    decode = asyncio.ensure_future(
        deployment.client.request("POST", f"{deployment.decoders[0].url}/v1/decode", DecodeReply, ask)
    )
    # The decode waits for the room before its first layer is written: on a loaded host, a
    # decode that started late found every layer written and read them in one batch.
    await asyncio.sleep(0.3)
    assert not decode.done()
    await prefill(deployment, deployment.engines[0], room, 64)
    out = await decode
    assert out.reads > 1  # one owner, 7 layers: several READ batches as layers came


async def test_decode_with_another_layout_is_refused(deployment):
    other = DSAKVPool(tiny(layer_num=LAYERS + 1, size=64))
    async with DecodeFetcher(other, deployment.registry_url, ucx_workers=1) as fetcher:
        with pytest.raises(IncompatibleLayoutError, match="layer_num") as info:
            await fetcher.fetch("prefill1", 12345, np.arange(1, 3), timeout=10)
    assert "layer_num" in info.value.differing


async def test_engine_missing_an_owner_is_refused(deployment):
    for rank in (0, 1):  # rank 2 of 3 never registers
        await deployment.client.request(
            "PUT", f"{deployment.registry_url}/v1/engines/e0/ranks/{rank}", body=rank_descriptor(rank)
        )
    pool = DSAKVPool(tiny(layer_num=LAYERS, size=64))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1, timeouts=Timeouts(lookup=0.5)) as fetcher:
        with pytest.raises(NotReadyError, match=r"ranks \[2\] of 3"):
            await fetcher.fetch("e0", 1, np.arange(1, 3), timeout=5)


# ---- claims: a fetch returns exactly its room's bytes or raises (issue 10) -----------------------


async def test_two_decode_workers_given_one_room_never_both_succeed(deployment):
    """Two decode processes fetch a single-consumer room at once: one gets its bytes, the other a typed refusal."""
    engine, n = deployment.engines[2], 300
    for i in range(6):
        room = 7_000_000 + i
        legs = [DecodeRequest(engine_id="prefill2", room=room, num_tokens=n) for _ in range(2)]
        calls = [
            deployment.client.request("POST", f"{d.url}/v1/decode", DecodeReply, leg)
            for d, leg in zip(deployment.decoders, legs)
        ]
        outcomes = await asyncio.gather(prefill(deployment, engine, room, n), *calls, return_exceptions=True)
        assert isinstance(outcomes[0], PrefillReply)
        ok = [o for o in outcomes[1:] if isinstance(o, DecodeReply)]
        refused = [o for o in outcomes[1:] if not isinstance(o, DecodeReply)]
        assert len(ok) == 1, outcomes  # the winner's decode worker checked every byte
        assert isinstance(refused[0], (RoomClaimedError, UnknownRoomError)), refused


async def test_a_retry_under_a_new_claim_is_refused_and_the_first_stays_exact(deployment):
    """One fetcher fetches a room twice at once (a retry racing the first try)."""
    engine, n, room = deployment.engines[1], 500, 7_100_000
    await prefill(deployment, engine, room, n)
    pool = DSAKVPool(tiny(size=8192))
    a, b = fragmented_pages(pool, n, 1), fragmented_pages(pool, n, 2)[::-1].copy()
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
        first, second = await asyncio.gather(
            fetcher.fetch("prefill1", room, a), fetcher.fetch("prefill1", room, b), return_exceptions=True
        )
        assert [isinstance(x, FetchResult) for x in (first, second)].count(True) == 1, (first, second)
        won, lost, pages = (first, second, a) if isinstance(first, FetchResult) else (second, first, b)
        assert isinstance(lost, RoomClaimedError) and won.nbytes > 0  # proved by the pin words
        assert kv_is_exact(pool, "prefill1", room, n, pages)
        with pytest.raises((RoomClaimedError, UnknownRoomError)):
            await fetcher.fetch("prefill1", room, a)  # and afterwards: released, refused


async def test_a_claim_outlived_by_its_room_is_detected_after_reuse(deployment):
    """The reported hole: a reader holds the room's source pages, the room is freed and its
    pages reused for another room, then the reader reads. It must never pass as success."""
    engine, n = deployment.engines[0], 2000  # CP=1, 125 of its 255 pages: the next room reuses some
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
        await prefill(deployment, engine, 7_200_000, n)
        lease = await fetcher.claim("prefill0", 7_200_000)
        await lease.read(fragmented_pages(pool, n, 3))  # read once: these bytes are the room's
        await deployment.client.request("POST", f"{engine.controls[0]}/v1/rooms/7200000/abort")
        await prefill(deployment, engine, 7_200_001, n)  # another room in the freed pages
        with pytest.raises(ClaimLostError, match="aborted"):
            await lease.read(fragmented_pages(pool, n, 4))  # a late read under the dead claim
        with pytest.raises(ClaimLostError):
            await lease.release()  # nor may what was read before count as the room's
        assert await fetcher.fetch("prefill0", 7_200_001, fragmented_pages(pool, n, 5)) is not None
        await _until_unpinned(deployment, engine)  # that fetch released by notification, after it returned


async def test_a_lease_rereads_its_room_then_learns_its_release_freed_it(deployment):
    engine, n, room = deployment.engines[3], 700, 7_300_000
    await prefill(deployment, engine, room, n, consumers=2)
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
        first = await fetcher.fetch("prefill3", room, fragmented_pages(pool, n, 6))
        assert not first.freed  # one of two consumers: the room stays pinned for the other
        async with await fetcher.claim("prefill3", room) as lease:
            pool.kv_slab.zero_()
            await lease.read(fragmented_pages(pool, n, 7))
            pool.kv_slab.zero_()  # say the decode's own check failed: read again, same claim
            again = await lease.read(fragmented_pages(pool, n, 7))
            assert again.nbytes == first.nbytes and kv_is_exact(pool, "prefill3", room, n, fragmented_pages(pool, n, 7))
        assert lease._released is True  # the last claim: the room is free on every owner
        with pytest.raises(UnknownRoomError, match="released"):
            await fetcher.fetch("prefill3", room, fragmented_pages(pool, n, 8))


async def test_each_owner_is_freed_by_exactly_one_of_a_rooms_consumers(deployment):
    """Three decodes in processes of their own read one room of three consumers at once:
    each is exact, each proves its read by the pin words and releases by notification (so
    none knows whether its release was the last there: `freed_on` is empty), and every CP
    rank frees the room once, after the three."""
    engine, n, room = deployment.engines[3], 900, 7_350_000
    await prefill(deployment, engine, room, n, consumers=3)
    before = [await deployment.client.get_json(f"{c}/v1/stats") for c in engine.controls]
    ctx = children.context()
    out = ctx.Queue()
    decodes = [
        ctx.Process(target=fetch_in_own_process, args=(deployment.registry_url, "prefill3", room, n, 20 + i, out))
        for i in range(3)
    ]
    for p in decodes:
        p.start()
    try:
        results = [await asyncio.to_thread(out.get, True, 120) for _ in decodes]
    finally:
        for p in decodes:
            p.join(30)
    assert all(exact for _, _, exact in results)
    assert all(not freed and ranks == () for freed, ranks, _ in results)
    stats = await _until_unpinned(deployment, engine)
    assert [s["released"] - b["released"] for s, b in zip(stats, before)] == [1] * len(stats)  # freed once a rank


async def test_a_room_claimed_ahead_reads_like_a_ticket_and_is_released_by_notification(deployment):
    """A claim taken before the destination pages are known (SGLang's receiver at its
    bootstrap) carries each owner's pin: a room found whole is then read with no control
    request, proved by its pin words, and released by notifications; byte-exact."""
    engine, n, room = deployment.engines[2], 1200, 7_360_000
    await prefill(deployment, engine, room, n)
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
        lease = await fetcher.claim("prefill2", room)
        pages = fragmented_pages(pool, n, 30)
        result = await lease.read_once(pages)
        assert result.control_messages == 0 and kv_is_exact(pool, "prefill2", room, n, pages)
        assert all(r != room for _, r in fetcher._ctx.feed._wanted)  # its pushed states are not kept on
        for _ in range(100):  # the notifications land after the return
            stats = [await deployment.client.get_json(f"{c}/v1/stats") for c in engine.controls]
            if all(s["pinned_pages"] == 0 and s["released"] >= 1 for s in stats):
                break
            await asyncio.sleep(0.05)
        assert all(s["pinned_pages"] == 0 for s in stats), stats
        with pytest.raises(UnknownRoomError, match="released"):
            await fetcher.fetch("prefill2", room, pages)


async def test_a_claim_prepares_its_whole_room_read_and_an_abort_pushed_since_voids_it(deployment):
    """A lease on a room found whole lays its read out as the claim is granted (reused by
    each read while the owners' states stand); an abort pushed since makes the read fail
    rather than go ahead as prepared."""
    engine, n, room = deployment.engines[2], 900, 7_360_100
    await prefill(deployment, engine, room, n)
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
        lease = await fetcher.claim("prefill2", room)
        prepared = lease._prepared_read()
        assert prepared is not None and prepared is lease._prepared_read()
        url = engine.controls[1]
        await deployment.client.request("POST", f"{url}/v1/rooms/{room}/abort")
        for _ in range(100):  # the abort is pushed on the owner's readiness stream
            state = fetcher._ctx.feed.latest(url, room)
            if state is not None and state.status is RoomStatus.ABORTED:
                break
            await asyncio.sleep(0.05)
        assert lease._prepared_read() is None
        with pytest.raises(ClaimLostError):
            await lease.read_once(fragmented_pages(pool, n, 9))
    for _ in range(100):
        if all(s["pinned_pages"] == 0 for s in await _stats_of(deployment, engine)):
            break
        await asyncio.sleep(0.05)
    assert all(s["pinned_pages"] == 0 for s in await _stats_of(deployment, engine))


async def test_bad_destination_pages_are_refused_before_anything_is_asked(deployment):
    engine, room = deployment.engines[1], 7_400_000
    n = 3 * tiny().page_size
    await prefill(deployment, engine, room, n)
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        for bad, err in [
            ([10, 11, 10], InvalidPagesError),
            ([1.7, 2, 3], InvalidPagesError),
            (np.array([[1, 2, 3]]), InvalidPagesError),
            (torch.tensor([1.0, 2.0, 3.0]), InvalidPagesError),
            ([True, 2, 3], InvalidPagesError),
            ([1, 2, pool.layout.num_pages], PageRangeError),
            ("123", InvalidPagesError),
        ]:
            with pytest.raises(err):
                await fetcher.fetch("prefill1", room, bad)
        # Refused before a claim was asked: the room is still there for a good fetch.
        await fetcher.fetch("prefill1", room, torch.tensor([5, 9, 4], dtype=torch.int32))
        assert kv_is_exact(pool, "prefill1", room, n, [5, 9, 4])


async def test_fetcher_misuse_is_typed(deployment):
    pool = DSAKVPool(tiny(size=8192))
    fetcher = DecodeFetcher(pool, deployment.registry_url, ucx_workers=1)
    with pytest.raises(ClosedError, match="not started"):
        await fetcher.fetch("prefill0", 1, [1])
    room = 7_500_000  # never prefilled
    async with fetcher:
        slow = asyncio.create_task(fetcher.fetch("prefill0", room, fragmented_pages(pool, 64, 9), timeout=30))
        await asyncio.sleep(0.3)  # waiting for a room nobody has prefilled yet
    with pytest.raises(ClosedError, match="closed"):
        await slow
    with pytest.raises(ClosedError, match="closed"):
        await fetcher.fetch("prefill0", room, [1])


# ---- every service: typed paths, refused bodies, flat memory (issue 10) -----------------------
def _services(deployment):
    """(name, pid, url, method, a path that reads a body) for one process of each kind."""
    child = {c.name: c for c in deployment.launcher.children}
    engine = deployment.engines[1]
    return [
        ("registry", child["registry"].pid, deployment.registry_url, "PUT", "/v1/engines/e9/ranks/0"),
        ("exporter", child["prefill1-cp0"].pid, engine.controls[0], "POST", "/v1/rooms/5/release"),
        ("intake", child["prefill1-cp0"].pid, engine.intake, "POST", "/v1/prefill"),
        ("decode", child["decode0"].pid, deployment.decoders[0].url, "POST", "/v1/decode"),
    ]


async def test_non_integer_rooms_answer_400_on_every_service(deployment):
    engine = deployment.engines[1]
    urls = [deployment.decoders[0].url, engine.intake, engine.controls[0]]
    for url in urls:
        for bad in ("abc", "1e3", "..%2Fx", "-4", "1" * 30):
            with pytest.raises(MetadataError, match="room"):
                await deployment.client.request("POST", f"{url}/v1/rooms/{bad}/abort")
    with pytest.raises(MetadataError, match="rank"):
        await deployment.client.request("DELETE", f"{deployment.registry_url}/v1/engines/e9/ranks/{'9' * 30}")


async def test_oversized_bodies_leave_every_service_flat(deployment):
    for name, pid, url, method, path in _services(deployment):
        before = rss_bytes(pid)
        for _ in range(10):
            assert await send_big(url, path, 200 << 20, method=method) == 413, name
        for _ in range(3):
            assert await send_big(url, path, 200 << 20, chunked=True, method=method) == 413, name
        grown = rss_bytes(pid) - before
        assert grown < 64 << 20, f"{name} grew by {grown / 2**20:.0f} MiB"


async def test_a_complete_room_read_by_claims_costs_one_claim_per_owner(deployment):
    """The control messages of a fetch without a ticket (a ticket's fetch makes none): a claim
    per owner, whose answer names the owner's pin, or only the call to the arbiter where it
    handed out the claims the others held (test_protocol_held); the read is proved by the pin
    words and released by notifications, which free the room on every owner (issue 44)."""
    engine, n, room = deployment.engines[2], 300, 7_600_000  # CP=3
    await prefill(deployment, engine, room, n)
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        result = await fetcher.fetch("prefill2", room, fragmented_pages(pool, n, 12))
    assert result.control_messages in (1, 3) and kv_is_exact(pool, "prefill2", room, n, fragmented_pages(pool, n, 12))
    assert not result.freed and result.freed_on == ()  # released by notification: not known at return
    await _until_unpinned(deployment, engine)


# ---- tickets: a finished room read with no control request (issue 13) -----------------------------


async def _stats_of(deployment, engine):  # type: ignore[no-untyped-def]
    return [await deployment.client.get_json(f"{c}/v1/stats") for c in engine.controls]


async def test_a_ticket_fetch_asks_nobody_and_its_release_rides_on_the_pin_read(deployment):
    for index, n in ((0, 900), (2, 300), (3, 1500)):  # CP=1, 3, 4
        engine, room = deployment.engines[index], 7_700_000 + index
        reply = await prefill(deployment, engine, room, n, ticket=True)
        assert reply.ticket is not None and len(reply.ticket.pins) == len(engine.controls)
        pool = DSAKVPool(tiny(size=8192))
        pages = fragmented_pages(pool, n, 13)
        async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
            result = await fetcher.fetch(engine.engine_id, room, pages, ticket=reply.ticket)
        assert result.control_messages == 0 and all(o.reads == 1 for o in result.owners)
        assert kv_is_exact(pool, engine.engine_id, room, n, pages)
        for _ in range(100):  # the release is a notification: it lands shortly after
            if all(s["pinned_pages"] == 0 for s in await _stats_of(deployment, engine)):
                break
            await asyncio.sleep(0.05)
        assert all(s["pinned_pages"] == 0 and s["released"] >= 1 for s in await _stats_of(deployment, engine))


async def test_a_release_waiting_out_its_delay_still_goes_when_the_fetcher_closes(deployment):
    """A synchronous caller's releases wait a moment after the fetch (`release_delay`); a
    fetcher closed meanwhile sends them as it closes, rather than leave the room pinned
    on its owners until the pin expires."""
    engine, room, n = deployment.engines[2], 7_750_000, 700
    reply = await prefill(deployment, engine, room, n, ticket=True)
    pool = DSAKVPool(tiny(size=8192))
    pages = fragmented_pages(pool, n, 7)
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2, release_delay=600) as fetcher:
        await fetcher.fetch(engine.engine_id, room, pages, ticket=reply.ticket)
        await asyncio.sleep(0.3)
        assert all(s["pinned_pages"] > 0 for s in await _stats_of(deployment, engine))  # still waiting
    assert kv_is_exact(pool, engine.engine_id, room, n, pages)
    for _ in range(100):
        if all(s["pinned_pages"] == 0 for s in await _stats_of(deployment, engine)):
            break
        await asyncio.sleep(0.05)
    assert all(s["pinned_pages"] == 0 and s["released"] >= 1 for s in await _stats_of(deployment, engine))


async def test_a_ticket_whose_pages_were_reused_never_passes(deployment):
    """The ticket's room is aborted and its pages handed to another room; a fetch with the
    old ticket reads whatever the pages now hold, and the pin word says it is not the room."""
    engine, n = deployment.engines[0], 2000  # CP=1: the next room reuses most pages
    old = await prefill(deployment, engine, 7_800_000, n, ticket=True)
    await deployment.client.request("POST", f"{engine.controls[0]}/v1/rooms/7800000/abort")
    await prefill(deployment, engine, 7_800_001, n)
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
        with pytest.raises(ClaimLostError, match="freed"):
            await fetcher.fetch("prefill0", 7_800_000, fragmented_pages(pool, n, 14), ticket=old.ticket)
        await fetcher.fetch("prefill0", 7_800_001, fragmented_pages(pool, n, 15))  # the new room is intact


async def test_a_forged_or_replayed_ticket_is_refused_and_frees_nothing(deployment):
    engine, n, room = deployment.engines[1], 400, 7_900_000  # CP=2
    reply = await prefill(deployment, engine, room, n, ticket=True)
    ticket = reply.ticket
    assert ticket is not None
    forged = msgspec.structs.replace(ticket, pins=[msgspec.structs.replace(p, nonce=p.nonce ^ 1) for p in ticket.pins])
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
        with pytest.raises(ClaimLostError):
            await fetcher.fetch("prefill1", room, fragmented_pages(pool, n, 16), ticket=forged)
        await asyncio.sleep(0.1)  # its release notifications (with the wrong nonce) arrive
        await fetcher.fetch("prefill1", room, fragmented_pages(pool, n, 17), ticket=ticket)  # still pinned
        assert kv_is_exact(pool, "prefill1", room, n, fragmented_pages(pool, n, 17))
        await _settled(deployment)
        with pytest.raises(ClaimLostError):  # replayed after its release: the pin words are clear
            await fetcher.fetch("prefill1", room, fragmented_pages(pool, n, 18), ticket=ticket)
        stale = msgspec.structs.replace(
            ticket, pins=[msgspec.structs.replace(p, incarnation="0" * 12) for p in ticket.pins]
        )
        with pytest.raises(UnknownRoomError, match="no longer run"):
            await fetcher.fetch("prefill1", room, fragmented_pages(pool, n, 18), ticket=stale)


async def test_pin_words_are_read_over_ucx_where_the_table_cannot_be_mapped(deployment, monkeypatch):
    """As for an owner on another host: the pin word travels by a UCX READ."""
    import transfer.decode.owners

    monkeypatch.setattr(transfer.decode.owners, "map_pins", lambda table: None)
    engine, n = deployment.engines[2], 600  # CP=3
    good = await prefill(deployment, engine, 8_000_000, n, ticket=True)
    gone = await prefill(deployment, engine, 8_000_001, n, ticket=True)
    await deployment.client.request("POST", f"{engine.controls[1]}/v1/rooms/8000001/abort")
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=2) as fetcher:
        reads = []
        inner = fetcher.transport.read_host

        async def spy(*args, **kwargs):
            reads.append(args[0])
            return await inner(*args, **kwargs)

        fetcher.transport.read_host = spy
        result = await fetcher.fetch("prefill2", 8_000_000, fragmented_pages(pool, n, 19), ticket=good.ticket)
        assert result.control_messages == 0 and len(reads) == 3  # one pin READ an owner
        assert kv_is_exact(pool, "prefill2", 8_000_000, n, fragmented_pages(pool, n, 19))
        with pytest.raises(ClaimLostError, match="cp rank 1"):
            await fetcher.fetch("prefill2", 8_000_001, fragmented_pages(pool, n, 20), ticket=gone.ticket)


async def test_fetches_are_counted_in_metrics_and_every_service_serves_them(deployment):
    from prometheus_client import REGISTRY

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    engine, n = deployment.engines[0], 300
    good = await prefill(deployment, engine, 8_200_000, n, ticket=True)
    forged = msgspec.structs.replace(
        good.ticket, pins=[msgspec.structs.replace(p, nonce=p.nonce ^ 1) for p in good.ticket.pins]
    )
    fetches, failures = (
        sample("pdkv_fetch_seconds_count", engine="prefill0", protocol="ticket"),
        sample("pdkv_fetch_failures_total", engine="prefill0", error="ClaimLostError"),
    )
    pool = DSAKVPool(tiny(size=8192))
    async with DecodeFetcher(pool, deployment.registry_url, ucx_workers=1) as fetcher:
        with pytest.raises(ClaimLostError):
            await fetcher.fetch("prefill0", 8_200_000, fragmented_pages(pool, n, 40), ticket=forged)
        result = await fetcher.fetch("prefill0", 8_200_000, fragmented_pages(pool, n, 41), ticket=good.ticket)
    assert sample("pdkv_fetch_seconds_count", engine="prefill0", protocol="ticket") == fetches + 1
    assert sample("pdkv_fetch_failures_total", engine="prefill0", error="ClaimLostError") == failures + 1
    assert sample("pdkv_fetch_bytes_sum", engine="prefill0") >= result.nbytes
    assert "# TYPE process_cpu_seconds_total" in await deployment.client.get_text(f"{deployment.registry_url}/metrics")
    for url in [engine.intake, *engine.controls, deployment.decoders[0].url]:
        text = await deployment.client.get_text(f"{url}/metrics")
        assert "# TYPE pdkv_fetch_seconds histogram" in text, url
    assert 'pdkv_pinned_pages{cp_rank="0",engine="prefill0"}' in await deployment.client.get_text(
        f"{engine.controls[0]}/metrics"
    )
