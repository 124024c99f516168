"""Fetch throughput: pdkv vs raw NIXL on the same descriptors vs a memcpy of the same bytes.

DSA-shaped layout, one prefill engine of CP=4 (four processes, fragmented page
allocators) and the decode in this process (fragmented destination pages). For each
request size: the prefill writes the room, then in turn (a) raw NIXL READs of exactly the
descriptor list pdkv builds, posted per owner from one thread, (b) pdkv's fetch with the
room's ticket (all owners at once, then a pin word READ per owner that carries the
release; `--claims`: a claim per owner over HTTP first: `scripts/bench_claims.py` compares
the two), and (c) an in-process copy of the same pages between two pools (the limit).
Medians over --runs after a warm-up; prints a table.

`--engine-buffers`: then, in the same
call, owners whose KV lies in buffers of their own as SGLang's DSA pools allocate it (CP=4
processes, each a CUDA tensor per layer and kind of DeepSeek-V3.2's 61 layers: latent 656
and indexer 132 bytes a token, pages of 64; `tests/engine_owners.py`), read by a decode
over an `EngineKV` of its own per-layer tensors with `lane="auto"`. Each room is read once,
back to back (rooms published beforehand), three ways: with its ticket; by claims (a
decode with no ticket); and claimed ahead, then read and released (`RoomLease.read_once`,
SGLang's receiver: the claims taken at its bootstrap, the read timed from `send_metadata`).
Source and destination pages are runs of geometric length (mean 4) in a shuffled order;
every (size, read) is checked byte-exact after its warm-up. The table compares each row
with the pool lane's back-to-back fetches of this call ("b2b"; on a CPU, the pool's UCX
fetch) and gives the path that moved the bytes (`OwnerStats.lane`). `--vmm` adds rows from
owners on expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, VMM
memory), which hand their chunks to the lane as file descriptors.

    .venv/bin/python scripts/bench_fetch.py [--sizes 1024,8192,32768] [--runs 5] [--claims]
    .venv/bin/python scripts/bench_fetch.py --device cuda --engine-buffers [--vmm] --sizes 8192,32768
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_MODULES", "^ib")

from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from transfer.app.api import PrefillReply, PrefillRequest  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.app.router import Deployment, DeploymentSpec  # noqa: E402
from transfer.app.supervisor import Host  # noqa: E402
from transfer.app.synthetic import fragmented_allocator, fragmented_page_order  # noqa: E402
from transfer.decode import DecodeFetcher  # noqa: E402
from transfer.decode.owners import buffer_pairs  # noqa: E402
from transfer.lanes.runs import BufferPair, mem_type  # noqa: E402
from transfer.lanes.ucx.nixl import load_nixl  # noqa: E402
from transfer.lanes.ucx.plan import build_read_plan  # noqa: E402
from transfer.metadata import EngineDescriptor, RoomState, RoomTicket  # noqa: E402
from transfer.registry.server import RegistryServer  # noqa: E402
from transfer.results import FetchResult  # noqa: E402


class RawNixl:
    """A bare NIXL agent on the decode pool: the baseline pdkv must match."""

    def __init__(self, pool: DSAKVPool, engine: EngineDescriptor) -> None:
        nixl = load_nixl()
        self.mem = mem_type(pool.device)
        self.agent = nixl.nixl_agent("raw-bench", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory(pool.registered_buffers())
        self.names = [self.agent.add_remote_agent(r.agent_metadata) for r in engine.ranks]

    def read(self, plans: list) -> float:
        t0 = time.perf_counter()
        for name, plan in zip(self.names, plans):
            a = self.agent
            h = a.initialize_xfer(
                "READ", a.get_xfer_descs(plan.local, self.mem), a.get_xfer_descs(plan.remote, self.mem), name
            )
            state = a.transfer(h)
            while state == "PROC":
                state = a.check_xfer_state(h)
            assert state == "DONE", state
            h.release()
        return time.perf_counter() - t0


def owner_pairs(pool: DSAKVPool, engine: EngineDescriptor) -> list[list[BufferPair]]:
    """Each owner's buffers paired with `pool`'s, as the decode pairs them."""
    return [[p for pair in buffer_pairs(r, pool).values() for p in pair] for r in engine.ranks]


def sync_all() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def device_copy_limit(dst: DSAKVPool, src: DSAKVPool, src_pages: np.ndarray, dst_pages: np.ndarray) -> float:
    """On a GPU: the same pages copied device to device in one process (gather/scatter kernels)."""
    s, d = torch.from_numpy(src_pages).cuda(), torch.from_numpy(dst_pages).cuda()
    pages = dst.layout.num_pages
    sync_all()
    t0 = time.perf_counter()
    for layer in range(dst.layout.layer_num):
        for a, b in ((dst.kv_buffer[layer], src.kv_buffer[layer]), (dst.index_buffer[layer], src.index_buffer[layer])):
            a.view(torch.uint8).view(pages, -1)[d.to(a.device)] = (
                b.view(torch.uint8).view(pages, -1)[s.to(b.device)].to(a.device)
            )
    sync_all()
    return time.perf_counter() - t0


def memcpy_limit(plans: list) -> float:
    """One process, one thread: memmove of exactly the bytes of the merged descriptors."""
    t0 = time.perf_counter()
    for plan in plans:
        for (dst, n, _), (src, _, _) in zip(plan.local.tolist(), plan.remote.tolist()):
            ctypes.memmove(dst, src, n)
    return time.perf_counter() - t0


def memcpy_contiguous(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> float:
    """The machine's copy bandwidth: the same byte count as one contiguous copy."""
    if dst.is_cuda:
        sync_all()
        t0 = time.perf_counter()
        dst.view(torch.uint8).view(-1)[:nbytes].copy_(src.view(torch.uint8).view(-1)[:nbytes])
        sync_all()
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
    return time.perf_counter() - t0


