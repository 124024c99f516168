#!/usr/bin/env python3
"""GPU check of the same-host GPU lane's VMM path (transfer.lanes.cuda_ipc: vmm, fd_pass).

An owner process, with PyTorch's expandable segments (VMM memory), allocates SGLang-shaped
per-layer KV buffers (DSA: a 656-byte latent and a 132-byte indexer entry a token), fills
them with a pattern, exports the span they lie in as POSIX descriptors and serves them.
This process (the decode, ordinary caching allocator) fetches the descriptors, maps the
span on its device, and compares every byte of every buffer with the pattern. Then the
negative cases: a caching-allocator buffer is not VMM, and VMM memory made without the
POSIX descriptor handle type gives the typed error.

    python3 scripts/gpu_vmm_check.py [--layers 61] [--tokens 8192] [--page-size 64]
                                     [--owner-device 0] [--decode-device 0]

Prints one PASS/FAIL line per check; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LATENT_BYTES, INDEX_BYTES = 656, 132  # per token: fp8 latent + scales + rope; fp8 index key + scale
KEY = "kv"

failures: list[str] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def pattern(n: int, seed: int, device: Any) -> Any:
    """The bytes buffer `seed` holds: distinct per buffer and per position (mod 251)."""
    import torch

    i = torch.arange(n, device=device, dtype=torch.int64)
    return ((i * 131 + seed * 7919) % 251).to(torch.uint8)


def buffers_spec(layers: int, tokens: int, page_size: int) -> list[tuple[str, int, int]]:
    """(kind, layer, bytes) in SGLang's order: every latent layer, then every index layer;
    one spare page as SGLang keeps (page 0 is the padding page)."""
    pages = -(-tokens // page_size) + 1
    return [("latent", i, pages * page_size * LATENT_BYTES) for i in range(layers)] + [
        ("index", i, pages * page_size * INDEX_BYTES) for i in range(layers)
    ]


# ---------------------------------------------------------------------------- owner


def owner(args: argparse.Namespace) -> int:
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"  # before torch's CUDA init
    import torch

    from transfer.lanes.cuda_ipc import vmm as cuda_vmm
    from transfer.lanes.cuda_ipc.fd_pass import FdServer

    dev = args.owner_device
    torch.cuda.set_device(dev)
    spec = buffers_spec(args.layers, args.tokens, args.page_size)
    tensors = [torch.empty(n, dtype=torch.uint8, device=dev) for _, _, n in spec]
    for seed, t in enumerate(tensors):
        t.copy_(pattern(t.numel(), seed, t.device))
    torch.cuda.synchronize(dev)
    bufs = [(t.data_ptr(), t.numel()) for t in tensors]
    log = sys.stderr
    print(f"owner: torch {torch.__version__}, {len(bufs)} buffers, {sum(n for _, n in bufs) / 2**20:.1f} MiB", file=log)
    vmm_all = all(cuda_vmm.is_vmm(dev, p) for p, _ in bufs)
    lo, hi = min(p for p, _ in bufs), max(p + n for p, n in bufs)
    try:
        exp = cuda_vmm.export_span(dev, lo, hi)
    except cuda_vmm.VmmError as exc:
        print(json.dumps({"error": f"export_span: {exc}", "is_vmm": vmm_all}), flush=True)
        return 1
    covered = all(exp.covers(p, n) for p, n in bufs)
    chunk_check = _chunks_are_handles(cuda_vmm, dev, exp)
    straddling = sum(_chunk_of(exp, p) != _chunk_of(exp, p + n - 1) for p, n in bufs)

    async def serve() -> None:
        async with FdServer(args.secret) as server:
            server.serve(KEY, exp.fds)
            print(
                json.dumps(
                    {
                        "address": server.address,
                        "base": exp.base,
                        "chunks": exp.wire_chunks(),
                        "buffers": bufs,
                        "is_vmm": vmm_all,
                        "covered": covered,
                        "chunk_check": chunk_check,
                        "straddling": straddling,
                        "pid": os.getpid(),
                    }
                ),
                flush=True,
            )
            loop = asyncio.get_running_loop()
            eof: asyncio.Future[None] = loop.create_future()
            loop.add_reader(sys.stdin.fileno(), lambda: eof.done() or eof.set_result(None))
            await eof
            loop.remove_reader(sys.stdin.fileno())

    asyncio.run(serve())
    exp.close()
    exp.close()  # idempotent
    del tensors
    return 0


def _chunk_of(exp: Any, addr: int) -> int:
    off = addr - exp.base
    for i, c in enumerate(exp.chunks):
        if c.offset <= off < c.offset + c.size:
            return i
    return -1


def _chunks_are_handles(cuda_vmm: Any, dev: int, exp: Any) -> str:
    """Whether each exported chunk is exactly one allocation handle: the handle retained at
    its first and last granule is the same, and the one at the next chunk's start is not.
    (Handle values are opaque; equal values for one allocation is what this run shows.)"""
    vmm = cuda_vmm._Vmm.get()
    base, chunks = exp.base, exp.chunks

    def body() -> str:
        same = differ = 0
        for i, c in enumerate(chunks):
            first, last = vmm.retain(base + c.offset), vmm.retain(base + c.offset + c.size - 1)
            nxt = vmm.retain(base + c.offset + c.size) if i + 1 < len(chunks) else None
            same += first is not None and first == last
            differ += nxt is None or nxt != first
            for h in (first, last, nxt):
                if h is not None:
                    vmm.release(h)
        return f"{same}/{len(chunks)} chunks one handle first-to-last, {differ}/{len(chunks)} differ from the next"

    return str(vmm.under(dev, body))


# ---------------------------------------------------------------------------- decode


def decode(args: argparse.Namespace) -> int:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, __file__, "--role", "owner", "--secret", args.secret]
    cmd += ["--layers", str(args.layers), "--tokens", str(args.tokens), "--page-size", str(args.page_size)]
    cmd += ["--owner-device", str(args.owner_device)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        return _decode(args, proc)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        report("owner exited cleanly", proc.returncode == 0, f"rc {proc.returncode}")


def _decode(args: argparse.Namespace, proc: subprocess.Popen[str]) -> int:
    import torch

    from transfer.engine_kv import view_memory
    from transfer.lanes.cuda_ipc import vmm as cuda_vmm
    from transfer.lanes.cuda_ipc.fd_pass import close_fds, fetch_fds

    dev = args.decode_device
    torch.cuda.set_device(dev)
    device = torch.device("cuda", dev)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        report("owner published its span", False, "owner printed nothing")
        return 1
    pub = json.loads(line)
    if "error" in pub:
        report("owner exported its span", False, pub["error"])
        return 1
    n_chunks = len(pub["chunks"])
    span = pub["chunks"][-1][0] + pub["chunks"][-1][1]
    report("owner buffers are VMM (expandable segments)", pub["is_vmm"])
    report("owner span exported", True, f"{n_chunks} chunks, {span / 2**20:.1f} MiB from {pub['base']:#x}")
    report("every buffer lies in exported chunks", pub["covered"])
    print(f"info: {pub['straddling']} of {len(pub['buffers'])} buffers straddle a chunk boundary")
    print(f"info: chunk extents: {pub['chunk_check']}")

    fds_before = len(os.listdir("/proc/self/fd"))
    t0 = time.perf_counter()
    fds = asyncio.run(fetch_fds(pub["address"], KEY, args.secret, timeout=30))
    t_fetch = time.perf_counter() - t0
    report("descriptors fetched", len(fds) == n_chunks, f"{len(fds)} in {t_fetch * 1e3:.1f} ms")
    try:
        t0 = time.perf_counter()
        mapping = cuda_vmm.import_span(dev, pub["chunks"], fds, owner_base=pub["base"])
        t_map = time.perf_counter() - t0
    except cuda_vmm.VmmError as exc:
        report("span imported and mapped", False, str(exc))
        close_fds(fds)
        return 1
    close_fds(fds)  # the imported handles keep the memory; the descriptors are done
    report("span imported and mapped", True, f"{t_map * 1e3:.1f} ms at {mapping.base:#x}")

    bad: list[str] = []
    total = 0
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    copies = []
    for addr, n in pub["buffers"]:
        local = mapping.translate(addr, n)
        copies.append(view_memory(local, n, device).clone())
        total += n
    torch.cuda.synchronize(dev)
    t_read = time.perf_counter() - t0
    for seed, got in enumerate(copies):
        want = pattern(got.numel(), seed, device)
        if not torch.equal(got, want):
            wrong = int((got != want).sum().item())
            bad.append(f"buffer {seed}: {wrong} of {got.numel()} bytes differ")
    del copies
    report(
        "every byte of every buffer matches",
        not bad,
        "; ".join(bad[:5]) or f"{total / 2**20:.1f} MiB in {len(pub['buffers'])} buffers",
    )
    print(
        f"info: read {total / 2**30:.2f} GiB through the mapping in {t_read * 1e3:.1f} ms "
        f"({total / t_read / 1e9:.1f} GB/s, one clone per buffer)"
    )
    try:
        mapping.translate(pub["base"] + span, 1)
        report("translate refuses bytes past the span", False)
    except cuda_vmm.VmmError:
        report("translate refuses bytes past the span", True)
    mapping.close()
    mapping.close()  # idempotent
    report("mapping closed (twice)", mapping.closed and not mapping.handles and not mapping.mapped)
    report("no descriptors left open", len(os.listdir("/proc/self/fd")) == fds_before)

    # Negative cases, in this process (the ordinary caching allocator).
    plain = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    report("caching-allocator memory is not VMM", not cuda_vmm.is_vmm(dev, plain.data_ptr()))
    try:
        cuda_vmm.export_span(dev, plain.data_ptr(), plain.data_ptr() + plain.numel())
        report("export of non-VMM memory refused", False)
    except cuda_vmm.VmmError as exc:
        report("export of non-VMM memory refused", True, str(exc))
    ptr, free = cuda_vmm.create_unshareable(dev, 4 << 20)
    try:
        report("cuMemCreate'd memory is VMM", cuda_vmm.is_vmm(dev, ptr))
        try:
            cuda_vmm.export_span(dev, ptr, ptr + (4 << 20))
            report("export without the POSIX handle type refused", False)
        except cuda_vmm.VmmError as exc:
            report("export without the POSIX handle type refused", "POSIX" in str(exc), str(exc))
    finally:
        free()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    ap.add_argument("--role", choices=["decode", "owner"], default="decode")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--owner-device", type=int, default=0)
    ap.add_argument("--decode-device", type=int, default=0)
    ap.add_argument("--secret", default=os.urandom(16).hex())
    args = ap.parse_args()
    if args.role == "owner":
        return owner(args)
    print(
        f"check: {args.layers} layers, {args.tokens} tokens, page {args.page_size}, "
        f"owner cuda:{args.owner_device} -> decode cuda:{args.decode_device}",
        flush=True,
    )
    rc = decode(args)
    print(f"{'FAIL' if failures or rc else 'PASS'} overall ({len(failures)} failed: {', '.join(failures)})")
    return 1 if failures or rc else 0


if __name__ == "__main__":
    sys.exit(main())
