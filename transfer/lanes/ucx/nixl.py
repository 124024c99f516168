"""NIXL, loaded with UCX configured first; its errors in the pdkv tree; an owner's heap guard.

What this module changes in the process that hosts pdkv (docs/sglang.md, "What pdkv
changes in SGLang's processes"), each with its switch:

    UCX_* variables   set (where unset) before NIXL loads UCX      PDKV_UCX_ENV=0: none set
    libucs's malloc made calloc in an owner read over TCP          PDKV_HEAP_GUARD=0|1|auto|ucx|process
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.metadata
import importlib.util
import ipaddress
import logging
import mmap
import os
import platform
import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from pdkv.errors import PdkvError, PeerLostError, TransferError

logger = logging.getLogger(__name__)

_OFF = ("0", "false", "no", "off")
_NIXL_BUILDS = {12: "nixl_cu12", 13: "nixl_cu13"}  # module by CUDA major; the pip name has a dash


class BuildMismatchError(PdkvError, RuntimeError):
    """The installed NIXL or CUDA bindings are built for another CUDA than torch: refused at
    start, rather than failing at the first transfer (`pip install 'pdkv[cu<N>]'`)."""


def quietly(fn: Callable[[], Any]) -> None:
    """Run `fn` on a worker's thread for its side effect; a failure is logged, not raised."""
    try:
        fn()
    except Exception as exc:
        logger.debug("%s: %s", getattr(fn, "__name__", fn), exc)


def _ib_devices() -> bool:
    ib = Path("/sys/class/infiniband")
    return ib.exists() and any(ib.iterdir())


def configure_ucx_environment() -> None:
    """UCX settings that must be in place before NIXL loads UCX; a variable already set wins,
    and with PDKV_UCX_ENV=0 none is set (the process's environment stays the operator's).

    Without InfiniBand devices the bundled libnl crashed every NIXL process at exit
    (seen with nixl-cu12 1.5.1); excluding the ib module avoids that and costs nothing
    where no IB exists. On one GPU without NVLink, UCX disables cuda_ipc zero-copy GET
    and falls back to a slow emulation; turn it on explicitly (only where CUDA is: without
    it UCX warns in every process that the variable is unused).

    Between hosts over TCP, a cut link stalls a READ with no error at all (TCP retransmits
    quietly) until the READ's own deadline, a minute later; and a READ abandoned then still
    landed its bytes once the link came back (seen between network namespaces). With TCP
    keepalive probes after 1 s of silence, given up after two unanswered ones, UCX fails an
    idle endpoint about 3 s after the cut and the READ ends `PeerLostError` (that nothing of a
    READ in flight lands later is the worker's doing: `Worker` drops its agent). The probes
    are answered by the peer's kernel, so a busy owner is not taken for a dead one.
    """
    if os.environ.get("PDKV_UCX_ENV", "").lower() in _OFF:
        return
    if "UCX_MODULES" not in os.environ and not _ib_devices():
        os.environ["UCX_MODULES"] = "^ib"
    if torch.cuda.is_available():
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    # A blocking TCP connect to a cut host held a worker's thread, and every READ queued on
    # it, for 73 s (SYN retries): connect in the background; a READ on an endpoint that never
    # connects ends at `read_stall`.
    os.environ.setdefault("UCX_TCP_CONN_NB", "y")
    os.environ.setdefault("UCX_TCP_KEEPIDLE", "1s")
    os.environ.setdefault("UCX_TCP_KEEPINTVL", "1s")
    os.environ.setdefault("UCX_TCP_KEEPCNT", "2")


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_OWNER_MMAP_THRESHOLD = 32 << 10


