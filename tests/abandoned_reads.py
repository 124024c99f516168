"""The two sides of `tests/test_abandoned_reads.py`, each run as `python -m` on its stand-in host.

owner PATH MIB: a UCX transport with MIB MiB of a known pattern registered; its connection
blob and regions written to PATH; then progressed until killed (over TCP a GET is answered
only as the owner progresses).

decode PATH MIB DIR: READs of the whole buffer in pieces on two workers, started 0.15 s apart,
with a short `read_stall`; once every READ has ended it writes DIR/ended (what each raised),
waits for DIR/back (the link is up again), connects the owner anew as a fetcher would, and for
WATCH_S keeps both workers busy with READs into a scratch buffer while it watches the first
buffer; DIR/result holds whether it changed, and how many agents were dropped.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

from transfer.deadline import Deadline
from transfer.lanes.ucx.plan import ReadPlan
from transfer.lanes.ucx.transport import UcxTransport
from transfer.timeouts import Timeouts

WATCH_S = 5.0
READ_STALL_S = 3.0
PAGE = 4096


def pattern(nbytes: int) -> torch.Tensor:
    return (torch.arange(nbytes, dtype=torch.int64) * 7 + 3).to(torch.uint8)


def rows(base: int, remote_base: int, start: int, nbytes: int) -> ReadPlan:
    """Page-sized descriptors of [start, start + nbytes) of a buffer at `base` from one at `remote_base`."""
    offsets = start + np.arange(nbytes // PAGE, dtype=np.int64) * PAGE
    local = np.stack([base + offsets, np.full_like(offsets, PAGE), np.zeros_like(offsets)], 1)
    remote = local.copy()
    remote[:, 0] = remote_base + offsets
    return ReadPlan(local, remote, nbytes)


async def owner(path: Path, mib: int) -> None:
    transport = UcxTransport("owner")
    buf = pattern(mib << 20)
    transport.register([buf])
    path.with_suffix(".tmp").write_bytes(pickle.dumps((transport.agent_metadata(), [(buf.data_ptr(), buf.nbytes)])))
    path.with_suffix(".tmp").rename(path)
    while True:
        await transport.progress()
        await asyncio.sleep(0.0005)


async def decode(path: Path, mib: int, out: Path) -> None:
    metadata, regions = pickle.loads(path.read_bytes())
    transport = UcxTransport("decode", workers=2, timeouts=Timeouts(read_stall=READ_STALL_S))
    dst, scratch = torch.zeros(mib << 20, dtype=torch.uint8), torch.zeros(64 * PAGE, dtype=torch.uint8)
    transport.register([dst, scratch])
    await transport.add_peer("owner", metadata, regions)
    remote_base, piece = regions[0][0], dst.nbytes // 4

    async def read(i: int) -> str:
        await asyncio.sleep(0.15 * i)
        try:
            await transport.read("owner", rows(dst.data_ptr(), remote_base, i * piece, piece), Deadline.after(60))
            return "done"
        except Exception as exc:
            return type(exc).__name__

    (out / "started").touch()
    ended = await asyncio.gather(*(read(i) for i in range(4)))
    at_end = dst.clone()
    (out / "ended").write_text(json.dumps(ended))
    while not (out / "back").exists():
        await asyncio.sleep(0.05)
    await transport.remove_peer("owner")  # as a fetcher forgets a lost engine's peers, and connects anew
    await transport.add_peer("owner", metadata, regions)
    watch = time.monotonic() + WATCH_S
    reads = 0
    while time.monotonic() < watch:
        halves = [rows(scratch.data_ptr(), remote_base, k * 32 * PAGE, 32 * PAGE) for k in range(2)]
        await asyncio.gather(*(transport.read("owner", h, Deadline.after(5)) for h in halves))
        reads += 2
    scratch_ok = torch.equal(scratch, pattern(dst.nbytes)[: scratch.nbytes])
    drops = sum(w.drops for w in transport._workers)
    result = {"changed": int((dst != at_end).sum()), "drops": drops, "reads": reads, "scratch_ok": scratch_ok}
    (out / "result").write_text(json.dumps(result))
    await transport.aclose()


if __name__ == "__main__":
    role, where, mib = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    asyncio.run(owner(where, mib) if role == "owner" else decode(where, mib, Path(sys.argv[4])))