async def bench(args: argparse.Namespace) -> None:
    gpu = args.device.startswith("cuda")
    # On a GPU the lane is also timed back to back, over `runs` rooms prefilled beforehand.
    pool_tokens = max(args.sizes) * (args.runs + 2 if gpu else 2) + 4096
    spec = DeploymentSpec(
        engines=(4,),
        decoders=0,
        preset="dsa_v32",
        prefill_pool_tokens=pool_tokens,
        device=args.prefill_device or args.device,
        registry_host=args.prefill_host,
        prefill_host=args.prefill_host,
        owner_progress=None if args.owner_progress_ms is None else args.owner_progress_ms / 1e3,
    )
    layout = dsa_v32(size=pool_tokens, device=args.decode_device or args.device)
    # The limit's source sits where the owners are when they share one GPU (a peer copy across GPUs).
    source_device = args.prefill_device if (args.prefill_device or "").startswith("cuda:") else layout.device
    decode_pool, source_copy = DSAKVPool(layout), DSAKVPool(layout.replace(device=source_device))
    for p in (decode_pool, source_copy):  # touch every page once: first-touch faults are not transfer cost
        p.slab.fill_(1)
    alloc = fragmented_allocator(layout.num_pages, 7)
    async with Deployment(spec) as d:
        engine_url = d.engines[0]
        desc = await d.client.request("GET", f"{d.registry_url}/v1/engines/prefill0", EngineDescriptor)
        raw, pairs = RawNixl(decode_pool, desc), owner_pairs(decode_pool, desc)
        # The same geometry with a local source pool standing in for the owners' memory.
        local_pairs = [
            [
                BufferPair(
                    p.local_addr, q.local_addr, p.item_len, p.local_items, p.remote_items, p.local_dev, q.local_dev
                )
                for p, q in zip(ps, qs)
            ]
            for ps, qs in zip(pairs, owner_pairs(source_copy, desc))
        ]
        async with (
            DecodeFetcher(decode_pool, d.registry_url, ucx_workers=args.ucx_workers or None, lane="ucx") as fetcher,
            DecodeFetcher(decode_pool, d.registry_url, lane="cuda_ipc" if gpu else "ucx") as lane,
            # The kernels alone (copy GB/s), from fetches of rooms of their own: timing them
            # costs the end-to-end fetch tens of microseconds, so the lane column goes untimed.
            DecodeFetcher(decode_pool, d.registry_url, lane="cuda_ipc" if gpu else "ucx", time_kernels=True) as timed,
        ):
            args.ucx_workers = fetcher.transport.workers
            if args.primes != "auto":  # the GPU lane's empty kernel ahead of a read (`CudaIpcLane.primes`)
                for f in (lane, timed):
                    for ipc in (x for x in f._owners.lanes if hasattr(x, "primes")):
                        ipc.primes = args.primes == "on"
            rows = []
            for n in args.sizes:
                slabs = (decode_pool.slab, source_copy.slab)
                pools = (decode_pool, source_copy)
                rows.append(
                    await bench_size(
                        d,
                        engine_url,
                        (fetcher, lane if gpu else None, timed),
                        raw,
                        pairs,
                        local_pairs,
                        slabs,
                        pools,
                        alloc,
                        n,
                        args.runs,
                        not args.claims,
                    )
                )
    print_table(rows, args)
    if args.engine_buffers:
        engine_rows = await engine_bench(args, vmm=False)
        if args.vmm:
            engine_rows += await engine_bench(args, vmm=True)
        print_engine_table(rows, engine_rows, args)


