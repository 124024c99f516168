"""The owner heap guard (`protect_owner_heap`, docs/between-hosts.md): UCX's own allocations
come zeroed and the rest of the process keeps glibc's heap as it was; a UCX READ through the
guarded libucs still moves its bytes. Each case in a fresh interpreter (what it changes is
process-wide)."""

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from transfer.lanes.ucx import nixl

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or platform.libc_ver()[0] != "glibc", reason="the UCX guard is x86-64 glibc only"
)

# A block freed to the heap, dirty, is what a next allocation of its size gets back unless
# that allocation comes zeroed. glibc marks a chunk it served by mmap (IS_MMAPPED, 0x2) in
# the size word before it.
_PROBE = """
    import ctypes, os
    from transfer.lanes.ucx import nixl
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    def mmapped(n=100_000, times=50):
        ptrs = [libc.malloc(n) for _ in range(times)]
        flags = [ctypes.c_size_t.from_address(p - 8).value & 2 for p in ptrs]
        for p in ptrs:
            libc.free(ctypes.c_void_p(p))
        return sum(1 for f in flags if f)
    def ucx_dirty(n=41_044, times=50):
        ucs = ctypes.CDLL(str(nixl._libucs_path()))
        ucs.ucs_malloc.restype = ctypes.c_void_p
        ucs.ucs_malloc.argtypes = [ctypes.c_size_t, ctypes.c_char_p]
        dirty = 0
        for _ in range(times):
            p = libc.malloc(n)
            ctypes.memset(p, 0xFF, n)
            libc.free(ctypes.c_void_p(p))
            q = ucs.ucs_malloc(n, b"probe")
            dirty += any(ctypes.string_at(q, n))
            ucs.ucs_free(ctypes.c_void_p(q))
        return dirty
    def pool_dirty(n=41_044, times=50):
        # UCP's request pool takes its chunks from ucs_mpool_hugetlb_malloc (a SysV huge
        # page, else ucs_malloc). A stand-in pool whose every field points at its name.
        ucs = ctypes.CDLL(str(nixl._libucs_path()))
        name = ctypes.c_char_p(b"probe")
        data = (ctypes.c_void_p * 32)(*[ctypes.cast(name, ctypes.c_void_p).value] * 32)
        mp = (ctypes.c_void_p * 2)(None, ctypes.addressof(data))
        dirty = 0
        for _ in range(times):
            p = libc.malloc(n)
            ctypes.memset(p, 0xFF, n)
            libc.free(ctypes.c_void_p(p))
            size, chunk = ctypes.c_size_t(n), ctypes.c_void_p()
            assert ucs.ucs_mpool_hugetlb_malloc(mp, ctypes.byref(size), ctypes.byref(chunk)) == 0
            dirty += any(ctypes.string_at(chunk.value, size.value))
            ucs.ucs_mpool_hugetlb_free(mp, chunk)
        return dirty
    guard = nixl.protect_owner_heap("cpu", "0.0.0.0")
"""


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "PDKV_HEAP", "PDKV_UCX", "MALLOC_"))}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_PROBE) + textwrap.dedent(code)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize(
    ("setting", "guard", "heap_mmapped", "ucx_zeroed"),
    [
        ("1", "ucx", False, True),  # the default guard: UCX's allocations zeroed
        ("ucx", "ucx", False, True),  # UCX's allocations zeroed, and only those
        ("process", "process", True, False),  # the whole process's threshold; a freed heap block still serves UCX
        ("0", "None", False, False),
    ],
)
def test_the_guard_zeroes_ucx_allocations_and_leaves_the_heap_alone(setting, guard, heap_mmapped, ucx_zeroed):
    code = 'print("guard", guard, "mmapped", mmapped(), "dirty", ucx_dirty(), "pool", pool_dirty())'
    words = _run(code, PDKV_HEAP_GUARD=setting).split()
    got = {k: words[words.index(k) + 1] for k in ("guard", "mmapped", "dirty", "pool")}
    assert got["guard"] == guard, got
    assert (int(got["mmapped"]) > 25) == heap_mmapped, got  # glibc's default threshold is 128 KiB
    assert (int(got["dirty"]) == 0) == ucx_zeroed, got  # 50 blocks dirtied, freed, then asked for by UCX
    if ucx_zeroed or Path("/proc/sys/vm/nr_hugepages").read_text().strip() == "0":  # a huge page comes zeroed
        assert (int(got["pool"]) == 0) == ucx_zeroed, got  # the same, asked for as a request pool's chunk


def test_a_ucx_read_through_the_guarded_libucs_moves_its_bytes():
    out = _run(
        """
    import torch
    assert guard == "ucx"
    m = nixl.load_nixl()
    owner, reader = (m.nixl_agent(n, m.nixl_agent_config(backends=["UCX"])) for n in ("owner", "reader"))
    src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    owner.register_memory([src])
    reader.register_memory([dst])
    peer = reader.add_remote_agent(owner.get_agent_metadata())
    item = 41_984
    n = src.numel() // item
    local = reader.get_xfer_descs([(dst.data_ptr() + i * item, item, 0) for i in range(n)], "DRAM")
    remote = reader.get_xfer_descs([(src.data_ptr() + i * item, item, 0) for i in range(n)], "DRAM")
    handle = reader.initialize_xfer("READ", local, remote, peer)
    reader.transfer(handle)
    while reader.check_xfer_state(handle) == "PROC":
        owner.get_new_notifs()
    maps = {line.split()[-1] for line in open("/proc/self/maps") if "/libucs" in line}
    same = torch.equal(src[: n * item], dst[: n * item])
    print("same", same, "libucs", len(maps), maps == {str(nixl._libucs_path())})
    """,
        PDKV_HEAP_GUARD="ucx",
        UCX_TLS="tcp",  # the emulated GET the guard is for
    )
    assert "same True libucs 1 True" in out, out


def test_got_slots_are_read_from_the_elf_file(tmp_path):
    libucs = nixl._libucs_path()
    assert libucs is not None and nixl._got_offsets(libucs, "malloc")
    assert nixl._got_offsets(libucs, "no_such_symbol") == []
    (tmp_path / "x.so").write_bytes(b"not an ELF file")
    assert nixl._got_offsets(tmp_path / "x.so", "malloc") == []
