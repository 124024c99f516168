"""Imported once by the tests' forkserver (`tests.children`), before it forks any child: the
modules every child would otherwise import again. Nothing here may start a thread, read the
environment for later, or load NIXL (UCX reads its settings as it loads)."""

import aiohttp  # noqa: F401
import msgspec  # noqa: F401
import numpy  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401

import transfer.decode.fetcher  # noqa: F401
import transfer.prefill.exporter  # noqa: F401

try:
    from tests.sglang_scheduler import import_sglang_scheduler_code
except ImportError:  # SGLang not installed: its tests skip
    pass
else:
    try:
        import_sglang_scheduler_code()
        import transfer.sglang.conn  # noqa: F401
    except ImportError:
        pass
