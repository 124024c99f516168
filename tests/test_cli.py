"""The README's main job, as a user runs it (small preset, so CI can afford it)."""

import json
import subprocess
import sys

import pytest


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


def test_a_service_that_dies_at_start_up_ends_the_job_with_one_line(tmp_path):
    """No traceback: which service, why, and where its log is (issue 29 §8)."""
    cmd = [sys.executable, "-m", "transfer.app", "--preset", "tiny", "--engines", "2", "--requests", "4"]
    cmd += ["--prefill-pool-tokens", "0", "--no-progress", "--workdir", str(tmp_path)]  # a pool of no pages
    cmd += ["--json", str(tmp_path / "summary.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("pdkv: ")]
    assert len(lines) == 1, proc.stderr
    assert "failed to start: exited with 1" in lines[0] and "LayoutError" in lines[0]
    log = lines[0].rsplit("its log: ", 1)[1]
    assert log.startswith(str(tmp_path)) and "prefill0-cp" in log and "LayoutError" in open(log).read()
    failed = json.loads((tmp_path / "summary.json").read_text())  # --json says why there is no summary
    assert failed["error"] == lines[0].removeprefix("pdkv: ") and failed["log"] == log
    assert failed["failed_to_start"].startswith("prefill0-cp")


def test_the_summary_counts_failures_by_cause_and_engine_restarts():
    from transfer.app.cli import render, summarise
    from transfer.app.router import DeploymentSpec, RequestOutcome
    from transfer.app.supervisor import EngineDeath

    ok = RequestOutcome(1, "prefill1", 64, True, 0.1, _reply("d", 0.0, 0.01, nbytes=100))
    peer = "PeerLostError"
    lost = RequestOutcome(2, "prefill0", 64, False, 0.1, error=f"{peer}: x", cause=peer, engine_lost=True)
    late = RequestOutcome(3, "prefill1", 64, False, 0.1, error="DeadlineExceeded: y", cause="DeadlineExceeded")
    death = EngineDeath("prefill0", ("prefill0-cp1",), (-9,), at=0.0, back_after=6.5, attempts=1)
    s = summarise([ok, lost, lost, late], 1.0, 1.0, [death], {"prefill0": 1, "prefill1": 0})
    assert s.failures == 3 and s.lost_with_engine == 2
    assert s.failures_by_cause == {"PeerLostError": 2, "DeadlineExceeded": 1} and s.restarts == {"prefill0": 1}
    text = render(s, DeploymentSpec(engines=(2, 2)))
    assert "3 (PeerLostError 2, DeadlineExceeded 1; 2 in flight on an engine that died)" in text
    assert "engine restarts" in text and "prefill0 1" in text
    assert "engine died: prefill0: prefill0-cp1 (exit -9); serving again 6.5 s later (after restart)" in text


def test_the_scale_is_the_device_own_copy_where_the_pools_are_on_a_gpu(monkeypatch):
    from transfer.app import cli
    from transfer.app.router import DeploymentSpec

    copies = []
    monkeypatch.setattr(cli, "device_copy_gbps", lambda nbytes, device: copies.append((nbytes, device)) or 2000.0)
    monkeypatch.setattr(cli, "copy_bandwidth", lambda: 9.0)
    label, gbps = cli.copy_scale("cuda:1", 394_000_000)
    assert (label, gbps, copies) == (
        "device copy GB/s (cuda:1 to itself, 394 MB, for scale)",
        2000.0,
        [(394_000_000, "cuda:1")],
    )
    assert cli.copy_scale("cpu", 394_000_000) == (cli.HOST_COPY, 9.0) and len(copies) == 1  # the host: one thread
    text = cli.render(cli.summarise([], 1.0, gbps, copy_label=label), DeploymentSpec(engines=(2,)))
    assert "device copy GB/s (cuda:1 to itself, 394 MB, for scale)  2000.00" in text
    assert cli.device_copy_gbps(1 << 20, "cpu") > 0  # the same torch copy, on the host's memory


def _pid_of(ready_file) -> int:
    """The service started with this ready file (each has its own)."""
    import os

    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if str(ready_file).encode() in f.read().replace(b"\0", b" ").split():  # exec'd or titled
                    return int(entry)
        except (OSError, ValueError):
            continue
    raise AssertionError(f"no process has {ready_file}")


def _pids_under(work) -> list[int]:
    """Processes whose command line names a file under `work` (the services of a job there)."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if str(work).encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_a_job_killed_outright_takes_its_services_with_it(tmp_path):
    """SIGKILL runs no cleanup in the job: each service, forked or not, must still go (none
    left holding ports and pinned memory), each shown under its own command line meanwhile."""
    import os
    import signal
    import time

    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "transfer.app", "--preset", "tiny", "--engines", "2", "--requests", "100000"]
    cmd += ["--no-progress", "--workdir", str(work)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (work / "decode0.ready").exists():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        services = [p for p in _pids_under(work) if p != proc.pid]
        lines = [open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ") for p in services]
        assert sum(b" -m transfer.app.prefill_worker " in line for line in lines) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        end = time.monotonic() + 15
        while (left := _pids_under(work)) and time.monotonic() < end:
            time.sleep(0.1)
        assert not left, [open(f"/proc/{p}/cmdline", "rb").read()[:120] for p in left]
    finally:
        proc.kill()


def test_a_rank_killed_mid_run_is_restarted_and_the_job_reports_it(tmp_path):
    """The issue's run, small: a CP rank of one of two engines SIGKILLed once requests flow."""
    import os
    import signal
    import time

    out, work = tmp_path / "summary.json", tmp_path / "work"
    cmd = [sys.executable, "-m", "transfer.app", "--preset", "tiny", "--engines", "2,2", "--requests", "200"]
    cmd += ["--mix", "16:1,128:1,512:1", "--prefix-tokens", "64", "--no-progress", "--json", str(out)]
    cmd += ["--prefill-pool-tokens", "4096", "--decode-pool-tokens", "4096", "--workdir", str(work)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not (work / "decode0.ready").exists():
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        time.sleep(1.0)  # requests flow
        os.kill(_pid_of(work / "prefill0-cp1.ready"), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout + stderr
    summary = json.loads(out.read_text())
    assert summary["requests"] == 200 and summary["failures"] == summary["lost_with_engine"] <= 2  # 2 in flight
    assert set(summary["failures_by_cause"]) <= {"PeerLostError"}
    assert summary["restarts"] == {"prefill0": 1} and len(summary["engine_deaths"]) == 1
    assert "prefill0-cp1 (exit -9); serving again" in summary["engine_deaths"][0]
    assert "engine died: prefill0: prefill0-cp1 (exit -9)" in stdout and "Traceback" not in stderr


# ---- the command line itself: checked before anything starts -----------------------------------
BAD = [
    (["--engines", "4,x"], "--engines: expected CP sizes such as 4 or 2,3, got '4,x'"),
    (["--engines", "0"], "--engines: a CP size is at least 1"),
    (["--log-level", "verbose"], "--log-level: invalid choice: 'VERBOSE'"),
    (["--mix", "1024:x"], "--mix: expected TOKENS:WEIGHT"),
    (["--mix", "1024"], "--mix: expected TOKENS:WEIGHT"),
    (["--mix", "0:1"], "--mix: tokens are at least 1"),
    (["--registry", "ftp://host:1"], "--registry: expected http://HOST:PORT or etcd://"),
    (["--registry", "http://host"], "--registry: expected http://HOST:PORT"),
    (["--requests", "0"], "--requests: expected at least 1, got 0"),
    (["--decoders", "two"], "--decoders: expected an integer, got 'two'"),
    (["--prefix-share", "1.5"], "--prefix-share: expected a number in [0, 1]"),
    (["--owner-progress-ms", "0"], "--owner-progress-ms: expected a positive number"),
    (["--device", "gpu"], "--device: expected cpu, cuda or cuda:N"),
    (["--json", "/no/such/dir/out.json"], "--json: no directory '/no/such/dir'"),
]


@pytest.mark.parametrize(("argv", "why"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_code_2(argv, why, capsys):
    from transfer.app.options import parser

    with pytest.raises(SystemExit) as end:
        parser().parse_args(argv)
    assert end.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["usage: python -m transfer.app [options]  (see --help)", err[1]]  # a usage line, a reason
    assert err[1].startswith("python -m transfer.app: error: argument ") and why in err[1], err


def test_bad_input_starts_nothing(tmp_path):
    """As a user runs it: no traceback, and no service was started (no workdir, no logs)."""
    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "transfer.app", "--workdir", str(work), "--mix", "16:1", "--registry", "etcd://"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert "--registry: registry URL 'etcd://' names no host" in proc.stderr
    assert not work.exists()


def test_help_names_the_program_every_flag_its_default_and_the_exit_codes(monkeypatch):
    from transfer.app.options import parser

    monkeypatch.setenv("COLUMNS", "400")  # one line a flag: a default is not wrapped apart
    ap = parser()
    text = ap.format_help()
    assert text.startswith("usage: python -m transfer.app") and "__main__" not in text
    assert all(a.help for a in ap._actions), [a.dest for a in ap._actions if not a.help]
    for shown in ["(default: 4)", "(default: 200)", "(default: WARNING)", "(default: 127.0.0.1)", "(default: 3)"]:
        assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text
    codes = text.split("exit codes:")[1]
    for code in ("0 ", "1 ", "2 ", "130 "):
        assert f"\n  {code}" in codes


def test_good_input_parses_to_values():
    from transfer.app.launcher import Host
    from transfer.app.options import parser

    args = parser().parse_args(["--engines", "2,3", "--log-level", "info", "--prefill-host", "ns1@10.0.0.1"])
    assert args.engines == (2, 3) and args.log_level == "INFO"
    assert args.prefill_host == Host("ns1", "10.0.0.1") and args.decode_host == Host()
    assert parser().parse_args([]).engines == (4,)


def test_a_flag_without_help_still_shows_its_default(monkeypatch):
    import argparse

    from transfer.app.options import HelpFormatter

    monkeypatch.setenv("COLUMNS", "400")
    ap = argparse.ArgumentParser(formatter_class=HelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--port", type=int, default=0, help="0: any free one")
    ap.add_argument("--json")
    ap.add_argument("--quiet", action="store_true")
    lines = {ln.split()[0]: ln for ln in ap.format_help().splitlines() if ln.strip().startswith("--")}
    assert lines["--runs"].endswith("(default: 5)") and lines["--port"].endswith("0: any free one (default: 0)")
    assert "default" not in lines["--json"] + lines["--quiet"]  # unset, a switch: nothing to show


def test_every_parser_of_the_services_shows_defaults():
    """Each argparse parser of the main job and its services names a formatter that shows defaults."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = []
    for path in root.glob("transfer/app/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                kinds = {k.arg: ast.unparse(k.value) for k in node.keywords}
                found.append((path.name, kinds.get("formatter_class")))
    assert len(found) >= 4
    assert all(f in ("HelpFormatter", "_Formatter", "argparse.ArgumentDefaultsHelpFormatter") for _, f in found), found
