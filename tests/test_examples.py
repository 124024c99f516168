"""The examples run as a user runs them: their own process, from the checkout's root."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs_and_checks_every_byte():
    proc = subprocess.run(
        [sys.executable, "examples/quickstart.py"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "room 1 by ticket: 15120 bytes, 0 control messages"  # a ticket asks nobody
    assert lines[1].startswith("room 2 by claims: 15120 bytes, ") and not lines[1].endswith(" 0 control messages")
    assert lines[2] == "ok: 25200 bytes of 2 rooms checked, each as the prefill wrote it"
