"""A READ abandoned at a link cut lands no byte once the link is back (two stand-in hosts).

UCX cannot cancel a GET: over TCP the answer to one posted just before a cut arrives once the
link returns, and is copied into its destination whenever its UCX worker is next progressed,
long after pdkv reported the READ failed and its caller reused the pages. A worker abandons
such a READ with its agent (`transfer/lanes/ucx/worker.py`). Here an owner on one host, a
decode with two workers on the other, the owner's sends capped so that its READs take seconds;
the cut comes 0.4 s in, so that some READs' requests are unacknowledged (keepalive cannot probe
those: they end at `read_stall`). Once every READ has failed, the link comes back, the decode
connects the owner anew and keeps both workers busy reading elsewhere: the first buffer must
not change by one byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.abandoned_reads import READ_STALL_S, WATCH_S
from tests.netns import HostNet, unavailable

_WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no stand-in hosts: {_WHY_NOT}")

ROOT = Path(__file__).resolve().parents[1]
MIB = 4
CAP_MBIT = 8  # 4 MiB take ~4 s: every READ is in flight at the cut


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"{proc.args} exited {proc.returncode} before {path.name}"
        assert time.monotonic() < end, f"no {path.name} in {timeout:g}s"
        time.sleep(0.02)


def test_reads_abandoned_at_a_cut_land_no_byte_once_the_link_is_back(tmp_path: Path) -> None:
    env = {**os.environ, "UCX_TLS": "tcp", "PYTHONPATH": str(ROOT)}
    blob = tmp_path / "owner.blob"
    with HostNet(["prefill", "decode"]) as net:
        run = [sys.executable, "-m", "tests.abandoned_reads"]
        owner = subprocess.Popen([*net.exec_prefix("prefill"), *run, "owner", str(blob), str(MIB)], env=env, cwd=ROOT)
        decode = None
        try:
            _wait_for(blob, owner, 60)
            net.limit("prefill", CAP_MBIT)
            args = ["decode", str(blob), str(MIB), str(tmp_path)]
            decode = subprocess.Popen([*net.exec_prefix("decode"), *run, *args], env=env, cwd=ROOT)
            _wait_for(tmp_path / "started", decode, 60)
            time.sleep(0.4)
            net.link("prefill", up=False)
            try:
                _wait_for(tmp_path / "ended", decode, 4 * READ_STALL_S + 30)
            finally:
                net.link("prefill", up=True)
            net.limit("prefill", None)
            (tmp_path / "back").touch()
            _wait_for(tmp_path / "result", decode, WATCH_S + 60)
        finally:
            for proc in (owner, decode):
                if proc is not None:
                    proc.kill()
                    proc.wait(10)
    ended = json.loads((tmp_path / "ended").read_text())
    result = json.loads((tmp_path / "result").read_text())
    assert all(e in ("PeerLostError", "TransferError") for e in ended), ended  # the cut fell while each ran
    assert result["drops"] >= 1, result  # some READ was in flight at its end: abandoned with its agent
    assert result["reads"] > 0 and result["scratch_ok"], result  # the workers read again, and were progressed
    assert result["changed"] == 0, result  # not one byte of an abandoned READ landed
