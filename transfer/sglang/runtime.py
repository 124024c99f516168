"""What pdkv's SGLang backend checks of the process it runs in, before anything starts:
the SGLang release (its transfer-backend interface changes between releases) and the CUDA
builds of NIXL and the CUDA bindings against torch's. Apart from the plugin and the
classes, which both ask it."""

from __future__ import annotations

import functools
import importlib.metadata
import sys

from pdkv.errors import PdkvError

# The SGLang releases whose interface pdkv's conformance tests ran against (tests/test_sglang*.py).
SGLANG_TESTED = ("0.5.23",)


class UnsupportedSGLangError(PdkvError, RuntimeError):
    """The installed SGLang is not a release pdkv's conformance tests cover."""


@functools.lru_cache(maxsize=1)
def check_runtime() -> None:
    """Refuse, at start, an SGLang release outside `SGLANG_TESTED` and NIXL or CUDA bindings
    built for another CUDA major than torch (`transfer.lanes.ucx.nixl.check_cuda_builds`).
    Cached: a process checks once, and a refusal is raised again each time it is asked."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = getattr(sys.modules.get("sglang"), "__version__", "unknown")
    if version not in SGLANG_TESTED:
        raise UnsupportedSGLangError(
            f"pdkv's SGLang backend is tested with sglang {', '.join(SGLANG_TESTED)}, and this process has sglang "
            f"{version}: its transfer-backend interface changes between releases. Install sglang=={SGLANG_TESTED[-1]} "
            "(docs/sglang.md, Installing), or unset PDKV_SGLANG to run SGLang's own backend."
        )
    from transfer.lanes.ucx.nixl import check_cuda_builds

    check_cuda_builds()
