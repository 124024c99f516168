"""Imported once by the tests' forkserver (`tests.children`), before it forks any child: the
modules every child would otherwise import again. Nothing here may start a thread, read the
environment for later, load NIXL (UCX reads its settings as it loads), or touch CUDA: a child
forked from a process that initialised CUDA cannot use it. Where a GPU is present SGLang's imports
reach CUDA (on the H200 every child's CUDA then failed), so there each child imports SGLang itself."""

import glob

import aiohttp  # noqa: F401
import msgspec  # noqa: F401
import numpy  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401

import transfer.decode.fetcher  # noqa: F401
import transfer.prefill.exporter  # noqa: F401


def _import_sglang() -> None:
    if glob.glob("/dev/nvidia[0-9]*"):  # asks no CUDA API: that would initialise it here
        return
    try:
        from tests.sglang_scheduler import import_sglang_scheduler_code

        import_sglang_scheduler_code()
        import transfer.sglang.conn  # noqa: F401
    except ImportError:  # SGLang not installed: its tests skip
        pass


_import_sglang()