async def _prefill(d, engine, room: int, n: int, consumers: int, tickets: bool) -> PrefillReply:
    ask = PrefillRequest(room=room, num_tokens=n, consumers=consumers, ticket=tickets)
    return await d.client.request("POST", f"{engine.intake}/v1/prefill", PrefillReply, ask)


async def bench_size(d, engine, fetchers, raw, pairs, local_pairs, slabs, pools, alloc, n, runs, tickets):
    fetcher, lane, timed = fetchers
    samples = {"pdkv": [], "raw": [], "memcpy": [], "bandwidth": [], "ctl_pdkv": []}
    if lane is not None:
        samples.update({"lane": [], "lane_copy": [], "cold_bandwidth": [], "ctl_lane": []})
    desc_merged = desc_unmerged = 0
    nbytes = 0
    for i in range(runs + 1):  # the first run is a warm-up
        room = (n << 20) + i
        # With tickets each fetch reads a room of its own; by claims, one room takes a claim each.
        reply = await _prefill(d, engine, room, n, 1 if tickets or lane is None else 2, tickets)
        if tickets:
            src = np.asarray(reply.ticket.src_pages)
        else:
            state = await d.client.request("GET", f"{engine.controls[0]}/v1/rooms/{room}?after=-1", RoomState)
            src = np.asarray(state.src_pages)
        dst = alloc.alloc(len(src))
        plans = [build_read_plan(p, src, dst) for p in pairs]
        desc_merged = sum(p.descriptors for p in plans)
        desc_unmerged = sum(build_read_plan(p, src, dst, merge=False).descriptors for p in pairs)
        nbytes = sum(p.nbytes for p in plans)
        t_raw = raw.read(plans)
        result = await fetcher.fetch("prefill0", room, dst, ticket=reply.ticket)
        if lane is not None:
            lane_room, ticket = room, None
            if tickets:
                lane_room = room + (1 << 19)
                ticket = (await _prefill(d, engine, lane_room, n, 1, True)).ticket
            through_lane = await lane.fetch("prefill0", lane_room, dst, ticket=ticket)
            assert {o.lane for o in through_lane.owners} == {"cuda_ipc"}
            timed_room = lane_room + (1 << 18)
            timed_ticket = (await _prefill(d, engine, timed_room, n, 1, True)).ticket
            # The same contiguous copy as `bandwidth`, started as the lane's fetch is: right after
            # a prefill, the GPU busy with the owners' work and this host idle meanwhile. The
            # timed fetch after it measures its kernels on the GPU alone, which that leaves alone.
            t_cold = memcpy_contiguous(*slabs, nbytes)
            kernels = await timed.fetch("prefill0", timed_room, dst, ticket=timed_ticket)
        if pools[0].device.type == "cuda":
            t_copy = device_copy_limit(pools[0], pools[1], src, dst)
        else:
            t_copy = memcpy_limit([build_read_plan(p, src, dst) for p in local_pairs])
        t_bw = memcpy_contiguous(*slabs, nbytes)
        alloc.free(dst)
        if i:
            samples["raw"].append(t_raw)
            samples["pdkv"].append(result.seconds)
            samples["memcpy"].append(t_copy)
            samples["bandwidth"].append(t_bw)
            samples["ctl_pdkv"].append(result.control_messages)
            if lane is not None:
                samples["lane"].append(through_lane.seconds)
                samples["lane_copy"].append(kernels.read_seconds)
                samples["cold_bandwidth"].append(t_cold)
                samples["ctl_lane"].append(through_lane.control_messages)
    if lane is not None and tickets:
        b2b = await _back_to_back(d, engine, lane, alloc, n, runs)
        samples["lane_b2b"], samples["lane_b2b_read"], samples["path_b2b"] = b2b
        samples["stream_handed"], samples["stream_done"] = await _on_stream(d, engine, lane, alloc, n, runs)
    return n, nbytes, desc_unmerged, desc_merged, samples


