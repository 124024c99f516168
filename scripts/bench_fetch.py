"""Fetch throughput: pdkv vs raw NIXL on the same descriptors vs a memcpy of the same bytes.

DSA-shaped layout, one prefill engine of CP=4 (four processes, fragmented page
allocators) and the decode in this process (fragmented destination pages). For each
request size: the prefill writes the room, then in turn (a) raw NIXL READs of exactly the
descriptor list pdkv builds, posted per owner from one thread, (b) pdkv's fetch with the
room's ticket (all owners at once, then a pin word READ per owner that carries the
release; `--claims`: a claim and a release over HTTP per owner instead), and (c) an
in-process copy of the same pages between two pools (the limit). Medians over --runs
after a warm-up; prints a table.

    .venv/bin/python scripts/bench_fetch.py [--sizes 1024,8192,32768] [--runs 5] [--claims]
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_MODULES", "^ib")

from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from transfer.app.api import PrefillReply, PrefillRequest  # noqa: E402
from transfer.app.router import Deployment, DeploymentSpec  # noqa: E402
from transfer.app.supervisor import Host  # noqa: E402
from transfer.app.synthetic import fragmented_allocator  # noqa: E402
from transfer.decode import DecodeFetcher  # noqa: E402
from transfer.metadata import EngineDescriptor, RoomState  # noqa: E402
from transfer.plan import BufferPair, buffer_pairs, build_read_plan, mem_type  # noqa: E402
from transfer.timeouts import Timeouts  # noqa: E402
from transfer.ucx import load_nixl  # noqa: E402


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
        owner_progress=args.owner_progress_ms / 1e3,
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
            DecodeFetcher(decode_pool, d.registry_url, lanes=args.lanes or None, path="ucx") as fetcher,
            DecodeFetcher(decode_pool, d.registry_url, path="cuda_ipc" if gpu else "ucx") as lane,
            # The kernels alone (copy GB/s), from fetches of rooms of their own: timing them
            # costs the end-to-end fetch tens of microseconds, so the lane column goes untimed.
            DecodeFetcher(decode_pool, d.registry_url, path="cuda_ipc" if gpu else "ucx", time_kernels=True) as timed,
        ):
            args.lanes = fetcher.transport.lanes
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


async def _prefill(d, engine, room: int, n: int, consumers: int, tickets: bool) -> PrefillReply:
    ask = PrefillRequest(room=room, num_tokens=n, consumers=consumers, ticket=tickets)
    return await d.client.request("POST", f"{engine.intake}/v1/prefill", PrefillReply, ask)


async def bench_size(d, engine, fetchers, raw, pairs, local_pairs, slabs, pools, alloc, n, runs, tickets):
    fetcher, lane, timed = fetchers
    samples = {"pdkv": [], "raw": [], "memcpy": [], "bandwidth": [], "ctl_pdkv": []}
    if lane is not None:
        samples.update({"lane": [], "lane_copy": [], "ctl_lane": []})
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
            assert {o.path for o in through_lane.owners} == {"cuda_ipc"}
            timed_room = lane_room + (1 << 18)
            timed_ticket = (await _prefill(d, engine, timed_room, n, 1, True)).ticket
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
                samples["ctl_lane"].append(through_lane.control_messages)
    if lane is not None and tickets:
        samples["lane_b2b"] = await _back_to_back(d, engine, lane, alloc, n, runs)
    return n, nbytes, desc_unmerged, desc_merged, samples


async def _back_to_back(d, engine, lane, alloc, n: int, runs: int) -> list[float]:
    """Lane fetches one after another, as a loaded decode runs them: `runs` rooms are
    prefilled first, then read into the same pages with nothing in between (after an
    idle wait, this machine's CPUs run the next millisecond of code several times slower)."""
    tickets = [(await _prefill(d, engine, (n << 20) + (1 << 18) + i, n, 1, True)).ticket for i in range(runs)]
    dst = alloc.alloc(len(tickets[0].src_pages))
    try:
        return [(await lane.fetch("prefill0", t.room, dst, ticket=t)).seconds for t in tickets]
    finally:
        alloc.free(dst)


def print_table(rows, args) -> None:
    print(
        f"DSA layout, {'claims' if args.claims else 'tickets'}, owners on {args.prefill_device or args.device}, "
        f"decode on {args.decode_device or args.device}, "
        f"prefill CP=4, decode lanes={args.lanes}, {args.runs} runs after a warm-up, medians"
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
            "ctl msgs",
        )
        print("".join(f"{h:>12}" for h in head))
        for n, nbytes, _, _, s in rows:
            g, lat = _rates(nbytes, s, "lane")
            ratios = (g["lane"] / g["bandwidth"], g["lane_copy"] / g["bandwidth"])
            b2b = g.get("lane_b2b", float("nan"))
            b2b_p50 = 1e3 * statistics.median(s.get("lane_b2b") or [float("nan")])
            rates = (g["lane"], g["lane_copy"], g["bandwidth"], *ratios, *lat, b2b, b2b / g["bandwidth"], b2b_p50)
            _row((n, nbytes / 1e6), rates, statistics.median(s["ctl_lane"]))
        print("b2b: the lane's fetches back to back, rooms prefilled beforehand (the others: one after each prefill)")


def _rates(nbytes: int, samples: dict, timed: str) -> tuple[dict, tuple[float, float]]:
    """GB/s of every sample series (medians), and the p50 / p99 ms of the `timed` one."""
    g = {k: nbytes / statistics.median(v) / 1e9 for k, v in samples.items() if not k.startswith("ctl")}
    lat = np.array(samples[timed]) * 1e3
    return g, (np.percentile(lat, 50), np.percentile(lat, 99))


def _row(counts: tuple, rates: tuple, messages: float) -> None:
    """One table row; `messages`: control requests per fetch (claims, polls, releases)."""
    cells = [f"{v:>12.0f}" for v in counts] + [f"{v:>12.2f}" for v in rates] + [f"{messages:>12.0f}"]
    print("".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lanes", type=int, default=0, help="decode lanes; 0: one a core, up to 8 (4 on a GPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--claims", action="store_true", help="fetch by claims and releases over HTTP instead of the rooms' tickets"
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
        default=Timeouts().ticket_progress_interval * 1e3,
        help="how often owners drive their UCX worker while a ticket is out",
    )
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()
