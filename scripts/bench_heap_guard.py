"""What the owner heap guard (`protect_owner_heap`) costs the process it is set in, measured
in an SGLang-scheduler-like loop of host allocations: pdkv's guard (UCX's own allocations
zeroed) against the whole-process one it replaced (glibc's mmap threshold at 32 KiB).

Each iteration does what SGLang's scheduler does on the host for one batch: new requests'
token ids decoded from their messages into lists, a prefill chunk's input ids, positions
and KV locations built as CPU tensors from them and from a request's page table, a decode
batch's small per-request tensors, a sampled token per request appended to its output, and
all of it freed at the end. The prompt mix is the main job's (1k-32k tokens); the chunk is
SGLang's default `--chunked-prefill-size` 8192.

Every round runs in a fresh process, each setting in turn (the order rotating), so that all
see the same machine load: no guard; pdkv's guard, set by `protect_owner_heap` once torch
is imported (as an owner sets it as it starts, PDKV_HEAP_GUARD=1: libucs's malloc zeroed);
the whole-process threshold set there (PDKV_HEAP_GUARD=process, pdkv's guard before
2026-12-02, and its fallback off x86-64); and the same threshold from the process's start
(MALLOC_MMAP_THRESHOLD_=32768, which glibc reads as it loads). glibc
serves a request from a free heap chunk before it considers mmap, so a threshold set late
routes to mmap only what the heap's free chunks cannot serve. Prints a table: microseconds
an iteration (median, p99), the round's wall time and CPU time (user and system: less moved by
other processes' load than the wall time), and the process's minor page faults an
iteration (an allocation served by a fresh mmap is zeroed pages, faulted in on first touch).

    .venv/bin/python scripts/bench_heap_guard.py [--rounds 5] [--iterations 3000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = (1024, 2048, 4096, 8192, 16384, 32768)  # the main job's mix, tokens
CHUNK = 8192  # SGLang's default chunked prefill size
PAGE = 64
DECODE_BATCH = 64


def one_round(iterations: int, seed: int) -> dict[str, float]:
    """The loop, in this process; its figures."""
    import torch

    from transfer.lanes.ucx.nixl import protect_owner_heap

    guarded = protect_owner_heap("cpu", "0.0.0.0") or ("process" if "MALLOC_MMAP_THRESHOLD_" in os.environ else None)
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    page_table = np.arange(1 << 20, dtype=np.int64)  # the pool's slots, as SGLang's req_to_token
    outputs: list[list[int]] = [[] for _ in range(DECODE_BATCH)]
    waiting: list[list[int]] = []
    times = []
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    for _ in range(iterations):
        t0 = time.perf_counter()
        if not waiting or rng.random() < 0.25:  # a new request's message: token ids as bytes
            n = int(rng.choice(PROMPTS))
            message = rng.integers(0, 129280, n, dtype=np.int64).tobytes()
            waiting.append(np.frombuffer(message, dtype=np.int64).tolist())
        prompt = waiting[0]  # the prefill chunk of the oldest request
        chunk, waiting[0] = prompt[:CHUNK], prompt[CHUNK:]
        if not waiting[0]:
            waiting.pop(0)
        input_ids = torch.tensor(chunk, dtype=torch.int64)
        positions = torch.arange(len(chunk), dtype=torch.int64)
        start_slot = int(rng.integers(0, len(page_table) - CHUNK))
        out_cache_loc = torch.from_numpy(page_table[start_slot : start_slot + len(chunk)].copy())
        pages = np.unique(out_cache_loc.numpy() // PAGE)
        seq_lens = torch.tensor([len(o) + 1 for o in outputs], dtype=torch.int64)  # the decode batch
        decode_pos = seq_lens - 1
        decode_loc = torch.from_numpy(rng.integers(0, len(page_table), DECODE_BATCH))
        logits = torch.empty((DECODE_BATCH, 1024), dtype=torch.float32).uniform_()  # a sampler's host-side slice
        sampled = logits.argmax(dim=1).tolist()
        for out, token in zip(outputs, sampled):
            out.append(token)
            if len(out) > 512:  # a finished request's place taken by a new one
                out.clear()
        del input_ids, positions, out_cache_loc, pages, seq_lens, decode_pos, decode_loc, logits, chunk
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
    times.sort()
    return {
        "guarded": guarded,
        "p50_us": statistics.median(times) * 1e6,
        "p99_us": times[int(len(times) * 0.99)] * 1e6,
        "wall_s": wall,
        "cpu_s": cpu,
        "sys_s": usage.ru_stime - usage0.ru_stime,
        "faults": (usage.ru_minflt - usage0.ru_minflt) / iterations,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each setting, alternately")
    ap.add_argument("--iterations", type=int, default=3000, help="loop iterations a round")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(one_round(args.iterations, args.child)))
        return
    settings = {
        "off": ("off (glibc's default)", {"PDKV_HEAP_GUARD": "0"}),
        "pdkv": ("pdkv's guard (UCX's allocations zeroed)", {"PDKV_HEAP_GUARD": "1"}),
        "process": ("the whole process's (`mallopt` after torch's import)", {"PDKV_HEAP_GUARD": "process"}),
        "env": (
            "`MALLOC_MMAP_THRESHOLD_=32768` (from the start)",
            {"PDKV_HEAP_GUARD": "0", "MALLOC_MMAP_THRESHOLD_": "32768"},
        ),
    }
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
    names = list(settings)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "PDKV_HEAP_GUARD")}
            cmd = [sys.executable, __file__, "--child", str(r), "--iterations", str(args.iterations)]
            out = subprocess.run(cmd, env={**env, **settings[name][1]}, capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            assert got["guarded"] == {"off": None, "pdkv": "ucx"}.get(name, "process"), got
            rows[name].append(got)
            print(f"round {r} {name}: {got}", file=sys.stderr)
    print(f"{args.rounds} rounds of {args.iterations} iterations each, the settings in turn; medians over rounds")
    print(
        "| guard | us an iteration, p50 | p99 | s a round (min-max) | CPU s a round (of it system) "
        "| minor faults an iteration |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, (label, _) in settings.items():
        m = {
            k: statistics.median(r[k] for r in rows[name])
            for k in ("p50_us", "p99_us", "wall_s", "cpu_s", "sys_s", "faults")
        }
        walls = [r["wall_s"] for r in rows[name]]
        print(
            f"| {label} | {m['p50_us']:.0f} | {m['p99_us']:.0f} | {m['wall_s']:.2f} ({min(walls):.2f}-{max(walls):.2f})"
            f" | {m['cpu_s']:.2f} ({m['sys_s']:.2f}) | {m['faults']:.1f} |"
        )


if __name__ == "__main__":
    main()
