"""Run a function on every rank of a real gloo process group, in spawned processes."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from tests import children

GROUP_TIMEOUT_S = 120


def _entry(fn: Callable[..., Any], rank: int, world: int, init_file: str, results: Any, args: tuple) -> None:
    import datetime

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )
        out = fn(rank, world, *args)
        dist.barrier()
        results.put((rank, "ok", out))
    except BaseException:  # report everything to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(fn: Callable[..., Any], world: int, *args: Any) -> dict[int, Any]:
    """Run `fn(rank, world, *args)` on `world` spawned ranks; return each rank's result."""
    ctx = children.context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init_file, results, args)) for r in range(world)]
        for p in procs:
            p.start()
        outcome: dict[int, Any] = {}
        try:
            for _ in range(world):
                rank, status, value = results.get(timeout=GROUP_TIMEOUT_S)
                if status != "ok":
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                outcome[rank] = value
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join()
    for p in procs:
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    return outcome
