"""The settings an SGLang operator has (PDKV_SGLANG_*), and what pdkv changes in SGLang's
processes (the UCX environment, the owner heap guard) with their switches; a release of
SGLang or CUDA builds pdkv does not serve are refused at start (docs/sglang.md)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang.srt.disaggregation.base.conn  # noqa: F401
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")

from pdkv.errors import LayoutError  # noqa: E402
from tests.test_sglang import LAYERS, _kv_args  # noqa: E402
from transfer.lanes.ucx import nixl  # noqa: E402
from transfer.sglang import plugin, runtime  # noqa: E402
from transfer.sglang.conn import PdkvKVBootstrapServer, PdkvKVManager  # noqa: E402
from transfer.sglang.topology import environment  # noqa: E402

SETTINGS = ("PDKV_SGLANG_UCX_WORKERS", "PDKV_SGLANG_LANE", "PDKV_SGLANG_OWNER_PROGRESS_MS")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def registry():
    server = PdkvKVBootstrapServer("127.0.0.1", 0)
    yield server.url
    server.close()


def _manager(env: pytest.MonkeyPatch, mode: str, registry: str = "") -> PdkvKVManager:
    for name, value in environment(registry, 0, 1, LAYERS, "cpu").items():
        env.setenv(name, value)
    args, keep = _kv_args(range(LAYERS), fill=mode == "prefill")
    mgr = PdkvKVManager(args, mode, server_args=None, is_mla_backend=True)
    mgr._keep = keep  # the tensors behind KVArgs' addresses live as long as the manager
    return mgr


@pytest.mark.parametrize("ms", [None, "1", "2.5"])
def test_owner_progress_interval(env, registry, ms):
    if ms is not None:
        env.setenv("PDKV_SGLANG_OWNER_PROGRESS_MS", ms)
    mgr = _manager(env, "prefill", registry)
    try:
        exporter = mgr.exporter.exporter  # the PrefillExporter its progress loop runs in
        want = 0.01 if ms is None else float(ms) / 1e3
        assert exporter.timeouts.progress_interval == pytest.approx(want)
        # unset: while read, by transport (this loopback rank needs no faster driving)
        assert exporter.timeouts.reading_progress_interval(over_tcp=False) == pytest.approx(want)
    finally:
        mgr.close()


@pytest.mark.parametrize(("workers", "lane"), [(None, None), ("3", "ucx"), ("1", "auto")])
def test_decode_workers_and_lane(env, workers, lane):
    if workers is not None:
        env.setenv("PDKV_SGLANG_UCX_WORKERS", workers)
    if lane is not None:
        env.setenv("PDKV_SGLANG_LANE", lane)
    mgr = _manager(env, "decode")
    try:
        fetcher = mgr.fetcher("127.0.0.1:9").result(timeout=60).fetcher  # nothing listens: not asked yet
        want = int(workers) if workers is not None else nixl.default_workers("DRAM")
        assert len(fetcher.transport._workers) == want  # UCX workers made, each an agent
        assert fetcher.lane == (lane or "auto")
    finally:
        mgr.close()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PDKV_SGLANG_UCX_WORKERS", "0"),
        ("PDKV_SGLANG_UCX_WORKERS", "many"),
        ("PDKV_SGLANG_LANE", "rdma"),
        ("PDKV_SGLANG_LANE", "cuda_ipc"),  # a decode on the CPU
        ("PDKV_SGLANG_PATH", "ucx"),  # the old name: refused, not ignored
        ("PDKV_SGLANG_OWNER_PROGRESS_MS", "0"),
        ("PDKV_SGLANG_OWNER_PROGRESS_MS", "fast"),
    ],
)
def test_bad_settings_refused_at_start(env, name, value):
    env.setenv(name, value)
    with pytest.raises(LayoutError, match=name):
        _manager(env, "decode")


def test_other_sglang_release_refused(env, monkeypatch):
    real = runtime.importlib.metadata.version
    monkeypatch.setattr(runtime.importlib.metadata, "version", lambda d: "0.5.24" if d == "sglang" else real(d))
    plugin.check_runtime.cache_clear()
    try:
        with pytest.raises(plugin.UnsupportedSGLangError, match=r"0\.5\.24.*sglang==0\.5\.23"):
            _manager(env, "decode")
    finally:
        plugin.check_runtime.cache_clear()


def test_cuda_build_mismatch_refused(env, monkeypatch):
    """A CUDA 13 torch with only nixl-cu12 installed (what `pip install pdkv` gives over
    sglang 0.5.23's stack without the cu13 extra) is refused before any transfer."""
    assert nixl.importlib.util.find_spec("nixl_cu13") is None, "this test expects only nixl-cu12 installed"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    plugin.check_runtime.cache_clear()
    try:
        with pytest.raises(nixl.BuildMismatchError, match=r"CUDA 13\.0.*nixl-cu12.*pdkv\[cu13\]"):
            _manager(env, "decode")
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        nixl.check_cuda_builds()  # the build it has
    finally:
        plugin.check_runtime.cache_clear()


# ---- what pdkv changes in the process --------------------------------------------------------


def _run(code: str, **env: str) -> str:
    """`code` in a fresh interpreter (glibc's and UCX's settings are process-wide); its stdout + stderr."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "PDKV_HEAP", "PDKV_UCX", "MALLOC_"))}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


# glibc marks a chunk it served by mmap in the size word before it (IS_MMAPPED, 0x2). Free
# chunks on the heap or its top serve some requests whatever the threshold: count over many.
_MMAPPED = """
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    def mmapped(n=100_000, times=50):
        ptrs = [libc.malloc(n) for _ in range(times)]
        flags = [ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2 for p in ptrs]
        for p in ptrs:
            libc.free(ctypes.c_void_p(p))
        return sum(1 for f in flags if f)
"""


@pytest.mark.parametrize(
    ("setting", "host", "installed"),
    [
        ("auto", "0.0.0.0", True),  # other hosts may read it, no RDMA device here: over tcp
        ("auto", "127.0.0.1", False),  # its readers share its host: cma
        ("0", "0.0.0.0", False),
        ("1", "127.0.0.1", True),
    ],
)
def test_heap_guard_where_tcp_serves_an_owner(setting, host, installed):
    out = _run(
        _MMAPPED
        + f"""
    from transfer.lanes.ucx.nixl import protect_owner_heap
    assert mmapped() == 0  # glibc's default threshold is 128 KiB
    print("set", protect_owner_heap("cpu", {host!r}), "mmapped", mmapped() > 25)
    """,
        PDKV_HEAP_GUARD=setting,
    )
    # UCX's own allocations zeroed where TCP serves; the rest of the process keeps glibc's heap
    assert f"set {'ucx' if installed else None} mmapped False" in out


def test_heap_guard_rule(monkeypatch):
    for name in ("UCX_TLS", "UCX_MODULES", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "PDKV_UCX_ENV"):
        monkeypatch.delenv(name, raising=False)
    assert nixl.heap_guard_reason("cpu", "10.0.0.5") is not None  # no RDMA device here
    assert nixl.heap_guard_reason("cpu", "::1") is None
    assert nixl.heap_guard_reason("cuda", "127.0.0.1") is None  # the GPU lane and cuda_ipc (zero-copy: pdkv's)
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
    assert nixl.heap_guard_reason("cuda", "127.0.0.1") is not None  # cuda_ipc GET emulated over tcp
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    monkeypatch.setenv("PDKV_UCX_ENV", "0")
    assert nixl.heap_guard_reason("cuda", "127.0.0.1") is not None  # pdkv does not turn zero-copy on
    monkeypatch.delenv("PDKV_UCX_ENV")
    monkeypatch.setenv("UCX_TLS", "^tcp")
    assert nixl.heap_guard_reason("cpu", "0.0.0.0") is None
    monkeypatch.setenv("UCX_TLS", "rc,cuda_ipc,cuda_copy,sm,self")
    assert nixl.heap_guard_reason("cuda", "0.0.0.0") is None  # RDMA and same-host only
    monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy")
    assert nixl.heap_guard_reason("cpu", "127.0.0.1") is not None  # tcp asked for, even on loopback


def test_ucx_environment_and_no_warning_on_cpu():
    code = """
    import os
    from transfer.lanes.ucx.transport import UcxTransport
    t = UcxTransport("probe", workers=1)
    print(sorted(k for k in os.environ if k.startswith("UCX_")))
    """
    out = _run(code)
    assert "UCX  WARN" not in out, out  # the CPU build has no cuda_ipc to read a variable for it
    assert "'UCX_MODULES', 'UCX_TCP_CONN_NB', 'UCX_TCP_KEEPCNT', 'UCX_TCP_KEEPIDLE', 'UCX_TCP_KEEPINTVL'" in out
    assert "[]" in _run(code, PDKV_UCX_ENV="0")  # pdkv leaves the environment alone
    assert "'UCX_TCP_KEEPIDLE'" in _run(code, UCX_TCP_KEEPIDLE="5s")  # an operator's value stands
