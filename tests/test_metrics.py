"""Prometheus metrics (`/metrics` on every service; `transfer.metrics`)."""

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.parser import text_string_to_metric_families

from pdkv import DSAKVPool, PdkvError, tiny
from transfer.decode import DecodeFetcher
from transfer.prefill import PrefillExporter
from transfer.registry.server import RegistryServer


async def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


async def test_an_exporters_rooms_are_scraped_without_the_secret():
    layout = tiny(layer_num=4)
    registry = RegistryServer(secret="s3cret")
    url = await registry.start()
    try:
        async with PrefillExporter(DSAKVPool(layout, owned=range(2, 4)), "e9", 1, 2, url, secret="s3cret") as exp:
            labels = (("cp_rank", "1"), ("engine", "e9"))
            before = await _scrape(exp.control_url)
            assert before[("pdkv_pinned_pages", labels)] == 0
            exp.publish_room(5, np.array([3, 4, 9]))
            after = await _scrape(exp.control_url)
            assert after[("pdkv_pinned_pages", labels)] == 3 and after[("pdkv_pinned_rooms", labels)] == 1
            assert after[("pdkv_rooms_published_total", labels)] == before[("pdkv_rooms_published_total", labels)] + 1
            exp.abort_room(5)
            assert (await _scrape(exp.control_url))[("pdkv_pinned_pages", labels)] == 0
        assert ("pdkv_pinned_pages", labels) not in await _scrape(url)  # closed: no longer reported
    finally:
        await registry.aclose()


_RATE_BUCKET = "pdkv_fetch_bytes_per_second_bucket"


def _delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return after.get(_key(name, **labels), 0.0) - before.get(_key(name, **labels), 0.0)


