"""What the tests of pdkv's SGLang classes share: the real `sglang` package (imported, or the
module skipped), a clean environment for each test, and pdkv's bootstrap server.

A test module imports the fixtures by name (`from tests.sglang_fixtures import
_own_environment, bootstrap`): pytest then uses them there, and only there.
"""

import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest


def sglang_conn() -> ModuleType:
    """SGLang's `disaggregation.base.conn`; where it is missing the calling test module is
    skipped, or fails under `PDKV_REQUIRE_SGLANG` (CI installs it: its tests must run)."""
    if os.environ.get("PDKV_REQUIRE_SGLANG"):
        import sglang.srt.disaggregation.base.conn  # noqa: F401
    return pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")


@pytest.fixture(autouse=True)
def _own_environment() -> Iterator[None]:
    """The PDKV_SGLANG_* variables a test sets in this process end with it."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture
def bootstrap() -> Iterator[Any]:
    """pdkv's bootstrap server for SGLang, on a free port of the loopback."""
    from transfer.sglang.conn import PdkvKVBootstrapServer

    server = PdkvKVBootstrapServer("127.0.0.1", 0)
    yield server
    server.close()
