"""docs/sglang.md's launch recipe uses sglang 0.5.23's own flags: each `launch_server`
command there is parsed by SGLang's argument parser (names, choices, arity), and each
router command by `sglang_router`'s where that package is installed."""

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang.srt.server_args  # noqa: F401
server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang 0.5.23 is not installed")

DOC = Path(__file__).resolve().parents[1] / "docs" / "sglang.md"


def _commands(prefix: str) -> list[list[str]]:
    """The recipe's shell commands that start with `prefix`, continuation lines joined."""
    text = DOC.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    joined = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line)[len(shlex.split(prefix)) :] for line in joined if line.startswith(prefix)]


def test_every_launch_server_flag_is_sglangs():
    parser = argparse.ArgumentParser(exit_on_error=False)
    server_args.ServerArgs.add_cli_args(parser)
    commands = _commands("python -m sglang.launch_server")
    assert len(commands) >= 2  # a prefill and a decode
    for argv in commands:
        parsed = parser.parse_args(argv)  # an unknown flag or a bad choice raises
        assert parsed.disaggregation_mode in ("prefill", "decode")
        assert parsed.disaggregation_transfer_backend == "mooncake"  # the layer split accepts only Mooncake
    prefill = next(parser.parse_args(a) for a in commands if "prefill" in a)
    assert prefill.enable_dsa_cache_layer_split and prefill.pp_size == 1  # SGLang refuses the split with PP


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang_router is not installed")
def test_the_router_command_parses():
    for argv in _commands("python -m sglang_router.launch_router"):
        code = "import sys; from sglang_router.launch_router import parse_router_args; parse_router_args(sys.argv[1:])"
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
