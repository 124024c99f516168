"""The same-host GPU lane over buffers an engine owns: now `bench_fetch.py --engine-buffers`.

Kept so that the commands in README.md and docs/benchmarks.md still run: this runs

    scripts/bench_fetch.py --device cuda --engine-buffers --sizes S --runs R [--vmm]

which reads CP=4 owners of SGLang-shaped per-layer CUDA allocations (61 layers, latent and
indexer) with a ticket, by claims and claimed ahead, and compares each row with the pool
lane's back-to-back fetches of the same call. `--vmm` now adds rows from owners on
expandable segments (it used to replace the per-layer owners with them); each row names
the path that moved the bytes.

    python3 scripts/bench_engine_lane.py [--sizes 8192,32768] [--runs 5] [--vmm]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fetch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8192,32768")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--vmm", action="store_true", help="also owners on expandable segments (VMM memory)")
    args = ap.parse_args()
    argv = ["--device", "cuda", "--engine-buffers", "--sizes", args.sizes, "--runs", str(args.runs)]
    sys.argv = [str(Path(bench_fetch.__file__)), *argv, *(["--vmm"] if args.vmm else [])]
    bench_fetch.main()


if __name__ == "__main__":
    main()
