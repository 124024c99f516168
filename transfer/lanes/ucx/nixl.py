"""NIXL, loaded with UCX configured first; its errors in the pdkv tree; an owner's heap guard."""

from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from pdkv.errors import PeerLostError, TransferError

__all__ = ["configure_ucx_environment", "default_workers", "load_nixl", "protect_owner_heap", "translate"]

logger = logging.getLogger(__name__)


def quietly(fn: Callable[[], Any]) -> None:
    """Run `fn` on a worker's thread for its side effect; a failure is logged, not raised."""
    try:
        fn()
    except Exception as exc:
        logger.debug("%s: %s", getattr(fn, "__name__", fn), exc)


def configure_ucx_environment() -> None:
    """UCX settings that must be in place before NIXL loads UCX.

    Without InfiniBand devices the bundled libnl crashed every NIXL process at exit
    (seen with nixl-cu12 1.5.1); excluding the ib module avoids that and costs nothing
    where no IB exists. On one GPU without NVLink, UCX disables cuda_ipc zero-copy GET
    and falls back to a slow emulation; turn it on explicitly.

    Between hosts over TCP, a cut link stalls a READ with no error at all (TCP retransmits
    quietly) until the READ's own deadline, a minute later; and a READ abandoned then still
    landed its bytes once the link came back (seen between network namespaces). With TCP
    keepalive probes after 1 s of silence, given up after two unanswered ones, UCX fails the
    endpoint about 3 s after the cut, the READ ends `PeerLostError`, and
    a failed endpoint lands nothing later. The probes are answered by the peer's kernel, so a
    busy owner is not taken for a dead one.
    """
    ib = Path("/sys/class/infiniband")
    if "UCX_MODULES" not in os.environ and not (ib.exists() and any(ib.iterdir())):
        os.environ["UCX_MODULES"] = "^ib"
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    os.environ.setdefault("UCX_TCP_KEEPIDLE", "1s")
    os.environ.setdefault("UCX_TCP_KEEPINTVL", "1s")
    os.environ.setdefault("UCX_TCP_KEEPCNT", "2")


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_OWNER_MMAP_THRESHOLD = 32 << 10


def protect_owner_heap() -> None:
    """In an owner (a process whose memory decodes READ), have glibc serve every allocation
    of 32 KiB or more by a fresh mmap, unless `MALLOC_MMAP_THRESHOLD_` already says otherwise.

    UCX 1.23's TCP transport answers a decode's GET with a request whose datatype field it
    never sets; when the decode dies or its link is cut, purging the queued replies reads
    that field, and heap garbage left in the request pool's chunks (41 KB) segfaulted the
    owner. Chunks that come zeroed from mmap read as a plain buffer with nothing to release.
    Call it before the process's first UCX worker exists."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return
    if ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _OWNER_MMAP_THRESHOLD) != 1:
        logger.warning("mallopt(M_MMAP_THRESHOLD) refused: an owner may crash if a reader dies mid-READ")


def default_workers(mem_type: str = "DRAM") -> int:
    """One worker per core this process may run on, up to 8 for host memory, 4 for GPU memory.

    On the host a worker's thread does the copy (cma), so workers scale with cores; over
    cuda_ipc a worker only posts descriptors for the copy engines, and more than 4 gained
    nothing but a worse p99 (docs/benchmarks.md, "UCX workers: READs on more cores").
    """
    return max(1, min(4 if mem_type == "VRAM" else 8, len(os.sched_getaffinity(0))))


def load_nixl() -> ModuleType:
    """NIXL's Python API (nixl-cu12 or nixl-cu13), with UCX configured first."""
    return _nixl()


@functools.lru_cache(maxsize=1)
def _nixl() -> ModuleType:
    configure_ucx_environment()
    for name in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransferError("NIXL is not installed (pip install nixl-cu12)")


def translate(exc: BaseException, what: str, peer: str = "") -> TransferError:
    """NIXL's exceptions into the pdkv tree: the one place that sees them."""
    disconnected = getattr(
        importlib.import_module(f"{_nixl().__name__.split('.')[0]}._bindings"), "nixlRemoteDisconnectError", ()
    )
    if isinstance(exc, disconnected):
        return PeerLostError(f"{what}: peer {peer or '?'} disconnected", peer)
    return TransferError(f"{what}: {type(exc).__name__}: {exc}")
