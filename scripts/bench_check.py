"""The main job's decode check: page sums against the byte compare, on one request.

Writes a request's stand-in KV into a `dsa_v32` pool on fragmented pages (with a shared
prefix), then checks it both ways and prints seconds and GB/s of each.

    python3 scripts/bench_check.py [--tokens 32768]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import transfer.app.synthetic as synthetic  # noqa: E402
from pdkv import DSAKVPool, dsa_v32  # noqa: E402
from transfer.app.options import HelpFormatter  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    n = ap.parse_args().tokens
    pool = DSAKVPool(dsa_v32(size=2 * n))
    alloc = synthetic.fragmented_allocator(pool.layout.num_pages, 3)
    pages = torch.from_numpy(alloc.alloc(-(-n // pool.layout.page_size)))
    content = synthetic.RequestContent(11, n - 5, prefix_seed=5, prefix_tokens=n // 8)  # a partial last page
    loc = synthetic.token_locations(pool.layout, pages, n - 5)
    for layer in range(pool.layout.layer_num):
        data = content.layer(pool.layout, layer, scratch=True)
        pool.set_kv_buffer(layer, loc, data.kv_rows(pool.layout))
        pool.set_index_k_and_scale(layer, loc, data.index_k, data.index_scale)
    nbytes = (n - 5) * pool.layout.layer_num * (pool.layout.kv_token_bytes + pool.layout.index_token_bytes)
    print(f"{n - 5} tokens, {nbytes / 1e9:.2f} GB, best of 3")
    summable = synthetic._summable
    for name, how in (("page sums", summable), ("byte compare", lambda pool: False)):
        synthetic._summable = how
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            assert content.mismatched_layers(pool, pages) == []
            best = min(best, time.perf_counter() - t0)
        print(f"{name:<14}{best:8.3f} s{nbytes / best / 1e9:8.2f} GB/s")
    synthetic._summable = summable


if __name__ == "__main__":
    main()
