"""How long the synchronous surface holds a scheduler's thread: each call's duration.

An exporter and a fetcher (`transfer.sync`) on their own threads, a tiny layout, real UCX
between them in this process. A scheduler-like loop publishes rooms, marks their layers
ready, fetches them by ticket and by claims and polls the handles; every call into pdkv
is timed. Prints p50 / p99 / max in microseconds per call.

    .venv/bin/python scripts/bench_sync.py [--rooms 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdkv import DSAKVPool, tiny  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402
from transfer.metadata import RoomTicket  # noqa: E402
from transfer.registry.server import RegistryServer  # noqa: E402
from transfer.sync import BackgroundLoop, HandleStatus, SyncExporter, SyncFetcher  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--rooms", type=int, default=200)
    args = ap.parse_args()
    layout = tiny(layer_num=8, size=8192)
    bg = BackgroundLoop("bench-registry")
    server = RegistryServer()
    url = bg.run(server.start(), 10)
    exporter = SyncExporter(DSAKVPool(layout), "bench", 0, 1, url)
    fetcher = SyncFetcher(DSAKVPool(layout), url, ucx_workers=1)
    calls: dict[str, list[float]] = defaultdict(list)

    def timed(name, fn, *a, **k):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = fn(*a, **k)
        calls[name].append(time.perf_counter() - t0)
        return out

    def wait(handle):  # type: ignore[no-untyped-def]
        while timed("Handle.poll", handle.poll) is HandleStatus.PENDING:
            time.sleep(0.0002)
        return handle.result()

    try:
        rng = np.random.default_rng(0)
        for room in range(args.rooms):
            src = rng.choice(np.arange(1, layout.num_pages), 16, replace=False)
            wait(timed("SyncExporter.publish_room", exporter.publish_room, room, src))
            for layer in range(layout.layer_num):
                timed("SyncExporter.mark_ready", exporter.mark_ready, room, layer + 1)
            dst = rng.choice(np.arange(1, layout.num_pages), 16, replace=False)
            if room % 2:
                wait(timed("SyncFetcher.fetch (claims)", fetcher.fetch, "bench", room, dst))
            else:
                pin = wait(timed("SyncExporter.pin", exporter.pin, room))
                ticket = RoomTicket(engine_id="bench", room=room, src_pages=src.tolist(), pins=[pin])
                wait(timed("SyncFetcher.fetch (ticket)", fetcher.fetch, "bench", room, dst, ticket=ticket))
    finally:
        fetcher.close()
        exporter.close()
        bg.run(server.aclose(), 10)
        bg.stop()
    print(f"{args.rooms} rooms, tiny layout; time each call held the calling thread, microseconds")
    print(f"{'call':<30}{'calls':>8}{'p50':>8}{'p99':>8}{'max':>8}")
    for name, samples in calls.items():
        us = sorted(x * 1e6 for x in samples)
        p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
        print(f"{name:<30}{len(us):>8}{statistics.median(us):>8.1f}{p99:>8.1f}{us[-1]:>8.1f}")


if __name__ == "__main__":
    main()