def _ucx_list(name: str) -> tuple[bool, set[str]] | None:
    """A UCX list variable as (excluding, names); None where unset or "all"."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "all"):
        return None
    excluding = value.startswith("^")
    return excluding, {v.strip() for v in value.lstrip("^").split(",") if v.strip()}


def _on(value: str | None) -> bool:
    return (value or "").lower() in ("y", "yes", "on", "1", "true")


def heap_guard_reason(device: str = "cpu", bind_host: str | None = None) -> str | None:
    """Why an owner with memory on `device` ("cpu" or "cuda"), serving its control plane on
    `bind_host`, may have its READs answered over UCX's TCP transport; None where it cannot.

    The rule: no TCP where `UCX_TLS` rules tcp out; TCP where it names tcp; else none where
    the owner binds loopback (its readers share its host and network namespace: cma, shared
    memory or cuda_ipc, unless a GPU owner's cuda_ipc GET is not zero-copy, which UCX then
    emulates over tcp) or where RDMA devices serve UCX (it reads through the NIC)."""
    tls = _ucx_list("UCX_TLS")
    if tls is not None:
        excluding, names = tls
        if excluding == ("tcp" in names):
            return None  # "^tcp,...", or a list without tcp
        if not excluding:
            return f"UCX_TLS={os.environ['UCX_TLS']} names tcp"
    if bind_host is not None and _loopback(bind_host):
        zcopy = os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
        if zcopy is None and os.environ.get("PDKV_UCX_ENV", "").lower() not in _OFF:
            zcopy = "y"  # configure_ucx_environment sets it where CUDA is, before NIXL loads UCX
        if device == "cuda" and not _on(zcopy):
            return "a GPU owner whose cuda_ipc GET is not zero-copy (UCX emulates it over tcp)"
        return None
    modules = _ucx_list("UCX_MODULES")
    ib_usable = modules is None or (modules[0] != ("ib" in modules[1]))
    if _ib_devices() and ib_usable:
        return None
    where = bind_host or "an unknown address"
    return f"an owner bound to {where} with no RDMA device: decodes on other hosts read it over tcp"


def _loopback(host: str) -> bool:
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def protect_owner_heap(device: str = "cpu", bind_host: str | None = None) -> str | None:
    """In an owner (a process whose memory decodes READ) that UCX may serve over TCP, have
    UCX's request pool come from zeroed memory; which guard was set ("ucx" or "process"), or
    None.

    UCX 1.23's TCP transport answers a decode's GET with a request whose datatype field it
    never sets; when the decode dies or its link is cut, purging the queued replies reads
    that field, and heap garbage left in the request pool's chunks (41 KB) segfaulted the
    owner. A chunk that comes zeroed reads as a plain buffer with nothing to release.

    "ucx", the default: the pool's chunks come from libucs's `malloc` (ucs_mpool_hugetlb_malloc
    -> ucs_malloc, in libucs), so that one GOT slot of libucs is pointed at `calloc(1, size)`:
    every allocation UCX makes through libucs is zeroed, and nothing else in the process
    changes (x86-64, libucs found beside NIXL). Nothing else a NIXL owner asks of UCX writes
    that field (proto v2 sends leave it; NIXL posts no receive and no worker flush, whose
    fields share its place), so a request reused from the pool still reads CONTIG (no owner
    crash in 50 kills and 50 cuts, `scripts/bench_owner_faults.py`, 2026-12-03).
    "process", where PDKV_HEAP_GUARD=process asks for it or "ucx" cannot be done: glibc's
    `M_MMAP_THRESHOLD` at 32 KiB for the whole process, so every allocation of 32 KiB or more
    is a fresh mmap; it costs every tensor and array of the engine a syscall and fresh pages
    (a `MALLOC_MMAP_THRESHOLD_` in the environment wins: glibc then has it already).
    Either is set only where `heap_guard_reason` finds TCP in the path: PDKV_HEAP_GUARD=1
    sets it always, 0 never. Call it before the process's first UCX worker exists."""
    setting = os.environ.get("PDKV_HEAP_GUARD", "auto").lower()
    if setting not in ("auto", "1", "process", "ucx", *_OFF, "on", "true", "yes"):
        raise TransferError(f"PDKV_HEAP_GUARD={setting!r}: auto, 1, process, ucx or 0")
    if setting in _OFF:
        return None
    reason = f"PDKV_HEAP_GUARD={setting}" if setting != "auto" else heap_guard_reason(device, bind_host)
    if reason is None:
        logger.debug("no owner heap guard: no READ of this owner goes over UCX's tcp")
        return None
    if setting != "process":
        if (why := _zero_ucx_allocations()) is None:
            logger.info("owner heap guard set (UCX's allocations zeroed): %s; PDKV_HEAP_GUARD=0 turns it off", reason)
            return "ucx"
        logger.info("owner heap guard: %s; glibc's mmap threshold instead, for the whole process", why)
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return None
    if ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _OWNER_MMAP_THRESHOLD) != 1:
        logger.warning("mallopt(M_MMAP_THRESHOLD) refused: an owner may crash if a reader dies mid-READ")
        return None
    logger.info("owner heap guard set (mallopt M_MMAP_THRESHOLD=32 KiB): %s; PDKV_HEAP_GUARD=0 turns it off", reason)
    return "process"


