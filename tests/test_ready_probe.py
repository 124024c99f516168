"""Readiness apart from liveness (issue 43, item 2): a prefill rank's `/ready` says whether
decodes can find and read it; the launcher counts a service started only once it is ready."""

import asyncio

import aiohttp
import pytest

from pdkv import DSAKVPool, tiny
from transfer.app.launcher import Launcher, ServiceNotReady, ready_urls
from transfer.prefill import PrefillExporter
from transfer.registry.server import RegistryServer
from transfer.timeouts import Timeouts


async def _get(url: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json()


async def test_a_rank_whose_registration_lapsed_is_alive_but_not_ready():
    """`/health` answers ok throughout; `/ready` is 200 while the registry holds the rank and
    503, naming why, once its renewals have failed for a lease (the registry gone)."""
    registry = RegistryServer(secret="s3cret")
    url = await registry.start()
    timeouts = Timeouts(lease=0.6)
    try:
        async with PrefillExporter(
            DSAKVPool(tiny(layer_num=2)), "r1", 0, 1, url, secret="s3cret", timeouts=timeouts
        ) as exp:
            assert exp.readiness() == (True, "registered, UCX up")
            assert await _get(f"{exp.control_url}/ready") == (200, {"status": "ready", "why": "registered, UCX up"})
            await registry.aclose()  # no renewal is taken from now on
            deadline = asyncio.get_running_loop().time() + 10
            while (await _get(f"{exp.control_url}/ready"))[0] == 200:
                assert asyncio.get_running_loop().time() < deadline, "still ready with its lease lapsed"
                await asyncio.sleep(0.05)
            status, body = await _get(f"{exp.control_url}/ready")  # open: no secret asked, as /health
            assert status == 503 and body["status"] == "not ready" and "lease lapsed" in body["why"]
            assert (await _get(f"{exp.control_url}/health"))[0] == 200  # alive all the same
    finally:
        await registry.aclose()


def test_a_ready_file_names_the_urls_to_probe():
    assert ready_urls("http://h:1") == ["http://h:1"]
    assert ready_urls('{"control": "http://h:2", "intake": ""}') == ["http://h:2"]
    assert ready_urls('{"control": "http://h:2", "intake": "http://h:3"}') == ["http://h:2", "http://h:3"]


async def test_the_launcher_waits_for_ready_not_for_the_ready_file(tmp_path):
    """A service that wrote its ready file but answers `/ready` 503 is not started yet: the
    wait ends once it answers 200, and a service never ready fails with the reason it gave."""
    flag = tmp_path / "flag"
    launcher = Launcher(tmp_path / "run", env={"PDKV_TEST_READY_FLAG": str(flag)})
    try:
        child = launcher.spawn("svc", "tests.ready_service", [])
        waiting = asyncio.create_task(launcher.wait_ready(child, 30))
        deadline = asyncio.get_running_loop().time() + 30
        while not child.ready_file.exists():
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert not waiting.done()  # the file is there, /ready says 503
        flag.touch()
        url = await asyncio.wait_for(waiting, 10)
        assert (await _get(f"{url}/ready"))[0] == 200

        flag.unlink()
        never = launcher.spawn("svc2", "tests.ready_service", [])
        while not never.ready_file.exists():
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        with pytest.raises(ServiceNotReady, match="503.*the flag is not set"):
            await launcher.wait_ready(never, 2)
    finally:
        await launcher.stop_all(grace=5)


def test_sglangs_manager_reports_its_exporters_and_fetchers_readiness():
    """`PdkvKVManager.readiness()`, the hook a probe under SGLang calls: not ready while an
    exporter is not (naming it and why), nor where a decode's fetcher failed to start."""
    import concurrent.futures
    import threading
    from types import SimpleNamespace

    from transfer.sglang.conn import PdkvKVManager

    def exporter(ready: bool, why: str) -> SimpleNamespace:
        return SimpleNamespace(exporter=SimpleNamespace(readiness=lambda: (ready, why)))

    mgr = object.__new__(PdkvKVManager)  # its parts only: no SGLang arguments, no UCX
    mgr.engine_id, mgr._lock, mgr._fetchers = "dp0", threading.Lock(), {}
    mgr.exporters = {"": exporter(True, "registered, UCX up"), "-draft": exporter(False, "not registered")}
    assert mgr.readiness() == (False, "exporter dp0-draft: not registered")
    mgr.exporters = {"": exporter(True, "registered, UCX up")}
    assert mgr.readiness() == (True, "ready")
    failed: concurrent.futures.Future[object] = concurrent.futures.Future()
    failed.set_exception(RuntimeError("no UCX"))
    mgr._fetchers = {("10.0.0.1:8998", ""): failed, ("10.0.0.2:8998", ""): concurrent.futures.Future()}
    assert mgr.readiness() == (False, "fetcher of 10.0.0.1:8998 failed to start: no UCX")
