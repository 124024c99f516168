"""GPU paths, run where CUDA is present (scripts/gpu_check.sh on the lent H200); skipped in CI.

The pool tests in test_pool.py also run on CUDA there (their `device` parameter)."""

import asyncio
import datetime
import os
import signal
import time

import msgspec
import numpy as np
import pytest
import torch
import torch.distributed as dist

from pdkv import DSAKVPool, InvalidPagesError, OwnerBroadcaster, PeerLostError, TransferError, tiny
from tests.rooms_helpers import fragmented_pages, kv_is_exact, prefill
from transfer.app.router import Deployment, DeploymentSpec
from transfer.decode import DecodeFetcher
from transfer.metadata import EngineDescriptor
from transfer.timeouts import Timeouts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_nccl_owner_broadcast_one_rank_side_stream_awaited(tmp_path):
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path}/init", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        bc = OwnerBroadcaster(device="cuda")
        t = torch.arange(1 << 20, device="cuda", dtype=torch.int32)
        compute = torch.cuda.current_stream()
        t.mul_(3)  # queued on the compute stream: the broadcast must be ordered after it
        handle = bc.start(t, 0, "gpu test")
        asyncio.run(handle.wait_async())  # awaited without blocking; then ordered on compute
        compute.synchronize()
        assert handle.done() and int(t[-1]) == 3 * ((1 << 20) - 1)
    finally:
        dist.destroy_process_group()


def _gpu_spec(engines, **over):
    """A tiny-layout deployment on the GPU(s): one GPU per CP rank where there are several."""
    base = dict(preset="tiny", device="cuda", prefill_pool_tokens=8192, decode_pool_tokens=8192, start_timeout=240)
    return DeploymentSpec(engines=engines, **{**base, **over})


@pytest.mark.parametrize("engines", [(1,), (2,)])
def test_gpu_to_gpu_fetch_between_processes_byte_exact(engines):
    async def run():
        async with Deployment(_gpu_spec(engines, decoders=1)) as d:
            return [await d.submit(n) for n in (1, 37, 500, 2000)]

    outs = asyncio.run(run())
    assert [o.error for o in outs if not o.ok] == []
    layout = tiny()
    for o in outs:
        assert o.decode.verified_bytes == o.num_tokens * 7 * (layout.kv_token_bytes + layout.index_token_bytes)


def test_layer_split_reads_on_cuda_through_gloo_ranks_sharing_the_gpu():
    # NCCL wants one rank per device; ranks sharing one GPU broadcast CUDA tensors over gloo.
    from tests.distributed import run_group
    from tests.pool_workers import owner_broadcast_reads

    out = run_group(owner_broadcast_reads, 2, 7, "cuda", "gloo")
    assert len({v["kv_broadcasts"] for v in out.values()}) == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layers", [7, 10])
def test_nccl_owner_broadcast_across_gpus_every_byte_on_every_rank(layers):
    from tests.distributed import run_group
    from tests.pool_workers import owner_broadcast_reads

    world = torch.cuda.device_count()
    out = run_group(owner_broadcast_reads, world, layers, "cuda:rank", "nccl")
    assert len({v["kv_broadcasts"] for v in out.values()}) == 1


