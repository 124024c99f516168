"""Where the tests' child processes come from: a forkserver that imported torch, SGLang's
scheduler code and pdkv once (`tests.forkserver_preload`), so that a child is a fork of it, not
a fresh interpreter importing them again (several seconds of CPU a child, most of a short case's
cost on a small machine). Each test process (an xdist worker) has its own forkserver.

A child starts with its parent's environment as it was when the child was made, as a spawned
child does: the forkserver's own is that of the moment it started.
"""

from __future__ import annotations

import multiprocessing.context
import os
from typing import Any


class _Process(multiprocessing.context.ForkServerProcess):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._environ = dict(os.environ)

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class _Context(multiprocessing.context.ForkServerContext):
    Process = _Process  # type: ignore[assignment]


_context = _Context()
_context.set_forkserver_preload(["tests.forkserver_preload"])


def context() -> multiprocessing.context.BaseContext:
    """The context for a test's child processes (`Process`, `Queue`, `Event`, ...)."""
    return _context