async def _wait_for(predicate, what: str, limit: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + limit
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


async def test_a_decodes_fetches_are_labelled_by_engine_with_rate_and_fetches_in_flight():
    """Real fetches over loopback UCX: each histogram and the failures carry the prefill's
    engine; the rate is the fetch's bytes over its seconds; a fetch waiting for its layers
    is in flight until it ends."""
    layout = tiny(layer_num=3)
    src = DSAKVPool(layout)
    src.slab.view(-1).copy_(torch.arange(src.slab.nbytes) % 251)
    registry = RegistryServer()
    url = await registry.start()
    try:
        async with PrefillExporter(src, "m1", 0, 1, url) as exp, DecodeFetcher(DSAKVPool(layout), url) as fetcher:
            before = await _scrape(exp.control_url)
            exp.publish_room(1, np.array([3, 4, 9]))
            exp.mark_ready(1, layout.layer_num)
            first = await fetcher.fetch("m1", 1, [1, 2, 3], timeout=20)

            exp.publish_room(2, np.array([5, 6]))
            waiting = asyncio.create_task(fetcher.fetch("m1", 2, [7, 8], timeout=20))

            async def in_flight_is(n: int) -> bool:
                return (await _scrape(exp.control_url)).get(("pdkv_fetches_in_flight", (("engine", "m1"),))) == n

            await _wait_for(lambda: in_flight_is(1), "the waiting fetch in flight")
            exp.mark_ready(2, layout.layer_num)
            second = await waiting
            await _wait_for(lambda: in_flight_is(0), "no fetch in flight once it returned")

            exp.publish_room(3, np.array([10]))
            doomed = asyncio.create_task(fetcher.fetch("m1", 3, [11], timeout=20))
            await _wait_for(lambda: in_flight_is(1), "the doomed fetch in flight")
            exp.abort_room(3)
            with pytest.raises(PdkvError) as failed:
                await doomed
            await asyncio.sleep(0)  # results are observed just after the fetch returns
            after = await _scrape(exp.control_url)
    finally:
        await registry.aclose()

    done = (first, second)
    m1 = {"engine": "m1"}
    assert _delta(after, before, "pdkv_fetch_seconds_count", protocol="claims", **m1) == 2
    assert _delta(after, before, "pdkv_fetch_seconds_sum", protocol="claims", **m1) == pytest.approx(
        sum(r.seconds for r in done)
    )
    assert _delta(after, before, "pdkv_fetch_bytes_count", **m1) == 2
    assert _delta(after, before, "pdkv_fetch_bytes_sum", **m1) == sum(r.nbytes for r in done) > 0
    assert _delta(after, before, "pdkv_fetch_descriptors_sum", **m1) == sum(r.descriptors for r in done) > 0
    assert _delta(after, before, "pdkv_fetch_bytes_per_second_count", **m1) == 2
    assert _delta(after, before, "pdkv_fetch_bytes_per_second_sum", **m1) == pytest.approx(
        sum(r.gbps for r in done) * 1e9
    )
    rates = [r.nbytes / r.seconds for r in done]
    buckets = {float(dict(labels)["le"]): dict(labels)["le"] for (n, labels) in after if n == _RATE_BUCKET}
    assert min(buckets) == 0.1e9 and max(b for b in buckets if b != float("inf")) == 2000e9
    for bound, le in buckets.items():  # cumulative: each rate counted at every bound at or over it
        assert _delta(after, before, _RATE_BUCKET, le=le, **m1) == sum(rate <= bound for rate in rates)
    reads = sum(o.reads for r in done for o in r.owners)
    assert reads >= 2 and _delta(after, before, "pdkv_read_seconds_count", lane="ucx", **m1) == reads
    error = type(failed.value).__name__
    assert _delta(after, before, "pdkv_fetch_failures_total", error=error, **m1) == 1
    assert after[("pdkv_fetches_in_flight", (("engine", "m1"),))] == 0


async def test_reads_under_a_lease_count_as_fetches_and_each_read_inside_once():
    """A lease read twice counts two fetches (seconds, bytes) and, in `pdkv_read_seconds`,
    each READ it posted: `OwnerStats.reads` summed. A `read_once` counts one more."""
    layout = tiny(layer_num=3)
    registry = RegistryServer()
    url = await registry.start()
    try:
        async with (
            PrefillExporter(DSAKVPool(layout), "lz1", 0, 1, url) as exp,
            DecodeFetcher(DSAKVPool(layout), url) as fetcher,
        ):
            exp.publish_room(1, np.array([3, 4]))
            exp.mark_ready(1, layout.layer_num)
            exp.publish_room(2, np.array([5]))
            exp.mark_ready(2, layout.layer_num)
            before = await _scrape(exp.control_url)
            async with await fetcher.claim("lz1", 1, timeout=20) as lease:
                results = [await lease.read([1, 2], timeout=20), await lease.read([5, 6], timeout=20)]
            ahead = await fetcher.claim("lz1", 2, timeout=20)
            results.append(await ahead.read_once([7], timeout=20))
            await asyncio.sleep(0.05)  # observed just after each read returns
            after = await _scrape(exp.control_url)
    finally:
        await registry.aclose()
    lz1 = {"engine": "lz1"}
    fetches = sum(_delta(after, before, "pdkv_fetch_seconds_count", protocol=p, **lz1) for p in ("claims", "ticket"))
    assert fetches == 3
    assert _delta(after, before, "pdkv_fetch_bytes_sum", **lz1) == sum(r.nbytes for r in results) > 0
    reads = sum(o.reads for r in results for o in r.owners)
    lanes = {dict(labels).get("lane") for (n, labels) in after if n == "pdkv_read_seconds_count"}
    assert sum(_delta(after, before, "pdkv_read_seconds_count", lane=lane, **lz1) for lane in lanes) == reads >= 3


async def test_registry_notification_and_build_series_are_scraped():
    """`pdkv_build_info`; a registry lookup's latency by outcome and its failures by class
    (a mistyped engine, typed at once); renewals that failed (the registry gone); notification
    failures and retransmissions, through the functions a release's sender calls."""
    from pdkv import UnknownEngineError
    from transfer import metrics
    from transfer.metadata import SCHEMA_VERSION
    from transfer.timeouts import Timeouts

    layout = tiny(layer_num=3)
    registry = RegistryServer(grace=0.0)
    url = await registry.start()
    try:
        async with (
            PrefillExporter(DSAKVPool(layout), "rg1", 0, 1, url, timeouts=Timeouts(lease=0.6)) as exp,
            DecodeFetcher(DSAKVPool(layout), url) as fetcher,
        ):
            before = await _scrape(exp.control_url)
            exp.publish_room(1, np.array([3]))
            exp.mark_ready(1, layout.layer_num)
            await fetcher.fetch("rg1", 1, [1], timeout=20)
            with pytest.raises(UnknownEngineError):
                await fetcher.fetch("rg-typo", 1, [1], timeout=20)

            metrics.observe_retransmission("release")
            metrics.observe_retransmission("release")
            metrics.observe_notification_failure("give_up")
            await registry.aclose()  # the exporter's renewals fail from now on

            async def renewal_failed() -> bool:
                return any(k[0] == "pdkv_registry_register_failures_total" for k in await _scrape(exp.control_url))

            await _wait_for(renewal_failed, "a renewal counted as failed")
            after = await _scrape(exp.control_url)
    finally:
        await registry.aclose()
    build = [labels for (n, labels) in after if n == "pdkv_build_info"]
    assert len(build) == 1 and after[("pdkv_build_info", build[0])] == 1
    assert dict(build[0])["schema"] == str(SCHEMA_VERSION) and "ucx" in dict(build[0])["lanes"]
    assert _delta(after, before, "pdkv_registry_lookup_seconds_count", outcome="ok") == 1
    assert _delta(after, before, "pdkv_registry_lookup_seconds_count", outcome="failed") == 1
    assert _delta(after, before, "pdkv_registry_lookup_failures_total", error="UnknownEngineError") == 1
    renewals = {k: v for k, v in after.items() if k[0] == "pdkv_registry_register_failures_total"}
    assert renewals and all(v >= 1 for v in renewals.values())  # renewals while the registry was away
    # 2 here, and the fetch's own release, sent again where its owner had not freed the room in
    # 0.1 s (a claims fetch releases by notification, as a ticket's does): seen under CI load.
    assert _delta(after, before, "pdkv_notification_retransmissions_total", kind="release") >= 2
    assert _delta(after, before, "pdkv_notification_failures_total", kind="give_up") == 1


_SCOPE = ("pdkv-test-model", 1, 2)


async def _multiprocess_child() -> None:
    """Run with PROMETHEUS_MULTIPROC_DIR set: an exporter and a decode in this process write
    their metrics to the directory; the parent merges them between steps said on stdout."""
    from transfer import metrics

    assert metrics.MULTIPROCESS
    metrics.ROOM_SAMPLE_SECONDS = 0.05
    metrics.set_scope(*_SCOPE)  # as SGLang's adapter does: the labels that join SGLang's series
    loop = asyncio.get_running_loop()

    async def step(**facts: object) -> None:
        await asyncio.sleep(0.3)  # several samples of the rooms
        print("PDKV " + json.dumps(facts), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)

    layout = tiny(layer_num=3)
    registry = RegistryServer()
    url = await registry.start()
    try:
        async with PrefillExporter(DSAKVPool(layout), "mp1", 0, 1, url) as exp:
            async with DecodeFetcher(DSAKVPool(layout), url) as fetcher:
                exp.publish_room(1, np.array([3, 4, 9]))
                exp.mark_ready(1, layout.layer_num)
                first = await fetcher.fetch("mp1", 1, [1, 2, 3], timeout=20)
                exp.publish_room(3, np.array([10]))
                doomed = asyncio.create_task(fetcher.fetch("mp1", 3, [11], timeout=20))
                await asyncio.sleep(0.2)
                exp.abort_room(3)
                error = ""
                try:
                    await doomed
                except PdkvError as exc:
                    error = type(exc).__name__
                exp.publish_room(2, np.array([5, 6]))
                waiting = asyncio.create_task(fetcher.fetch("mp1", 2, [7, 8], timeout=20))
                reads = sum(o.reads for o in first.owners)
                await step(
                    pid=os.getpid(), nbytes=first.nbytes, descriptors=first.descriptors, reads=reads, error=error
                )
                exp.mark_ready(2, layout.layer_num)
                second = await waiting
        await step(nbytes=second.nbytes)  # the exporter closed
    finally:
        await registry.aclose()


def test_room_gauges_and_fetch_metrics_merge_in_multiprocess_mode(tmp_path):
    """As under SGLang's PROMETHEUS_MULTIPROC_DIR: an exporter's rooms and a decode's fetches,
    written by another process, come out of MultiProcessCollector right; the rooms while the
    exporter lives and 0 once it has closed; its live gauges gone once the process is marked dead."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "UCX_MODULES": "^ib"}
    code = "import asyncio, tests.test_metrics as t; asyncio.run(t._multiprocess_child())"
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).parent.parent,
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    watchdog = threading.Timer(120, child.kill)
    watchdog.start()
    try:
        first = _next_step(child)
        scope = dict(zip(("model_name", "tp_rank", "dp_rank"), map(str, _SCOPE)))
        rank, engine = {"engine": "mp1", "cp_rank": "0", **scope}, {"engine": "mp1", **scope}
        merged = _merged(tmp_path)
        assert merged[_key("pdkv_pinned_pages", **rank)] == 2  # room 2 (room 1 released, room 3 aborted)
        assert merged[_key("pdkv_pinned_rooms", **rank)] == 1
        assert merged[_key("pdkv_tickets_out", **rank)] == 0
        assert merged[_key("pdkv_rooms_published_total", **rank)] == 3
        assert merged[_key("pdkv_rooms_released_total", **rank)] == 1
        assert merged[_key("pdkv_rooms_aborted_total", **rank)] == 1
        assert merged[_key("pdkv_fetches_in_flight", **engine)] == 1  # room 2's, waiting for its layers
        assert merged[_key("pdkv_fetch_seconds_count", protocol="claims", **engine)] == 1
        assert merged[_key("pdkv_fetch_bytes_sum", **engine)] == first["nbytes"] > 0
        assert merged[_key("pdkv_fetch_descriptors_sum", **engine)] == first["descriptors"] > 0
        assert merged[_key("pdkv_fetch_bytes_per_second_count", **engine)] == 1
        assert merged[_key("pdkv_read_seconds_count", lane="ucx", **engine)] == first["reads"] > 0
        assert first["error"] and merged[_key("pdkv_fetch_failures_total", error=first["error"], **engine)] == 1

        child.stdin.write("\n")
        child.stdin.flush()
        second = _next_step(child)
        merged = _merged(tmp_path)
        assert merged[_key("pdkv_pinned_pages", **rank)] == 0 and merged[_key("pdkv_pinned_rooms", **rank)] == 0
        assert merged[_key("pdkv_rooms_released_total", **rank)] == 2
        assert merged[_key("pdkv_fetches_in_flight", **engine)] == 0
        assert merged[_key("pdkv_fetch_bytes_sum", **engine)] == first["nbytes"] + second["nbytes"]
        assert merged[_key("pdkv_fetch_seconds_count", protocol="claims", **engine)] == 2

        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(60) == 0
    finally:
        watchdog.cancel()
        child.kill()
    mark_process_dead(first["pid"], str(tmp_path))
    merged = _merged(tmp_path)
    assert _key("pdkv_pinned_pages", **rank) not in merged and _key("pdkv_fetches_in_flight", **engine) not in merged
    assert merged[_key("pdkv_rooms_published_total", **rank)] == 3  # counters outlive their process


def _next_step(child: subprocess.Popen) -> dict:  # type: ignore[type-arg]
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("PDKV "):
            return json.loads(line[5:])
    raise AssertionError(f"the child ended (rc {child.wait()}) before its step")


def _merged(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


def _key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


def test_the_grafana_dashboard_parses_and_queries_only_pdkv_metrics_that_exist():
    """docs/grafana-pdkv.json: Prometheus as a variable on every panel, the operator's panels,
    and every `pdkv_` series it names is one that pdkv's registry exposes."""
    import re

    from prometheus_client import REGISTRY

    dashboard = json.loads((Path(__file__).parent.parent / "docs" / "grafana-pdkv.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    titles = " | ".join(p["title"] for p in panels).lower()
    wanted_panels = ("transfer rate", "latency p50 / p99", "failures by error", "pinned pages", "in flight")
    wanted_panels += ("aborted and expired rooms", "notification failures", "registry health", "claim relay")
    for wanted in wanted_panels:
        assert wanted in titles
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])

    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    exposed = {f.name + s for f in REGISTRY.collect() if f.name.startswith("pdkv_") for s in suffixes[f.type]}
    queries = [t["expr"] for p in panels for t in p["targets"]] + [variables["engine"]["query"]["query"]]
    named = {name for q in queries for name in re.findall(r"\bpdkv_[a-z0-9_]+", q)}
    assert {"pdkv_fetch_bytes_per_second_bucket", "pdkv_fetch_seconds_bucket", "pdkv_fetches_in_flight"} <= named
    assert {"pdkv_rooms_aborted_total", "pdkv_rooms_expired_total", "pdkv_notification_failures_total"} <= named
    assert {"pdkv_notification_retransmissions_total", "pdkv_registry_lookup_seconds_bucket"} <= named
    assert {"pdkv_registry_lookup_failures_total", "pdkv_registry_register_failures_total"} <= named
    assert "pdkv_claim_relay_seconds_bucket" in named
    assert named <= exposed, f"not in pdkv's registry: {sorted(named - exposed)}"