async def _back_to_back(d, engine, lane, alloc, n: int, runs: int) -> tuple[list[float], list[float], list[str]]:
    """Lane fetches one after another, as a loaded decode runs them: `runs` rooms are
    prefilled first, then read into the same pages with nothing in between (after an
    idle wait, this machine's CPUs run the next millisecond of code several times slower)."""
    tickets = [(await _prefill(d, engine, (n << 20) + (1 << 18) + i, n, 1, True)).ticket for i in range(runs)]
    dst = alloc.alloc(len(tickets[0].src_pages))
    try:
        results = [await lane.fetch("prefill0", t.room, dst, ticket=t) for t in tickets]
    finally:
        alloc.free(dst)
    paths = sorted({o.lane for r in results for o in r.owners})
    return [r.seconds for r in results], [r.read_seconds for r in results], paths


async def _on_stream(d, engine, lane, alloc, n: int, runs: int) -> tuple[list[float], list[float]]:
    """As `_back_to_back`, each fetch ordered on a consumer's stream (`fetch(stream=...)`):
    seconds until the handle is back (the consumer's kernels may queue behind its event) and
    until its completion (the pin words proved). Its rooms are prefilled once the back-to-back
    ones are released."""
    await asyncio.sleep(0.2)  # the back-to-back rooms' releases land and free their pages
    tickets = [(await _prefill(d, engine, (n << 20) + (1 << 17) + i, n, 1, True)).ticket for i in range(runs)]
    dst, consumer = alloc.alloc(len(tickets[0].src_pages)), torch.cuda.Stream()
    handed, done = [], []
    try:
        for t in tickets:
            t0 = time.perf_counter()
            handle = await lane.fetch("prefill0", t.room, dst, ticket=t, stream=consumer)
            t1 = time.perf_counter()
            await handle
            handed.append(t1 - t0)
            done.append(time.perf_counter() - t0)
            assert handle.ordered
    finally:
        consumer.synchronize()
        alloc.free(dst)
    return handed, done


