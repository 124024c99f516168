"""Would a shared-memory lane beat UCX (cma) for host pools on one host? A measurement.

The design the GPU lane uses, on host memory: each of CP=4 owner processes keeps its
owned layers' slabs in a shared-memory file; the decode maps every owner's file once and
copies a request's pages (every layer, latent and indexer) with N threads, each a share
of the (source, destination, length) runs. Compared with a one-thread memcpy of as many
contiguous bytes (the machine's scale); `scripts/bench_fetch.py` gives the UCX (cma) rate
of the same request on the same machine. Every run's bytes are checked.

    python3 scripts/bench_host_lane.py [--sizes 1024,8192,32768] [--threads 1,2,4,8] [--runs 5]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import ShardPlan, dsa_v32  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.app.synthetic import fragmented_page_order  # noqa: E402

CP = 4


def _owner(path: str, nbytes: int, seed: int, ready: mp.Event, stop: mp.Event) -> None:  # type: ignore[valid-type]
    """An owner: its slab in a shared-memory file, filled, kept alive until told."""
    with open(path, "w+b") as f:
        f.truncate(nbytes)
        view = np.memmap(f, dtype=np.uint8, mode="r+", shape=(nbytes,))
        view[:] = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
        ready.set()
        stop.wait(600)


def _runs(bases: list[tuple[int, int, int]], src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """(src addr, dst addr, length) per page and buffer, consecutive pages merged."""
    out = []
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], brk])
    lens = np.diff(np.concatenate([starts, [len(src)]]))
    for sbase, dbase, item in bases:
        out.append(np.stack([sbase + src[starts] * item, dbase + dst[starts] * item, lens * item], axis=1))
    return np.concatenate(out)


def _copy(runs: np.ndarray) -> None:
    move = ctypes.memmove
    for s, d, n in runs.tolist():
        move(d, s, n)  # ctypes drops the GIL for the call


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--threads", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    layout = dsa_v32(size=max(args.sizes) * 2 + 4096)
    kv, ix = layout.kv_page_bytes, layout.index_page_bytes
    layer_bytes = (kv + ix) * layout.num_pages  # an owner keeps, per layer, latent then indexer
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    ctx = mp.get_context("spawn")
    stop, owners, maps = ctx.Event(), [], []
    bases: list[tuple[int, int, int]] = []
    plans = [ShardPlan(r, CP, layout.layer_num) for r in range(CP)]
    for r, plan in enumerate(plans):
        path = os.path.join(shm, f"pdkv-bench-{os.getpid()}-{r}")
        nbytes = layer_bytes * len(plan.owned)
        ready = ctx.Event()
        p = ctx.Process(target=_owner, args=(path, nbytes, r, ready, stop), daemon=True)
        p.start()
        owners.append((p, path))
        ready.wait(300)
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        arr = np.frombuffer(m, dtype=np.uint8)
        maps.append((m, arr))
        base = arr.ctypes.data
        for i in range(len(plan.owned)):
            bases.append((base + i * layer_bytes, 0, kv))
            bases.append((base + i * layer_bytes + kv * layout.num_pages, 0, ix))
    dst = np.zeros(layer_bytes * layout.layer_num, dtype=np.uint8)
    dst[:] = 1  # fault the destination in, as a running decode's pool is
    dbases = []  # the decode's pool: every layer, the same arrangement as the owners'
    for layer in range(layout.layer_num):
        dbases += [dst.ctypes.data + layer * layer_bytes, dst.ctypes.data + layer * layer_bytes + kv * layout.num_pages]
    bases = [(s, d, item) for (s, _, item), d in zip(bases, dbases)]
    rng = np.random.default_rng(7)
    scratch = np.empty(max(args.sizes) // layout.page_size * (kv + ix) * layout.layer_num, dtype=np.uint8)
    print(f"{os.cpu_count()} cores; DSA-{layout.layer_num}, CP={CP} owners in shared-memory files, fragmented pages")
    print(
        f"{'tokens':>8}{'MB':>8}{'threads':>9}{'runs/fetch':>12}{'GB/s':>8}{'p50 ms':>9}{'memcpy GB/s':>13}{'ratio':>7}"
    )
    try:
        for n in args.sizes:
            k = n // layout.page_size
            src = fragmented_page_order(np.arange(1, layout.num_pages), rng)[:k]
            dstp = fragmented_page_order(np.arange(1, layout.num_pages), rng)[:k]
            runs = _runs(bases, src, dstp)
            nbytes = int(runs[:, 2].sum())
            flat = scratch[:nbytes]
            samples = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                ctypes.memmove(flat.ctypes.data, maps[0][1].ctypes.data, min(nbytes, maps[0][1].nbytes))
                samples.append(time.perf_counter() - t0)
            memcpy = min(nbytes, maps[0][1].nbytes) / statistics.median(samples) / 1e9
            for threads in args.threads:
                parts = np.array_split(runs, threads)
                with ThreadPoolExecutor(threads) as pool:
                    times = []
                    for i in range(args.runs + 1):
                        t0 = time.perf_counter()
                        list(pool.map(_copy, parts))
                        if i:
                            times.append(time.perf_counter() - t0)
                _verify(runs)
                t = statistics.median(times)
                row = f"{n:>8}{nbytes / 1e6:>8.0f}{threads:>9}{len(runs):>12}{nbytes / t / 1e9:>8.2f}{t * 1e3:>9.1f}"
                print(row + f"{memcpy:>13.2f}{nbytes / t / 1e9 / memcpy:>7.2f}", flush=True)
    finally:
        stop.set()
        for p, path in owners:
            p.join(10)
            os.unlink(path)


def _verify(runs: np.ndarray) -> None:
    for s, d, n in runs.tolist():
        a = (ctypes.c_char * n).from_address(s)
        b = (ctypes.c_char * n).from_address(d)
        if bytes(a) != bytes(b):
            raise SystemExit(f"bytes differ at dst {d:#x}")


if __name__ == "__main__":
    main()
