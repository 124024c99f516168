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
    assert 0 < summary["transfer_gbps"] < float("inf")


def _reply(decoder, started, seconds, nbytes=1):
    from transfer.app.api import DecodeReply

    return DecodeReply(
        room=0,
        nbytes=nbytes,
        descriptors=1,
        fetch_seconds=seconds,
        verified_bytes=nbytes,
        decoder=decoder,
        fetch_started=started,
    )


def test_transfer_time_counts_overlapping_fetches_once_and_gaps_not_at_all():
    from transfer.app.cli import transfer_seconds

    one = [_reply("a", 0.0, 2.0), _reply("a", 1.0, 2.0), _reply("a", 5.0, 1.0), _reply("a", 5.2, 0.3)]
    assert transfer_seconds(one) == 3.0 + 1.0  # [0, 3) and [5, 6): the gap between waits for prefill
    # Another decode worker's clock is its own: its spans add, never merge with the first's.
    assert transfer_seconds([*one, _reply("b", 0.5, 1.5)]) == 4.0 + 1.5
