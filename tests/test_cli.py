"""The README's main job, as a user runs it (small preset, so CI can afford it)."""

import json
import subprocess
import sys


def test_main_job_cli_runs_and_reports(tmp_path):
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        "-m",
        "transfer.app",
        "--preset",
        "tiny",
        "--engines",
        "2",
        "--requests",
        "20",
        "--mix",
        "16:1,128:1,512:1",
        "--prefix-tokens",
        "64",
        "--prefill-pool-tokens",
        "4096",
        "--decode-pool-tokens",
        "4096",
        "--no-progress",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    assert summary["requests"] == 20 and summary["failures"] == 0 and summary["verified_bytes"] > 0
    assert "TTFT-on-decode" in proc.stdout