_PROT_READ, _PROT_WRITE, _PROT_EXEC = 1, 2, 4
_MAP_PRIVATE, _MAP_ANONYMOUS = 0x02, 0x20
_RTLD_DI_LINKMAP = 2
_zeroed: dict[str, int] = {}  # a libucs's path: the trampoline its malloc slot now holds


def _zero_ucx_allocations() -> str | None:
    """Point libucs's GOT slot for `malloc` at a trampoline that calls `calloc(1, size)`;
    None once done, else why not.

    libucs is loaded here, by its path beside NIXL, before NIXL's UCX plugin asks for it:
    the dynamic loader then hands the plugin this same object (the same file), so the
    request pools of every worker made later take their chunks through the patched slot.
    The trampoline is six instructions written to a page of its own, made executable
    after it is written, never freed."""
    if platform.machine() not in ("x86_64", "AMD64") or platform.libc_ver()[0] != "glibc":
        return f"no UCX allocation guard on {platform.machine()} (x86-64 with glibc only)"
    path = _libucs_path()
    if path is None:
        return "libucs not found beside NIXL"
    if str(path) in _zeroed:
        return None
    slots = _got_offsets(path, "malloc")
    if not slots:
        return f"{path.name} imports no malloc"
    configure_ucx_environment()  # libucs reads its global settings (UCX_MODULES) as it loads
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib = ctypes.CDLL(str(path))
    link_map = ctypes.c_void_p()
    if libc.dlinfo(ctypes.c_void_p(lib._handle), _RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0:
        return f"dlinfo({path.name}) failed"
    base = ctypes.c_size_t.from_address(link_map.value or 0).value  # link_map's first field: l_addr
    calloc = ctypes.cast(libc.calloc, ctypes.c_void_p).value or 0
    code = (
        b"\xf3\x0f\x1e\xfa"  # endbr64 (a GOT call is an indirect branch)
        b"\x48\x89\xfe"  # mov rsi, rdi: the size, calloc's second argument
        b"\xbf\x01\x00\x00\x00"  # mov edi, 1
        b"\x48\xb8" + struct.pack("<Q", calloc) + b"\xff\xe0"  # movabs rax, calloc; jmp rax
    )
    page = mmap.PAGESIZE
    trampoline = libc.mmap(None, page, _PROT_READ | _PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if trampoline in (None, ctypes.c_void_p(-1).value):
        return f"mmap: {os.strerror(ctypes.get_errno())}"
    ctypes.memmove(trampoline, code, len(code))
    if libc.mprotect(trampoline, page, _PROT_READ | _PROT_EXEC) != 0:
        return f"mprotect(PROT_EXEC): {os.strerror(ctypes.get_errno())}"
    for offset in slots:
        slot = base + offset
        start, protection = _mapping(slot)
        if protection is None:
            return f"{path.name}'s GOT is not mapped where its headers say"
        if not protection & _PROT_WRITE and libc.mprotect(start, page, protection | _PROT_WRITE) != 0:
            return f"mprotect({path.name}'s GOT): {os.strerror(ctypes.get_errno())}"
        ctypes.c_void_p.from_address(slot).value = trampoline
        if not protection & _PROT_WRITE:
            libc.mprotect(start, page, protection)  # its RELRO back
    _zeroed[str(path)] = trampoline
    return None


def _libucs_path() -> Path | None:
    """The libucs this process has loaded, else the one in the NIXL wheel's libraries."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            name = line.split(maxsplit=5)[-1].strip()
            if Path(name).name.startswith("libucs") and ".so" in name:
                return Path(name)
    try:
        spec = importlib.util.find_spec(_nixl_module().split(".")[0])
    except (BuildMismatchError, ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    package = Path(spec.origin).parent
    found = sorted((package.parent / f"{package.name}.libs").glob("libucs*.so*"))
    return found[0].resolve() if found else None


def _mapping(address: int) -> tuple[int, int | None]:
    """The page holding `address` and its protection in this process; None where unmapped."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                protection = (_PROT_READ if perms[0] == "r" else 0) | (_PROT_WRITE if perms[1] == "w" else 0)
                return address & ~(mmap.PAGESIZE - 1), protection | (_PROT_EXEC if perms[2] == "x" else 0)
    return address & ~(mmap.PAGESIZE - 1), None


def _got_offsets(path: Path, symbol: str) -> list[int]:
    """Where, from its load address, `path`'s GOT slots bound to `symbol` are: its x86-64
    JUMP_SLOT and GLOB_DAT relocations, read from the file's section headers."""
    data = path.read_bytes()
    if data[:6] != b"\x7fELF\x02\x01":  # 64-bit, little-endian
        return []
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    found = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 4 or not entsize:  # SHT_RELA
            continue
        symtab, strtab = sections[link], sections[sections[link][6]]
        for at in range(offset, offset + size, entsize):
            r_offset, r_info = struct.unpack_from("<QQ", data, at)
            if r_info & 0xFFFFFFFF not in (6, 7):  # R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT
                continue
            name_at = strtab[4] + struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * symtab[9])[0]
            if data[name_at : data.index(b"\0", name_at)] == symbol.encode():
                found.append(r_offset)
    return found


def default_workers(mem_type: str = "DRAM") -> int:
    """One worker per core this process may run on, up to 8 for host memory, 4 for GPU memory.

    On the host a worker's thread does the copy (cma), so workers scale with cores; over
    cuda_ipc a worker only posts descriptors for the copy engines, and more than 4 gained
    nothing but a worse p99 (docs/benchmarks.md, "UCX workers: READs on more cores").
    """
    return max(1, min(4 if mem_type == "VRAM" else 8, len(os.sched_getaffinity(0))))


_ucx_devices: str | None = None  # this process's NICs for UCX (`use_ucx_devices`)


def use_ucx_devices(devices: str | None) -> None:
    """Hold this process's UCX agents to `devices` (HCA names, ", "-separated: NIXL's UCX
    `device_list`, which it turns into UCX_NET_DEVICES with port 1), as SGLang's own NIXL
    backend does with `--disaggregation-ib-device`. Per agent, not through the environment;
    a UCX_NET_DEVICES set by the operator wins. Agents made after the call take it."""
    global _ucx_devices
    _ucx_devices = devices or None


def ucx_backend_params() -> dict[str, str]:
    """NIXL's UCX backend parameters for a new agent."""
    if _ucx_devices is None or os.environ.get("UCX_NET_DEVICES"):
        return {}
    return {"device_list": _ucx_devices}


def _torch_cuda_major() -> int | None:
    return int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None


def _nixl_module() -> str:
    """The NIXL build to load: the one for torch's CUDA major; with a CPU torch, cu12 first."""
    installed = {major: name for major, name in _NIXL_BUILDS.items() if importlib.util.find_spec(name) is not None}
    cuda = _torch_cuda_major()
    if cuda is None:
        return next(iter(installed.values()), "nixl._api")
    if cuda in installed:
        return installed[cuda]
    if cuda not in _NIXL_BUILDS:
        raise BuildMismatchError(
            f"torch is built for CUDA {torch.version.cuda}: pdkv serves CUDA 12 and 13 (NIXL's builds)"
        )
    if installed:
        have = ", ".join(f"nixl-cu{m}" for m in installed)
        raise BuildMismatchError(
            f"torch is built for CUDA {torch.version.cuda}, NIXL is installed as {have}: "
            f"pip install 'pdkv[cu{cuda}]' (NIXL and CUDA bindings built for CUDA {cuda})"
        )
    return "nixl._api"  # NIXL's own meta-package, where no build of ours is installed


def check_cuda_builds() -> None:
    """Refuse NIXL or CUDA bindings built for another CUDA major than torch (a CPU torch
    takes any). Reads package metadata only: nothing is loaded."""
    _nixl_module()
    cuda = _torch_cuda_major()
    try:
        bindings = importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        return
    if cuda is not None and int(bindings.split(".")[0]) != cuda:
        raise BuildMismatchError(
            f"torch is built for CUDA {torch.version.cuda}, cuda-bindings {bindings} for CUDA "
            f"{bindings.split('.')[0]}: pip install 'pdkv[cu{cuda}]'"
        )


def load_nixl() -> ModuleType:
    """NIXL's Python API (nixl-cu12 or nixl-cu13, the one built for torch's CUDA), with UCX
    configured first."""
    return _nixl()


@functools.lru_cache(maxsize=1)
def _nixl() -> ModuleType:
    name = _nixl_module()
    configure_ucx_environment()
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise TransferError(f"NIXL is not installed (pip install pdkv, or 'pdkv[cu13]' for CUDA 13): {exc}") from exc


def translate(exc: BaseException, what: str, peer: str = "") -> TransferError:
    """NIXL's exceptions into the pdkv tree: the one place that sees them."""
    disconnected = getattr(
        importlib.import_module(f"{_nixl().__name__.split('.')[0]}._bindings"), "nixlRemoteDisconnectError", ()
    )
    if isinstance(exc, disconnected):
        return PeerLostError(f"{what}: peer {peer or '?'} disconnected", peer)
    return TransferError(f"{what}: {type(exc).__name__}: {exc}")