def _broadcast_with_a_peer_missing(rank: int, world: int) -> str:
    """Rank 0 waits for a broadcast from rank 1, which never sends it: rank 0's watchdog
    must end the wait with `DeadlineExceeded`, abort the communicator (its kernel exits)
    and refuse what follows. (A root would not wait: NCCL's buffers take what it sends.)"""
    from pdkv import DeadlineExceeded

    torch.cuda.set_device(rank)
    bc = OwnerBroadcaster(device=f"cuda:{rank}", timeout=datetime.timedelta(seconds=3))
    t = torch.full((1 << 20,), rank, dtype=torch.int32, device=f"cuda:{rank}")
    asyncio.run(bc.start(t, 0, "joined by both").wait_async())
    torch.cuda.synchronize()
    assert int(t.sum()) == 0  # rank 0's zeros reached rank 1
    outcome = "joined"
    if rank == 0:
        handle = bc.start(t, 1, "peer missing")
        with pytest.raises(DeadlineExceeded, match="peer missing"):
            asyncio.run(handle.wait_async())
        with pytest.raises(DeadlineExceeded):
            bc.start(t, 0, "after the abort")
        torch.cuda.synchronize()  # the aborted kernel has exited: nothing on the GPU hangs
        outcome = "aborted"
    else:
        time.sleep(6)  # never joins the second broadcast
    bc.close()
    return outcome


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_broadcast_whose_peer_never_joins_ends_at_its_deadline():
    from tests.distributed import run_group

    assert run_group(_broadcast_with_a_peer_missing, 2) == {0: "aborted", 1: "joined"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_decode_assembles_from_owners_on_other_gpus():
    async def run():
        async with Deployment(_gpu_spec((torch.cuda.device_count(),), decoders=1)) as d:
            return [await d.submit(n, prefix_id=1 if n > 100 else -1, prefix_tokens=64) for n in (1, 37, 500, 2000)]

    outs = asyncio.run(run())
    assert [o.error for o in outs if not o.ok] == []


# ---- the same-host GPU lane (CUDA IPC + one gather kernel) -------------------------------------
def _lane_spec(engines, **over):
    return _gpu_spec(engines, decoders=0, **over)


def _gather_case(word: int, pages: int, seed: int, items: int = 64, base: int = 16 * 261):
    """Two buffers (items of two lengths whose widest load is `word` bytes), random source
    bytes, poisoned destination, and a plan of `pages` random distinct pages each side."""
    from transfer.lanes.cuda_ipc.plan import build_gather_plan
    from transfer.lanes.runs import BufferPair

    gen = torch.Generator().manual_seed(seed)
    base += word % 16  # `word` divides it, no wider load does
    bufs = []
    for item in (base, 2 * base):
        src = torch.randint(0, 256, (items, item), dtype=torch.uint8, generator=gen).cuda()
        dst = torch.full((items, item), 0xAB, dtype=torch.uint8, device="cuda")
        bufs.append((src, dst))
    src_pages = torch.randperm(items, generator=gen)[:pages].numpy()
    dst_pages = torch.randperm(items, generator=gen)[:pages].numpy()
    pairs = [BufferPair(d.data_ptr(), s.data_ptr(), d.shape[1], items, items) for s, d in bufs]
    return bufs, build_gather_plan(pairs, src_pages, dst_pages)


def _expected(bufs, plans):
    """The destination buffers after `plans` ran in order, computed with torch."""
    out = [d.clone() for _, d in bufs]
    for plan in plans:
        for (s, _), o in zip(bufs, out):
            o[torch.from_numpy(plan.dst_pages).cuda()] = s[torch.from_numpy(plan.src_pages[0]).cuda()]
    return out


@pytest.mark.parametrize("word", [16, 8, 4, 2, 1])
def test_gather_kernel_copies_exactly_the_planned_pages_at_each_load_width(word):
    from transfer.lanes.cuda_ipc.gather import Gatherer

    bufs, plan = _gather_case(word, pages=23, seed=word)
    assert plan.word == word
    want = _expected(bufs, [plan])
    lane = Gatherer(torch.device("cuda:0"), timed=word % 2 == 0)  # timed kernels, and untimed
    try:
        seconds = asyncio.run(lane.run(plan))
    finally:
        lane.close()
    assert seconds > 0
    for (_, d), w in zip(bufs, want):
        assert torch.equal(d, w)  # the planned pages copied, every other page still poison


@pytest.mark.parametrize("timed", [False, True])
def test_a_gathers_end_is_seen_by_a_polling_loop_and_by_a_parked_one_alike(timed):
    """On the main thread the loop asks the launch's end event between its turns; on another
    thread (pdkv's synchronous surface) it parks and the waiting thread wakes it. Both return
    once every byte is in place, timed or not."""
    import threading

    from transfer.lanes.cuda_ipc.gather import Gatherer

    bufs, plan = _gather_case(16, pages=301, seed=11 + timed, items=400)
    want = _expected(bufs, [plan])
    lane = Gatherer(torch.device("cuda:0"), timed=timed)
    polled: list[bool] = []

    async def copy() -> float:
        polled.append(lane.polls())
        with torch.cuda.stream(lane.stream):
            torch.cuda._sleep(2_000_000)  # the end comes well after the launch returns
        return await lane.run(plan)

    try:
        assert asyncio.run(copy()) > 0
        for (_, d), w in zip(bufs, want):
            assert torch.equal(d, w)
            d.fill_(0x5A)
        want = _expected(bufs, [plan])
        thread = threading.Thread(target=lambda: polled.append(asyncio.run(copy()) > 0))
        thread.start()
        thread.join(30)
    finally:
        lane.close()
    assert polled == [True, False, True]  # the main thread polls; the other parks; both returned
    for (_, d), w in zip(bufs, want):
        assert torch.equal(d, w)


@pytest.mark.parametrize("fill", [0.5, 1.5, 2.5])
def test_gather_plans_whose_page_ids_outgrow_a_launch_go_out_in_several(fill):
    """Page ids ride in a launch's parameters: a plan with more of them than the largest
    launch holds goes out in several, each with its own slice of both page lists."""
    from transfer.lanes.cuda_ipc.gather import Gatherer

    lane = Gatherer(torch.device("cuda:0"))
    pages = int(fill * lane.kernel.capacities[-1] / 2)  # two ids a page: one source list
    bufs, plan = _gather_case(16, pages=pages, seed=pages, items=pages + 7, base=16 * 4)
    want = _expected(bufs, [plan])
    try:
        asyncio.run(lane.run(plan))
    finally:
        lane.close()
    for (_, d), w in zip(bufs, want):
        assert torch.equal(d, w)


def test_prime_on_a_thread_without_the_gpus_context_leaves_it_as_found_and_gathers_after_it():
    """The empty kernel goes out on whatever thread starts a fetch. On a thread with no
    context current it must neither raise nor leave the context pushed; a gather after it
    copies as ever."""
    import threading

    from transfer.lanes.cuda_ipc.gather import Gatherer

    lane = Gatherer(torch.device("cuda:0"))
    bufs, plan = _gather_case(16, pages=23, seed=5)
    want = _expected(bufs, [plan])
    after: list[int | None] = []

    def fresh_thread() -> None:
        lane.prime()
        after.append(lane.kernel.current_context())

    try:
        thread = threading.Thread(target=fresh_thread)
        thread.start()
        thread.join()
        lane.prime()  # this thread: torch made the context current
        asyncio.run(lane.run(plan))
    finally:
        lane.close()
    assert after == [None]
    for (_, d), w in zip(bufs, want):
        assert torch.equal(d, w)


def test_gather_launches_queued_back_to_back_each_carry_their_own_page_ids():
    """Page ids ride in each launch's parameters, set in place in one buffer: a driver that
    read them after the call returned would send one launch another's pages. Queue many
    launches behind a slow one without waiting, then compare with the same plans in order."""
    from transfer.lanes.cuda_ipc.gather import Gatherer
    from transfer.lanes.cuda_ipc.plan import gather_plan

    bufs, first = _gather_case(16, pages=64, seed=1)
    gen = np.random.default_rng(2)
    plans = [first] + [
        gather_plan(first.table, [gen.permutation(64)[:k]], gen.permutation(64)[:k]) for k in range(1, 40)
    ]
    want = _expected(bufs, plans)
    lane = Gatherer(torch.device("cuda:0"))
    try:
        with torch.cuda.stream(lane.stream):
            torch.cuda._sleep(50_000_000)  # hold the lane's stream so that every copy queues behind it
        launches = [lane.launch(p) for p in plans]
        launches[-1].wait()
    finally:
        lane.close()
    for (_, d), w in zip(bufs, want):
        assert torch.equal(d, w)


def test_lane_fetch_is_byte_exact_for_cp_1_to_4_over_odd_layer_counts():
    async def run():
        async with Deployment(_lane_spec((1, 2, 3, 4))) as d:
            pool = DSAKVPool(tiny(size=8192, device="cuda:0"))
            async with DecodeFetcher(pool, d.registry_url, lane="cuda_ipc") as fetcher:
                for e, engine in enumerate(d.engines):
                    for i, n in enumerate((1, 37, 500, 2000)):
                        room, pages = 9_000_000 + 10 * e + i, fragmented_pages(pool, n, 10 * e + i)
                        ticket = i % 2 == 1  # by claims and by ticket (pin words mapped, release by notification)
                        reply = await prefill(d, engine, room, n, ticket=ticket)
                        result = await fetcher.fetch(engine.engine_id, room, pages, ticket=reply.ticket)
                        assert {o.lane for o in result.owners} == {"cuda_ipc"}
                        # claims: one a rank, or one call where the arbiter handed out held claims
                        assert result.control_messages in ((0,) if ticket else (1, len(engine.controls)))
                        assert kv_is_exact(pool, engine.engine_id, room, n, pages), (engine.engine_id, n)
            for _ in range(100):  # every room released on every rank, tickets' too
                stats = [await d.client.get_json(f"{c}/v1/stats") for e in d.engines for c in e.controls]
                if all(s["pinned_pages"] == 0 for s in stats):
                    break
                await asyncio.sleep(0.05)
            assert all(s["pinned_pages"] == 0 for s in stats), stats

    asyncio.run(run())


def test_a_ticket_fetch_launched_first_refuses_repeated_pages_once_its_copy_ended_and_keeps_the_room():
    """The launch goes out before the destination ids are checked for repeats (their bounds
    are checked first): a fetch naming one page twice raises once its kernel has ended, the
    room still pinned, and the same ticket then reads it into good pages byte for byte. The
    owners share the decode's GPU, so each fetch primes it; `primes=False` stops that."""

    async def run():
        async with Deployment(_lane_spec((4,))) as d:
            pool = DSAKVPool(tiny(size=8192, device="cuda:0"))
            async with DecodeFetcher(pool, d.registry_url, lane="cuda_ipc") as fetcher:
                lane, tickets = fetcher._owners.lanes[0], fetcher._tickets
                primed, launched, abandoned = [], [], []
                prime, launch, abandon = lane._gather.prime, tickets.launch, tickets.abandon
                lane._gather.prime = lambda: (primed.append(1), prime())[1]
                tickets.launch = lambda *a: launched.append(launch(*a)) or launched[-1]
                tickets.abandon = lambda e, give_up=True: (abandoned.append((e, give_up)), abandon(e, give_up))[1]
                engine, n = d.engines[0], 700
                warm = await prefill(d, engine, 9_200_000, n, ticket=True)  # the owners cached after it
                await fetcher.fetch("prefill0", 9_200_000, fragmented_pages(pool, n, 1), ticket=warm.ticket)
                assert lane._sharing == 4 and not primed  # nothing mapped yet as it began
                reply = await prefill(d, engine, 9_200_001, n, ticket=True)
                pages = fragmented_pages(pool, n, 2)
                twice = pages.copy()
                twice[-1] = twice[0]
                with pytest.raises(InvalidPagesError, match="repeat"):
                    await fetcher.fetch("prefill0", 9_200_001, twice, ticket=reply.ticket)
                # Launched first, then waited for and withdrawn (not given up) before the error.
                assert launched[-1] is not None and abandoned == [(launched[-1], False)]
                assert launched[-1].started.passed()
                result = await fetcher.fetch("prefill0", 9_200_001, pages, ticket=reply.ticket)
                assert {o.lane for o in result.owners} == {"cuda_ipc"} and len(primed) == 2
                assert kv_is_exact(pool, "prefill0", 9_200_001, n, pages)
                lane.primes = False
                third = await prefill(d, engine, 9_200_002, n, ticket=True)
                await fetcher.fetch("prefill0", 9_200_002, pages, ticket=third.ticket)
                assert len(primed) == 2 and kv_is_exact(pool, "prefill0", 9_200_002, n, pages)

    asyncio.run(run())


def test_a_room_claimed_ahead_launches_before_its_page_checks_and_refuses_repeated_pages_once_its_copy_ended():
    """SGLang's receiver's read (`RoomLease.read_once` of a room claimed whole) launches as
    soon as its destination ids are bounded: a read naming one page twice raises only once
    its kernel has ended, its claim given up; a good read is launched once and byte exact."""

    async def run():
        async with Deployment(_lane_spec((4,))) as d:
            pool = DSAKVPool(tiny(size=8192, device="cuda:0"))
            async with DecodeFetcher(pool, d.registry_url, lane="cuda_ipc") as fetcher:
                tickets, launched, settled = fetcher._tickets, [], []
                launch, settle = tickets.launch_prepared, tickets.settle
                tickets.launch_prepared = lambda *a: launched.append(launch(*a)) or launched[-1]
                tickets.settle = lambda p, e: (settled.append(e), settle(p, e))[1]
                engine, n = d.engines[0], 700
                await prefill(d, engine, 9_300_000, n)
                pages = fragmented_pages(pool, n, 1)
                await fetcher.fetch("prefill0", 9_300_000, pages)  # the owners mapped and cached
                await prefill(d, engine, 9_300_001, n)
                lease = await fetcher.claim("prefill0", 9_300_001, timeout=20)
                twice = pages.copy()
                twice[-1] = twice[0]
                with pytest.raises(InvalidPagesError, match="repeat"):
                    await lease.read_once(twice)
                assert launched[-1] is not None and settled == [launched[-1]]
                assert launched[-1].started.passed()  # waited for before the refusal
                await prefill(d, engine, 9_300_002, n)
                lease = await fetcher.claim("prefill0", 9_300_002, timeout=20)
                result = await lease.read_once(pages)
                assert launched[-1] is not None and launched[-1].entered and len(settled) == 1
                assert {o.lane for o in result.owners} == {"cuda_ipc"}
                assert kv_is_exact(pool, "prefill0", 9_300_002, n, pages)
            for _ in range(100):  # the refused room given up, the read one released
                stats = [await d.client.get_json(f"{c}/v1/stats") for c in d.engines[0].controls]
                if all(s["pinned_pages"] == 0 for s in stats):
                    break
                await asyncio.sleep(0.05)
            assert all(s["pinned_pages"] == 0 for s in stats), stats

    asyncio.run(run())


def test_lane_and_ucx_owners_mix_in_one_fetch():
    async def run():
        async with Deployment(_lane_spec((4,))) as d:
            pool = DSAKVPool(tiny(size=8192, device="cuda:0"))
            async with DecodeFetcher(pool, d.registry_url, lane="auto") as fetcher:
                lane = fetcher._owners.lanes[0]
                reach = lane.reach
                lane.reach = lambda r: reach(r) if r.cp_rank % 2 == 0 else "odd ranks over UCX (the test's choice)"
                room, n = 9_100_000, 1500
                await prefill(d, d.engines[0], room, n)
                result = await fetcher.fetch("prefill0", room, fragmented_pages(pool, n, 1))
                assert [o.lane for o in result.owners] == ["cuda_ipc", "ucx", "cuda_ipc", "ucx"]
                assert kv_is_exact(pool, "prefill0", room, n, fragmented_pages(pool, n, 1))

    asyncio.run(run())


def test_lane_owner_killed_mid_fetch_is_a_typed_error_and_its_mappings_dropped():
    async def run():
        async with Deployment(_lane_spec((2,), layer_delay=0.3)) as d:
            pool = DSAKVPool(tiny(size=8192, device="cuda:0"))
            async with DecodeFetcher(pool, d.registry_url, lane="cuda_ipc", timeouts=Timeouts(request=2.0)) as fetcher:
                await prefill(d, d.engines[0], 9_200_000, 64)  # looked up and mapped
                await fetcher.fetch("prefill0", 9_200_000, fragmented_pages(pool, 64, 1))
                owners = fetcher._owners.cached["prefill0"]
                room = 9_200_001
                writing = asyncio.create_task(prefill(d, d.engines[0], room, 500))
                fetch = asyncio.create_task(fetcher.fetch("prefill0", room, fragmented_pages(pool, 500, 2), timeout=20))
                await asyncio.sleep(0.5)  # the first layers are being read
                victim = next(c for c in d.launcher.children if c.name == "prefill0-cp1")
                t0 = time.monotonic()
                os.kill(victim.pid, signal.SIGKILL)
                with pytest.raises(PeerLostError):
                    await fetch
                assert time.monotonic() - t0 < 5.0
                assert all(o.peer is not None and o.peer.closed for o in owners.values())
                writing.cancel()
                await asyncio.gather(writing, return_exceptions=True)

    asyncio.run(run())


def test_a_forged_slab_length_is_refused_before_any_launch():
    async def run():
        async with Deployment(_lane_spec((1,))) as d:
            desc = await d.client.request("GET", f"{d.registry_url}/v1/engines/prefill0", EngineDescriptor)
            rank = desc.ranks[0]
            forged_slabs = [msgspec.structs.replace(s, length=s.length + (1 << 30)) for s in rank.ipc.slabs]
            forged = msgspec.structs.replace(rank, ipc=msgspec.structs.replace(rank.ipc, slabs=forged_slabs))
            pool = DSAKVPool(tiny(size=8192, device="cuda:0"))
            async with DecodeFetcher(pool, d.registry_url, lane="cuda_ipc") as fetcher:
                owner = fetcher._owners.check(msgspec.structs.replace(desc, ranks=[forged]))[0]
                with pytest.raises(TransferError, match="exceeds"):
                    fetcher._owners.lanes[0].map(owner.rank, owner.pairs)

    asyncio.run(run())


def test_one_owners_read_sends_its_ids_to_the_kernel_and_refuses_a_bad_one_before_any_launch():
    """`CudaIpcLane.read` (a lone owner's, by claims) builds no plan: ids checked vectorised,
    both sides, then copied byte for byte through the table kept on the GPU."""
    from pdkv.errors import PageRangeError
    from transfer.lanes.cuda_ipc.lane import CudaIpcLane, IpcPeer
    from transfer.lanes.runs import BufferPair

    gen = torch.Generator().manual_seed(7)
    items, layers = 48, 3
    srcs = [torch.randint(0, 256, (items, 1040 * (k + 1)), dtype=torch.uint8, generator=gen).cuda() for k in range(6)]
    dsts = [torch.full_like(s, 0xAB) for s in srcs]
    pairs = [BufferPair(d.data_ptr(), s.data_ptr(), s.shape[1], items, items) for s, d in zip(srcs, dsts)]
    peer = IpcPeer("owner", 0, range(layers), [], {i: (pairs[2 * i], pairs[2 * i + 1]) for i in range(layers)})

    async def run():
        lane = CudaIpcLane(torch.device("cuda:0"), fd_timeout=5.0)
        try:
            for bad_src, bad_dst in (([0, items], [1, 2]), ([0, -1], [1, 2]), ([0, 1], [items, 2])):
                with pytest.raises(PageRangeError):
                    await lane.read(peer, range(layers), np.array(bad_src), np.array(bad_dst))
            torch.cuda.synchronize()
            assert all(bool((d == 0xAB).all()) for d in dsts)  # nothing launched
            src, dst = (torch.randperm(items, generator=gen)[:29].numpy() for _ in range(2))
            stats = await lane.read(peer, range(1, layers), src, dst)
            assert stats.nbytes == 29 * sum(s.shape[1] for s in srcs[2:])
            assert (await lane.read(peer, range(layers), src[:0], dst[:0])).nbytes == 0
        finally:
            await lane.aclose()
        return src, dst

    src, dst = asyncio.run(run())
    torch.cuda.synchronize()
    for k, (s, d) in enumerate(zip(srcs, dsts)):
        want = torch.full_like(s, 0xAB)
        if k >= 2:  # layers 1 and 2 read, layer 0 not
            want[torch.from_numpy(dst).cuda()] = s[torch.from_numpy(src).cuda()]
        assert torch.equal(d, want), k


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("engines, decode_gpu", [((1,), 1), ((2,), 0)])
def test_lane_reads_owners_on_other_gpus(engines, decode_gpu):
    """Owners on GPU 0 and the decode on GPU 1; then owners spread over both GPUs."""

    async def run():
        async with Deployment(_lane_spec(engines)) as d:
            pool = DSAKVPool(tiny(size=8192, device=f"cuda:{decode_gpu}"))
            async with DecodeFetcher(pool, d.registry_url, lane="cuda_ipc") as fetcher:
                for i, n in enumerate((37, 2000)):
                    room = 9_300_000 + i
                    await prefill(d, d.engines[0], room, n)
                    result = await fetcher.fetch("prefill0", room, fragmented_pages(pool, n, i))
                    assert {o.lane for o in result.owners} == {"cuda_ipc"}
                    assert kv_is_exact(pool, "prefill0", room, n, fragmented_pages(pool, n, i))

    asyncio.run(run())


@pytest.mark.parametrize("lane", ["cuda_ipc", "ucx"])
def test_a_cancelled_fetch_lands_no_byte_after_it_raised(lane):
    """A fetch of a 32k-token DSA room cancelled at points from before its launch to mid-read:
    once it has raised, a sentinel written over its destination pages stays unchanged (the
    kernel or the READs had ended before it raised)."""
    from pdkv import dsa_v32

    async def run():
        spec = _lane_spec((4,), preset="dsa_v32", prefill_pool_tokens=73728, decode_pool_tokens=36864)
        async with Deployment(spec) as d:
            pool = DSAKVPool(dsa_v32(size=36864, device="cuda:0"))
            async with DecodeFetcher(pool, d.registry_url, lane=lane) as fetcher:
                warm = await prefill(d, d.engines[0], 9_400_000, 64, ticket=True)
                await fetcher.fetch("prefill0", 9_400_000, fragmented_pages(pool, 64, 1), ticket=warm.ticket)
                cancelled = 0
                for k, delay in enumerate((0.0, 0.0002, 0.001, 0.005, 0.02, 0.08)):
                    room, n = 9_400_001 + k, 32768
                    reply = await prefill(d, d.engines[0], room, n, ticket=True)
                    pages = torch.from_numpy(fragmented_pages(pool, n, k)).cuda()
                    task = asyncio.create_task(fetcher.fetch("prefill0", room, pages, ticket=reply.ticket))
                    await asyncio.sleep(delay)
                    task.cancel()
                    outcome = (await asyncio.gather(task, return_exceptions=True))[0]
                    if not isinstance(outcome, asyncio.CancelledError):
                        continue  # it had ended first
                    cancelled += 1
                    rows = [
                        buf.view(torch.uint8).reshape(pool.layout.num_pages, -1)
                        for buf in [*pool.kv_buffer, *pool.index_buffer]
                    ]
                    for r in rows:
                        r[pages] = 0x5A
                    torch.cuda.synchronize()
                    await asyncio.sleep(0.5)
                    torch.cuda.synchronize()
                    assert all(bool((r[pages] == 0x5A).all()) for r in rows), (lane, delay)
                assert cancelled >= 1

    asyncio.run(run())


def _check_engine_kv(shape, bufs, src, dst) -> None:
    from tests.engine_owners import layer_pattern

    n = shape.layers
    for layer in range(n):
        for kind in (0, 1):
            want = layer_pattern(shape, layer, kind)[torch.as_tensor(src, device="cuda")]
            got = bufs[kind * n + layer][torch.as_tensor(dst, device="cuda")]
            assert torch.equal(got, want), (layer, kind)


def test_engine_owned_buffers_go_by_the_lane_vmm_owners_too_in_one_fetch():
    """Owners whose KV is a tensor per layer and kind (SGLang's pools): the lane maps each
    allocation and reads every layer of those owners; an owner on expandable segments (VMM,
    which IPC handles cannot export) hands its chunks' descriptors over its socket and is
    read by the lane too, in the same fetch; byte-exact. Forced over UCX, the same bytes."""
    from tests.engine_owners import Shape, engine_buffers, engine_kv, start_owners, stop_owners
    from transfer.metadata import RoomTicket
    from transfer.registry.server import RegistryServer

    shape = Shape(layers=9, page_size=64, pages=129)
    src, dst = list(range(3, 103)), list(range(120, 20, -1))

    async def run():
        registry = RegistryServer()
        url = await registry.start()
        procs, stop, reports = await asyncio.to_thread(start_owners, url, "eng0", 3, shape, {1: src, 2: src}, (2,))
        try:
            assert all(reports[r][0] >= 1 for r in range(3)), reports
            for room, lane in ((1, "cuda_ipc"), (2, "ucx")):
                bufs = engine_buffers(shape, range(shape.layers), fill=False)
                async with DecodeFetcher(engine_kv(shape, range(shape.layers), bufs), url, lane=lane) as fetcher:
                    pins = [reports[r][1][room] for r in range(3)]
                    ticket = RoomTicket(engine_id="eng0", room=room, src_pages=src, pins=pins)
                    result = await fetcher.fetch("eng0", room, dst, ticket=ticket)
                    assert [o.lane for o in result.owners] == [lane] * 3
                    torch.cuda.synchronize()
                    _check_engine_kv(shape, bufs, src, dst)
        finally:
            await asyncio.to_thread(stop_owners, procs, stop)
            await registry.aclose()

    asyncio.run(run())


def test_engine_owned_buffers_by_ticket_in_one_launch_and_a_forged_slab_refused():
    """Four owners of per-layer allocations, read with their ticket: one launch over every
    allocation of every owner, byte-exact; a slab whose length the wire inflates is refused
    when it is mapped, before any launch."""
    from tests.engine_owners import Shape, engine_buffers, engine_kv, start_owners, stop_owners
    from transfer.control import ControlClient
    from transfer.metadata import RoomTicket
    from transfer.registry.server import RegistryServer

    shape = Shape(layers=11, page_size=64, pages=257)
    src, dst = list(range(0, 256, 2)), list(range(1, 257, 2))

    async def run():
        registry = RegistryServer()
        url = await registry.start()
        procs, stop, reports = await asyncio.to_thread(start_owners, url, "eng1", 4, shape, {5: src})
        client = ControlClient(Timeouts())
        try:
            bufs = engine_buffers(shape, range(shape.layers), fill=False)
            pins = [reports[r][1][5] for r in range(4)]
            ticket = RoomTicket(engine_id="eng1", room=5, src_pages=src, pins=pins)
            async with DecodeFetcher(engine_kv(shape, range(shape.layers), bufs), url, lane="cuda_ipc") as fetcher:
                result = await fetcher.fetch("eng1", 5, dst, ticket=ticket)
                assert {o.lane for o in result.owners} == {"cuda_ipc"} and result.control_messages == 0
                torch.cuda.synchronize()
                _check_engine_kv(shape, bufs, src, dst)
                desc = await client.request("GET", f"{url}/v1/engines/eng1", EngineDescriptor)
                rank = desc.ranks[0]
                forged = [msgspec.structs.replace(s, length=s.length + (1 << 30)) for s in rank.ipc.slabs]
                rank = msgspec.structs.replace(rank, ipc=msgspec.structs.replace(rank.ipc, slabs=forged))
                owner = fetcher._owners.check(msgspec.structs.replace(desc, ranks=[rank, *desc.ranks[1:]]))[0]
                with pytest.raises(TransferError, match="exceeds"):
                    fetcher._owners.lanes[0].map(owner.rank, owner.pairs)
        finally:
            await client.aclose()
            await asyncio.to_thread(stop_owners, procs, stop)
            await registry.aclose()

    asyncio.run(run())


@pytest.mark.parametrize("lane", ["cuda_ipc", "auto"])
def test_engine_owner_killed_while_a_fetch_waits_for_its_prefill_is_peer_lost_within_5s(lane):
    """Owners of per-layer allocations (SGLang's pools); the decode reads through the lane,
    by claims, a room whose prefill is not finished (the first half of each owner's layers
    ready, the rest never): the fetch reads what is ready and waits. One owner SIGKILLed
    meanwhile must end the fetch in `PeerLostError` within 5 s, well before its own deadline."""
    from tests.engine_owners import Shape, engine_buffers, engine_kv, start_owners, stop_owners
    from transfer.registry.server import RegistryServer

    shape = Shape(layers=9, page_size=64, pages=129)
    src, dst = list(range(3, 103)), list(range(120, 20, -1))
    whole, unfinished = 1, 2

    async def run():
        registry = RegistryServer()
        url = await registry.start()
        procs, stop, reports = await asyncio.to_thread(
            start_owners, url, "eng3", 4, shape, {whole: src, unfinished: src}, (), frozenset({whole}), "cuda",
            frozenset({unfinished}),
        )  # fmt: skip
        try:
            assert all(reports[r][0] is not None for r in range(4)), reports  # every owner exported its allocations
            bufs = engine_buffers(shape, range(shape.layers), fill=False)
            async with DecodeFetcher(engine_kv(shape, range(shape.layers), bufs), url, lane=lane) as fetcher:
                warm = await fetcher.fetch("eng3", whole, dst)  # looked up, mapped, read whole by claims
                assert {o.lane for o in warm.owners} == {"cuda_ipc"}
                torch.cuda.synchronize()
                _check_engine_kv(shape, bufs, src, dst)
                fetch = asyncio.create_task(fetcher.fetch("eng3", unfinished, dst, timeout=60))
                await asyncio.sleep(1.0)  # the ready layers read; the fetch waits for the rest
                assert not fetch.done(), fetch
                t0 = time.monotonic()
                os.kill(procs[1].pid, signal.SIGKILL)
                with pytest.raises(PeerLostError):
                    await fetch
                assert time.monotonic() - t0 < 5.0
        finally:
            await asyncio.to_thread(stop_owners, procs, stop)
            await registry.aclose()

    asyncio.run(run())


def test_a_scheduler_sees_a_lane_read_land_while_pdkvs_loop_is_held():
    """The lane's waiting thread proves a read as its kernel ends and leaves the result for
    the handle: with pdkv's loop held (it cannot hear the kernel's end), a synchronous
    caller's poll still reports the read, byte-exact; the loop finishes behind once let go."""
    import threading

    from tests.engine_owners import Shape, engine_buffers, engine_kv, start_owners, stop_owners
    from transfer.metadata import RoomTicket
    from transfer.registry.server import RegistryServer
    from transfer.sync import BackgroundLoop, HandleStatus, SyncFetcher

    shape = Shape(layers=11, page_size=64, pages=257)
    src, dst = list(range(0, 256, 2)), list(range(1, 257, 2))
    bg = BackgroundLoop("test-registry")
    registry = RegistryServer()
    url = bg.run(registry.start(), 10)
    procs, stop, reports = start_owners(url, "eng1", 4, shape, {4: src, 5: src})
    held, free = threading.Event(), threading.Event()
    try:
        bufs = engine_buffers(shape, range(shape.layers), fill=False)
        ticket, warm = (
            RoomTicket(engine_id="eng1", room=room, src_pages=src, pins=[reports[r][1][room] for r in range(4)])
            for room in (5, 4)
        )
        fetcher = SyncFetcher(engine_kv(shape, range(shape.layers), bufs), url, lane="cuda_ipc")
        try:
            # Looked up, mapped and its gather table uploaded: a first read's upload waits for the lane's stream.
            fetcher.fetch("eng1", 4, dst, ticket=warm).result(timeout=60)
            for b in bufs:
                b.zero_()
            torch.cuda.synchronize()
            lane = fetcher.fetcher._owners.lanes[0]
            with torch.cuda.stream(lane._gather.stream):
                torch.cuda._sleep(2_000_000_000)  # ~1 s: the gather queues behind it, ending after the loop is held
            handle = fetcher.fetch("eng1", 5, dst, ticket=ticket)
            time.sleep(0.3)  # the read launches meanwhile (in well under a millisecond)
            fetcher._bg.call(lambda: (held.set(), free.wait(60)))
            assert held.wait(10) and handle.poll() is HandleStatus.PENDING  # the kernel has not ended
            end = time.monotonic() + 30
            while handle.poll() is HandleStatus.PENDING:
                assert time.monotonic() < end, "the poll never saw the read land"
                time.sleep(0.0002)
            assert not free.is_set()  # pdkv's loop was held all along
            result = handle.result()
            assert {o.lane for o in result.owners} == {"cuda_ipc"} and result.control_messages == 0
            assert result.nbytes == len(src) * shape.layers * (shape.kv_item + shape.index_item)
            _check_engine_kv(shape, bufs, src, dst)
            free.set()
        finally:
            free.set()
            fetcher.close()
    finally:
        stop_owners(procs, stop)
        bg.run(registry.aclose(), 10)
        bg.stop()


def test_a_consumer_stream_ordered_behind_a_lane_fetch_sees_exactly_the_rooms_bytes_and_a_failed_proof_raises():
    """`fetch(stream=...)`: with the lane's stream held back, the handle comes before the gather
    has run (its event not passed); a copy queued on the consumer's stream after it sees
    exactly the room's bytes, and the completion reports the proved read. A room aborted on
    one owner while its gather is held back (its pin word cleared) fails the completion with
    `ClaimLostError`, never success. Owners read over UCX complete on the host first
    (`ordered` False), the event then the consumer's own; byte-exact too."""
    from pdkv.errors import ClaimLostError
    from tests.engine_owners import Shape, engine_buffers, engine_kv, layer_pattern, start_owners, stop_owners
    from transfer.control import ControlClient
    from transfer.metadata import RoomTicket
    from transfer.registry.server import RegistryServer

    shape = Shape(layers=11, page_size=64, pages=257)
    src, dst = list(range(0, 256, 2)), list(range(1, 257, 2))
    rooms = {5: src, 6: src, 7: src, 8: src}

    def seen_on(consumer: torch.cuda.Stream, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.cuda.stream(consumer):  # the consumer's kernels, queued behind the handed event
            index = torch.as_tensor(dst, device="cuda")
            return [b[index] for b in bufs]

    def exact(seen: list[torch.Tensor]) -> bool:
        index, n = torch.as_tensor(src, device="cuda"), shape.layers
        return all(
            torch.equal(seen[kind * n + layer], layer_pattern(shape, layer, kind)[index])
            for layer in range(n)
            for kind in (0, 1)
        )

    async def run():
        registry = RegistryServer()
        url = await registry.start()
        procs, stop, reports = await asyncio.to_thread(start_owners, url, "eng5", 4, shape, rooms)
        client = ControlClient(Timeouts())
        tickets = {
            r: RoomTicket(engine_id="eng5", room=r, src_pages=src, pins=[reports[k][1][r] for k in range(4)])
            for r in rooms
        }
        try:
            bufs = engine_buffers(shape, range(shape.layers), fill=False)
            async with DecodeFetcher(engine_kv(shape, range(shape.layers), bufs), url, lane="cuda_ipc") as fetcher:
                ranks = await fetcher.describe("eng5")
                # A first read uploads its gather table, which waits for the lane's stream.
                await fetcher.fetch("eng5", 8, dst, ticket=tickets[8])
                lane_stream, consumer = fetcher._owners.lanes[0]._gather.stream, torch.cuda.Stream()
                for b in bufs:
                    b.zero_()
                torch.cuda.synchronize()
                with torch.cuda.stream(lane_stream):
                    torch.cuda._sleep(400_000_000)  # ~0.2 s: the gather queues behind it
                handle = await fetcher.fetch("eng5", 5, dst, ticket=tickets[5], stream=consumer)
                assert handle.ordered and not handle.event.query() and not handle.done()
                seen = seen_on(consumer, bufs)
                result = await handle
                assert {o.lane for o in result.owners} == {"cuda_ipc"} and result.control_messages == 0
                consumer.synchronize()
                assert exact(seen)

                with torch.cuda.stream(lane_stream):
                    torch.cuda._sleep(1_000_000_000)  # ~0.5 s
                handle = await fetcher.fetch("eng5", 6, dst, ticket=tickets[6], stream=consumer.cuda_stream)
                assert handle.ordered and not handle.done()
                await client.request("POST", f"{ranks[2].control_url}/v1/rooms/6/abort")
                assert not handle.event.query()  # aborted while the gather was still held back
                with pytest.raises(ClaimLostError, match="cp rank 2"):
                    await handle
                with pytest.raises(ClaimLostError):
                    handle.result()
            ubufs = engine_buffers(shape, range(shape.layers), fill=False)
            async with DecodeFetcher(engine_kv(shape, range(shape.layers), ubufs), url, lane="ucx") as fetcher:
                handle = await fetcher.fetch("eng5", 7, dst, ticket=tickets[7], stream=consumer)
                assert not handle.ordered and handle.done()
                assert {o.lane for o in (await handle).owners} == {"ucx"}
                seen = seen_on(consumer, ubufs)
                consumer.synchronize()
                assert exact(seen)
        finally:
            await client.aclose()
            await asyncio.to_thread(stop_owners, procs, stop)
            await registry.aclose()

    asyncio.run(run())