def print_table(rows, args) -> None:
    print(
        f"DSA layout, {'claims' if args.claims else 'tickets'}, owners on {args.prefill_device or args.device}, "
        f"decode on {args.decode_device or args.device}, "
        f"prefill CP=4, decode UCX workers={args.ucx_workers}, {args.runs} runs after a warm-up, medians"
    )
    if args.device == "cuda":
        print("memcpy: the same pages copied device to device in one process; bandwidth: one contiguous D2D copy")
    else:
        print("memcpy: one thread memmoves the same descriptors; bandwidth: one contiguous memmove of as many bytes")
    head = (
        "tokens",
        "MB",
        "descs",
        "merged",
        "pdkv GB/s",
        "raw GB/s",
        "memcpy GB/s",
        "bandw. GB/s",
        "pdkv/raw",
        "pdkv/memcpy",
        "pdkv/bandw.",
        "p50 ms",
        "p99 ms",
        "ctl msgs",
    )
    print("".join(f"{h:>12}" for h in head))
    for n, nbytes, du, dm, s in rows:
        g, lat = _rates(nbytes, s, "pdkv")
        ratios = (g["pdkv"] / g["raw"], g["pdkv"] / g["memcpy"], g["pdkv"] / g["bandwidth"])
        rates = (g["pdkv"], g["raw"], g["memcpy"], g["bandwidth"], *ratios, *lat)
        _row((n, nbytes / 1e6, du, dm), rates, statistics.median(s["ctl_pdkv"]))
    if any("lane" in s for *_, s in rows):
        print("same-host GPU lane (CUDA IPC + one gather kernel per batch): fetch() end to end, and its kernels alone")
        head = (
            "tokens",
            "MB",
            "lane GB/s",
            "copy GB/s",
            "bandw. GB/s",
            "lane/bandw.",
            "copy/bandw.",
            "p50 ms",
            "p99 ms",
            "b2b GB/s",
            "b2b/bandw.",
            "b2b p50 ms",
            "cold GB/s",
            "lane/cold",
            "ctl msgs",
        )
        print("".join(f"{h:>12}" for h in head))
        for n, nbytes, _, _, s in rows:
            g, lat = _rates(nbytes, s, "lane")
            ratios = (g["lane"] / g["bandwidth"], g["lane_copy"] / g["bandwidth"])
            b2b = g.get("lane_b2b", float("nan"))
            b2b_p50 = 1e3 * statistics.median(s.get("lane_b2b") or [float("nan")])
            cold = (g["cold_bandwidth"], g["lane"] / g["cold_bandwidth"])
            rates = (g["lane"], g["lane_copy"], g["bandwidth"], *ratios, *lat, b2b, b2b / g["bandwidth"], b2b_p50)
            rates += cold
            _row((n, nbytes / 1e6), rates, statistics.median(s["ctl_lane"]))
        print("b2b: the lane's fetches back to back, rooms prefilled beforehand (the others: one after each prefill)")
        print("cold: the contiguous copy started as a fetch is, right after a prefill (bandw.: after the fetches)")
        print("the same, ordered on a consumer's stream (fetch(stream=...)), p50 ms: handle back; completion proved")
        print("".join(f"{h:>12}" for h in ("tokens", "b2b p50 ms", "handed p50", "done p50", "handed/b2b")))
        for n, _, _, _, s in rows:
            if s.get("stream_handed"):
                keys = ("lane_b2b", "stream_handed", "stream_done")
                b2b, handed, done = (1e3 * statistics.median(s[k]) for k in keys)
                print(f"{n:>12}" + "".join(f"{v:>12.3f}" for v in (b2b, handed, done, handed / b2b)))


def _rates(nbytes: int, samples: dict, timed: str) -> tuple[dict, tuple[float, float]]:
    """GB/s of every sample series (medians), and the p50 / p99 ms of the `timed` one."""
    g = {k: nbytes / statistics.median(v) / 1e9 for k, v in samples.items() if not k.startswith(("ctl", "path"))}
    lat = np.array(samples[timed]) * 1e3
    return g, (np.percentile(lat, 50), np.percentile(lat, 99))


def _row(counts: tuple, rates: tuple, messages: float) -> None:
    """One table row; `messages`: control requests per fetch (claims, polls, releases)."""
    cells = [f"{v:>12.0f}" for v in counts] + [f"{v:>12.2f}" for v in rates] + [f"{messages:>12.0f}"]
    print("".join(cells))


# ---- --engine-buffers: owners holding SGLang-shaped per-layer allocations (issue 31) -----------
ENGINE_LAYERS, ENGINE_PAGE, ENGINE_CP = 61, 64, 4
ENGINE_MODES = ("ticket", "claims", "ahead")


