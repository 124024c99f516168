"""Where SGLang's receiver spends the time from `send_metadata` to the poll that says Success.

Runs `scripts/bench_sglang.py` (same arguments) with stamps on the decode's path, in this
process: the hand-over to pdkv's thread, the read laid out ahead (`_prepared_read`, and
whether it was made again), the GPU lane's empty kernel (`prime`), the launch (`start`, and
the kernel launch inside it), the read's own seconds (`FetchResult.seconds`, from its start
on pdkv's thread to its proof) and the poll that saw Success. Prints microseconds from
`read_claimed`'s call, p50 (p10-p90) over every room read through the receiver. The
stamps wrap methods, so each costs a little time of its own.

    python3 scripts/trace_sglang.py --device cuda --sizes 8192 --runs 20 [--primes off]
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import scripts.bench_sglang as bench  # noqa: E402
from transfer.decode.lease import RoomLease  # noqa: E402
from transfer.decode.tickets import TicketProtocol  # noqa: E402
from transfer.sync import SyncFetcher  # noqa: E402

STEPS = (
    ("returned", "read_claimed returned (send_metadata's own hand-over)"),
    ("loop<", "read_once began on pdkv's thread"),
    ("prepared>", "the read laid out ahead was checked"),
    ("remade", "... and made again (an owner's state changed since the claim)"),
    ("prime<", "the empty kernel asked for"),
    ("prime>", "... queued"),
    ("start<", "the lane's launch began (ids bounded)"),
    ("kernel<", "the kernel launch began (ids routed)"),
    ("kernel>", "... returned"),
    ("read", "the read's own seconds (its start to its proof), a duration"),
    ("loop>", "read_once returned on pdkv's thread"),
    ("seen", "the poll that said Success returned"),
    ("finish", "that poll's own time, a duration"),
)


def _stamp(stamps: dict[str, float], cls: type, name: str, key: str) -> None:
    """Stamp the first call of `cls.name` after `send_metadata` (its start `key<`, end `key>`)."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def stamped(*args: Any, **kwargs: Any) -> Any:
        if "call" in stamps:
            stamps.setdefault(f"{key}<", time.perf_counter())
        try:
            return original(*args, **kwargs)
        finally:
            if "call" in stamps:
                stamps.setdefault(f"{key}>", time.perf_counter())

    setattr(cls, name, stamped)


def _stamp_async(stamps: dict[str, float], cls: type, name: str, key: str) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    async def stamped(*args: Any, **kwargs: Any) -> Any:
        stamps.setdefault(f"{key}<", time.perf_counter())
        try:
            return await original(*args, **kwargs)
        finally:
            stamps.setdefault(f"{key}>", time.perf_counter())

    setattr(cls, name, stamped)


def _instrument(stamps: dict[str, float], rows: list[dict[str, float]]) -> None:
    finish: dict[str, float] = {}  # the poll that said Success: its own microseconds
    original_read_claimed = SyncFetcher.read_claimed

    def read_claimed(self: SyncFetcher, *args: Any, **kwargs: Any) -> Any:
        stamps["call"] = time.perf_counter()
        handle = original_read_claimed(self, *args, **kwargs)
        stamps["returned"] = time.perf_counter()
        return handle

    SyncFetcher.read_claimed = read_claimed  # type: ignore[method-assign]
    from sglang.srt.disaggregation.base.conn import KVPoll

    from transfer.sglang.receiver import PdkvKVReceiver

    poll = PdkvKVReceiver.poll

    def timed_poll(self: PdkvKVReceiver) -> int:
        t0 = time.perf_counter()
        state = poll(self)
        if "call" in stamps and state == KVPoll.Success:
            finish.setdefault("finish", (time.perf_counter() - t0) * 1e6)
        return state

    PdkvKVReceiver.poll = timed_poll  # type: ignore[method-assign]
    _stamp_async(stamps, RoomLease, "read_once", "loop")
    _stamp(stamps, RoomLease, "_prepared_read", "prepared")
    _stamp(stamps, TicketProtocol, "prepare", "remade")
    if "cuda" in sys.argv:
        from transfer.lanes.cuda_ipc.gather import Gatherer
        from transfer.lanes.cuda_ipc.lane import CudaIpcLane, GatherBatch

        _stamp(stamps, CudaIpcLane, "prime", "prime")
        _stamp(stamps, GatherBatch, "start", "start")
        _stamp(stamps, Gatherer, "launch_pages", "kernel")
    receive = bench._receive

    def timed_receive(*args: Any, **kwargs: Any) -> Any:
        stamps.clear()
        finish.clear()
        seen, result = receive(*args, **kwargs)
        t0 = stamps.pop("call")
        row = {k: (v - t0) * 1e6 for k, v in stamps.items()}
        row["remade"] = row.get("remade<", float("nan"))
        rows.append(row | finish | {"read": result.seconds * 1e6, "seen": seen * 1e6})
        return seen, result

    bench._receive = timed_receive


def _without_primes() -> None:
    """`--primes off`: the GPU lane queues no empty kernel ahead of a read."""
    from transfer.lanes.cuda_ipc.lane import CudaIpcLane

    init = CudaIpcLane.__init__

    def without_primes(self: CudaIpcLane, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.primes = False

    CudaIpcLane.__init__ = without_primes  # type: ignore[method-assign]


def _print(rows: list[dict[str, float]]) -> None:
    print(f"us from read_claimed's call (SGLang's send_metadata), p50 (p10-p90) over {len(rows)} rooms")
    for key, what in STEPS:
        values = sorted(r[key] for r in rows if key in r and r[key] == r[key])
        if values:
            p10, p90 = values[len(values) // 10], values[(9 * len(values)) // 10]
            print(f"{key:>10} {statistics.median(values):8.0f} ({p10:.0f}-{p90:.0f})  {what}")
        elif key == "remade":
            print(f"{key:>10} {'never':>8}  {what}")


def main() -> None:
    if "--primes" in sys.argv:  # this script's own option; the rest are bench_sglang's
        i = sys.argv.index("--primes")
        if sys.argv[i + 1 : i + 2] == ["off"]:
            _without_primes()
        del sys.argv[i : i + 2]
    stamps: dict[str, float] = {}
    rows: list[dict[str, float]] = []
    _instrument(stamps, rows)
    try:
        bench.main()
    finally:
        _print(rows)


if __name__ == "__main__":
    main()