class EngineRow(NamedTuple):
    owners: str  # "engine" (per-layer allocations) or "engine vmm" (on expandable segments)
    tokens: int
    nbytes: int
    read: str  # one of ENGINE_MODES
    paths: str  # what moved the bytes, from OwnerStats.lane (several: comma-separated)
    seconds: list[float]
    copy_gbps: float  # one contiguous copy of as many bytes on the same device
    read_seconds: list[float]  # the lane's share: launch to wake-up (or the kernels' GPU time if timed)


def contiguous_copy_gbps(nbytes: int, device: str) -> float:
    """One contiguous copy of `nbytes` on `device`, best of a few, in GB/s."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    cuda = a.is_cuda

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(a.device)

    b.copy_(a)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    sync()
    return nbytes * 5 / (time.perf_counter() - t0) / 1e9


def _engine_room(mode: str, tokens: int, run: int) -> int:
    return ENGINE_MODES.index(mode) * 10**7 + 1000 * (tokens // ENGINE_PAGE) + run


async def _engine_read(
    fetcher: DecodeFetcher, engine_id: str, mode: str, room: int, src: list, dst: list, reports: dict, gap: float
) -> FetchResult:
    """One read of `room` the way `mode` says, timed from the call that starts it; claimed ahead,
    `gap` seconds after the claim (SGLang's receiver reads once the prefill is done)."""
    if mode == "ticket":
        pins = [reports[c][1][room] for c in range(ENGINE_CP)]
        if any(p is None for p in pins):
            raise SystemExit(f"room {room}: an owner gave no pin ({pins}): the ticket rows would read by claims")
        ticket = RoomTicket(engine_id=engine_id, room=room, src_pages=src, pins=pins)
        return await fetcher.fetch(engine_id, room, dst, ticket=ticket)
    if mode == "claims":
        return await fetcher.fetch(engine_id, room, dst)
    lease = await fetcher.claim(engine_id, room)  # at the receiver's bootstrap, before the pages are known
    await asyncio.sleep(gap)
    t0 = time.perf_counter()
    result = await lease.read_once(dst)
    return msgspec.structs.replace(result, seconds=time.perf_counter() - t0)


def _check_engine_bytes(shape, bufs: list[torch.Tensor], src: list[int], dst: list[int], what: str) -> None:
    """Every layer and kind of the decode's buffers holds, in `dst`, the owners' pattern of `src`."""
    from tests.engine_owners import layer_pattern

    device = bufs[0].device
    s, d = torch.as_tensor(src, device=device), torch.as_tensor(dst, device=device)
    for layer in range(shape.layers):
        for kind in (0, 1):
            want = layer_pattern(shape, layer, kind, str(device))[s]
            if not torch.equal(bufs[kind * shape.layers + layer][d], want):
                raise SystemExit(f"{what}: layer {layer} kind {kind} not byte-exact")


async def engine_bench(args: argparse.Namespace, vmm: bool) -> list[EngineRow]:
    """Every size read every way from CP=4 owners of per-layer allocations (on expandable
    segments if `vmm`), into a decode's own per-layer tensors, on `args.device`."""
    from tests.engine_owners import Shape, engine_buffers, engine_kv, start_owners, stop_owners

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    pages = max(args.sizes) // ENGINE_PAGE
    shape = Shape(layers=ENGINE_LAYERS, page_size=ENGINE_PAGE, pages=pages + 8)
    rng = np.random.default_rng(7)
    order = np.arange(pages + 7)
    src = {n: fragmented_page_order(order, rng)[: n // ENGINE_PAGE].tolist() for n in args.sizes}
    dst = {n: fragmented_page_order(order, rng)[: n // ENGINE_PAGE] for n in args.sizes}  # an array, as SGLang's
    rooms = {_engine_room(m, n, r): src[n] for m in ENGINE_MODES for n in args.sizes for r in range(args.runs + 1)}
    unpinned = frozenset(room for room in rooms if room // 10**7 != ENGINE_MODES.index("ticket"))
    engine_id, label = ("engine-vmm", "engine vmm") if vmm else ("engine", "engine")
    registry = RegistryServer()
    url = await registry.start()
    vmm_ranks = tuple(range(ENGINE_CP)) if vmm else ()
    procs, stop, reports = await asyncio.to_thread(
        start_owners, url, engine_id, ENGINE_CP, shape, rooms, vmm_ranks, unpinned, device
    )
    rows = []
    try:
        slabs = [reports[r][0] for r in range(ENGINE_CP)]
        print(
            f"{label} owners: CP={ENGINE_CP}, {ENGINE_LAYERS} layers on {device}, exported IPC slabs and VMM"
            f" spans per owner {slabs} (None: not exportable, read over UCX)"
        )
        lane_expected = device == "cuda"
        if lane_expected and any(s is None for s in slabs):
            raise SystemExit(f"owners of per-layer CUDA allocations exported no IPC handles: {slabs}")
        bufs = engine_buffers(shape, range(ENGINE_LAYERS), fill=False, device=device)
        kv = engine_kv(shape, range(ENGINE_LAYERS), bufs, device=device)
        async with DecodeFetcher(kv, url, lane="auto") as fetcher:
            for n in args.sizes:
                copy = contiguous_copy_gbps(
                    n // ENGINE_PAGE * ENGINE_LAYERS * (shape.kv_item + shape.index_item), device
                )
                for mode in ENGINE_MODES:
                    seconds, reads, nbytes, paths = [], [], 0, set()
                    for r in range(args.runs + 1):
                        if r == 0:
                            for b in bufs:  # poison: the warm-up read is checked byte-exact
                                b.fill_(0x5A)
                        result = await _engine_read(
                            fetcher, engine_id, mode, _engine_room(mode, n, r), src[n], dst[n], reports,
                            args.ahead_gap_ms / 1e3,
                        )  # fmt: skip
                        if r == 0:
                            if device == "cuda":
                                torch.cuda.synchronize()
                            _check_engine_bytes(shape, bufs, src[n], dst[n], f"{label} {n} tokens {mode}")
                        else:  # the first is a warm-up
                            seconds.append(result.seconds)
                            reads.append(result.read_seconds)
                        nbytes = result.nbytes
                        paths |= {o.lane for o in result.owners}
                    if lane_expected and paths != {"cuda_ipc"}:
                        raise SystemExit(f"{label} {n} tokens {mode}: read by {sorted(paths)}, not the lane (cuda_ipc)")
                    rows.append(EngineRow(label, n, nbytes, mode, ",".join(sorted(paths)), seconds, copy, reads))
    finally:
        await asyncio.to_thread(stop_owners, procs, stop)
        await registry.aclose()
    return rows


def print_engine_table(pool_rows, engine_rows: list[EngineRow], args) -> None:
    """Engine-buffer rows against the pool lane of this call (on a CPU: the pool's UCX fetch)."""
    pool: dict[int, tuple[float, str, str]] = {}  # tokens -> (GB/s, path, which series)
    pool_read: dict[int, float] = {}  # tokens -> the b2b lane's launch-to-wake ms
    for n, nbytes, _, _, s in pool_rows:
        if "lane_b2b" in s:
            pool[n] = (nbytes / statistics.median(s["lane_b2b"]) / 1e9, ",".join(s["path_b2b"]), "pool lane b2b")
            pool_read[n] = 1e3 * statistics.median(s["lane_b2b_read"])
        elif "lane" in s:
            pool[n] = (nbytes / statistics.median(s["lane"]) / 1e9, "cuda_ipc", "pool lane")
        else:
            pool[n] = (nbytes / statistics.median(s["pdkv"]) / 1e9, "ucx", "pool pdkv")
    print(
        f"engine-owned buffers (a tensor per layer and kind, {ENGINE_LAYERS} layers, CP={ENGINE_CP}, "
        f"pages of {ENGINE_PAGE}), each room read once back to back, {args.runs} runs after a checked warm-up, "
        "medians; x pool: against the pool row of the same size"
    )
    head = ("owners", "tokens", "MB", "read", "lane", "GB/s", "p50 ms", "p99 ms", "lane ms", "copy GB/s")
    head += ("x copy", "x pool")
    widths = (12, 8, 8, 8, 10, 9, 9, 9, 9, 10, 8, 8)
    print("".join(f"{h:>{w}}" for h, w in zip(head, widths)))

    def line(cells: tuple) -> None:
        print("".join(f"{c:>{w}}" if isinstance(c, str) else f"{c:>{w}.2f}" for c, w in zip(cells, widths)))

    for n in args.sizes:
        ref = pool.get(n)
        if ref is not None:
            p = [r for r in pool_rows if r[0] == n][0]
            lane_ms = pool_read.get(n, float("nan"))
            line(("pool", str(n), f"{p[1] / 1e6:.0f}", "ticket", ref[1], ref[0], "", "", lane_ms, "", "", 1.0))
        for row in (r for r in engine_rows if r.tokens == n):
            lat = np.array(row.seconds) * 1e3
            gbps = row.nbytes / statistics.median(row.seconds) / 1e9
            x_pool = gbps / ref[0] if ref is not None else float("nan")
            line(
                (row.owners, str(n), f"{row.nbytes / 1e6:.0f}", row.read, row.paths, gbps)
                + (
                    float(np.percentile(lat, 50)),
                    float(np.percentile(lat, 99)),
                    1e3 * statistics.median(row.read_seconds),
                )
                + (row.copy_gbps,)
                + (gbps / row.copy_gbps, x_pool)
            )
    kinds = sorted({v[2] for v in pool.values()})
    print(f"pool: {', '.join(kinds)} (tickets); lane: what moved the bytes (OwnerStats.lane: cuda_ipc, the lane; ucx)")
    print("lane ms: the reads' own time (FetchResult.read_seconds: on the lane, its launch to its wake-up)")


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--ucx-workers", type=int, default=0, help="decode threads posting READs; 0: one a core, up to 8 (4 on a GPU)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--claims",
        action="store_true",
        help="fetch by claims (a claim per owner over HTTP) instead of the rooms' tickets",
    )
    ap.add_argument("--prefill-device", default="", help="the owners' device: cuda (one GPU a rank), cuda:N")
    ap.add_argument("--decode-device", default="", help="the decode pool's device (default --device)")
    ap.add_argument(
        "--prefill-host",
        type=Host.parse,
        default=Host(),
        help="where the registry and owners run: ADDRESS or NETNS@ADDRESS (see scripts/bench_hosts.py)",
    )
    ap.add_argument(
        "--owner-progress-ms",
        type=float,
        default=None,
        help="how often owners drive their UCX worker while a room is read (default: by transport)",
    )
    ap.add_argument(
        "--primes",
        choices=("auto", "on", "off"),
        default="auto",
        help="the GPU lane's empty kernel ahead of each read: where an owner shares the decode's GPU (auto), "
        "always, or never (a GPU shared under MPS switches between processes without it)",
    )
    ap.add_argument(
        "--engine-buffers",
        action="store_true",
        help="also read CP=4 owners of SGLang-shaped per-layer allocations (61 layers, latent and indexer) "
        "ticket / claims / claimed ahead, against the pool lane of this call",
    )
    ap.add_argument(
        "--vmm",
        action="store_true",
        help="with --engine-buffers: add rows from owners on expandable segments (VMM memory); "
        "the path column says how they were read",
    )
    ap.add_argument(
        "--ahead-gap-ms",
        type=float,
        default=0.0,
        help="with --engine-buffers: read a room claimed ahead this long after its claim (0: at once)",
    )
    args = ap.parse_args()
    if args.vmm and not args.engine_buffers:
        ap.error("--vmm needs --engine-buffers")
    if args.vmm and not args.device.startswith("cuda"):
        ap.error("--vmm needs --device cuda (expandable segments are CUDA memory)")
    if args.engine_buffers and (args.prefill_device or args.decode_device or args.prefill_host != Host()):
        ap.error("--engine-buffers reads owners and a decode on this host's --device: no --prefill-*/--decode-device")
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
