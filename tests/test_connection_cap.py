"""A client hoarding idle connections cannot lock others out of an HTTP service (issue 29.3).

At its connection limit a service evicts an idle connection (no request in progress),
silent ones before those part way through a request head, oldest first; a request in
progress is never evicted, and a newcomer is refused only when every other connection
is serving one.
"""

import asyncio
import resource
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import pytest_asyncio
from aiohttp import web

from tests.http_probe import closed_by_server, raise_open_files_limit
from transfer.app.router import Deployment, DeploymentSpec
from transfer.control import ControlClient, HttpService, make_app
from transfer.http_guard import FD_RESERVE, MAX_CONNECTIONS
from transfer.metadata import EngineDescriptor
from transfer.timeouts import Timeouts

HOARD = 2000  # idle sockets the other client keeps open, about twice the default limit
ROOT = Path(__file__).resolve().parents[1]
HEAD = b"GET /v1/ok HTTP/1.1\r\nHost: x\r\n"  # a request head without its closing blank line


async def _serve(limit: int) -> tuple[HttpService, asyncio.Event, list[int]]:
    """A service with a route that holds its request until `release` is set."""
    release, entered = asyncio.Event(), [0]

    async def hold(request: web.Request) -> web.Response:
        entered[0] += 1
        await release.wait()
        return web.Response(text="ok")

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = make_app(None)
    app.router.add_get("/v1/hold", hold)
    app.router.add_get("/v1/ok", ok)
    svc = HttpService(app, max_connections=limit)
    await svc.start()
    return svc, release, entered


async def _connect(svc: HttpService) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(svc.url)
    return await asyncio.open_connection(parts.hostname, parts.port)


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _served(reader: asyncio.StreamReader) -> bool:
    """True if a 200 comes; reads the whole reply (both routes answer two bytes)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    await asyncio.wait_for(reader.readexactly(len(b"ok")), 5)
    return head.startswith(b"HTTP/1.1 200")


async def test_a_request_in_progress_is_never_evicted():
    svc, release, entered = await _serve(limit=2)
    try:
        busy = [await _connect(svc) for _ in range(2)]
        for _, w in busy:
            w.write(b"GET /v1/hold HTTP/1.1\r\nHost: x\r\n\r\n")
        await _until(lambda: entered[0] == 2, "both requests in their handler")
        late_reader, late_writer = await _connect(svc)
        assert await closed_by_server(late_reader, 5.0)  # every other connection is serving a request
        release.set()
        for r, _ in busy:
            assert await _served(r)
        for _, w in [*busy, (late_reader, late_writer)]:
            w.close()
    finally:
        await svc.aclose()


async def test_silent_connections_are_evicted_before_one_part_way_through_its_head():
    svc, _, _ = await _serve(limit=2)
    try:
        slow = await _connect(svc)
        slow[1].write(HEAD)
        await _until(lambda: len(svc._guard.heads) == 1, "the partial head received")
        silent = await _connect(svc)
        newcomer = await _connect(svc)
        assert await closed_by_server(silent[0], 5.0)  # younger than `slow`, but silent
        slow[1].write(b"\r\n")  # `slow` finishes its head and is served
        assert await _served(slow[0])
        # With no silent connection left but the newcomer, the oldest partial head goes.
        newcomer[1].write(HEAD)
        await _until(lambda: len(svc._guard.heads) == 1, "the newcomer's partial head received")
        last = await _connect(svc)
        assert await closed_by_server(slow[0], 5.0)  # idle since its reply, older than `newcomer`
        newcomer[1].write(b"\r\n")
        assert await _served(newcomer[0])
        for _, w in (slow, silent, newcomer, last):
            w.close()
    finally:
        await svc.aclose()


# ---- real services, the default limit, a client hoarding twice as many sockets ---------------


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def deployment():
    # The services inherit it: the default limit needs MAX_CONNECTIONS + FD_RESERVE open files.
    if raise_open_files_limit(8192) < MAX_CONNECTIONS + FD_RESERVE + 64:
        pytest.skip("the open-files limit is too low to hold the default connection limit")
    spec = DeploymentSpec(engines=(1,), decoders=1, preset="tiny", prefill_pool_tokens=1024, decode_pool_tokens=1024)
    async with Deployment(spec) as d:
        yield d


async def _hoard(url: str, count: int = HOARD) -> asyncio.subprocess.Process:
    """Start a client that holds `count` idle sockets to `url`, reopening each one the server
    closes; returns once all have connected and the service has evicted some of them."""
    parts = urlsplit(url)
    hog = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.http_probe",
        str(parts.hostname),
        str(parts.port),
        str(count),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    assert hog.stdout is not None
    lines = []
    while not lines or not lines[-1].startswith(b"opened") or int(lines[-1].split()[1]) <= count:
        lines.append(await asyncio.wait_for(hog.stdout.readline(), 60))
        assert lines[-1], f"the hoarding client ended: {lines}"
    return hog


async def _timed(request) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    await request
    return time.monotonic() - start


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("service", ["registry", "exporter", "decode"])
async def test_a_request_is_served_within_a_second_while_another_client_hoards_idle_sockets(deployment, service):
    url = {
        "registry": deployment.registry_url,
        "exporter": deployment.engines[0].controls[0],
        "decode": deployment.decoders[0].url,
    }[service]
    hog = await _hoard(url)
    try:
        for _ in range(5):
            client = ControlClient(Timeouts())  # a fresh connection for each request
            try:
                if service == "registry":
                    ask = client.request("GET", f"{url}/v1/engines/prefill0", EngineDescriptor)
                else:
                    ask = client.get_json(f"{url}/v1/stats")
                assert await _timed(ask) < 1.0
            finally:
                await client.aclose()
    finally:
        hog.kill()
        await hog.wait()


async def test_a_low_open_files_limit_lowers_the_connection_limit_before_accept_fails(tmp_path):
    """With 400 open files a service holds at most 400 - FD_RESERVE connections: it evicts
    before accept() runs out of files, which would stop it accepting anyone for a second."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ready = tmp_path / "registry.url"
    registry = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "transfer.app.bootstrap_registry", "--ready-file", str(ready), "--die-with-parent"),
        cwd=ROOT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (400, hard)),
    )
    try:
        for _ in range(600):
            if ready.exists() or registry.returncode is not None:
                break
            await asyncio.sleep(0.1)
        url = ready.read_text()
        hog = await _hoard(url, count=600)
        try:
            for _ in range(5):
                client = ControlClient(Timeouts())
                try:
                    assert await _timed(client.get_json(f"{url}/health")) < 1.0
                finally:
                    await client.aclose()
        finally:
            hog.kill()
            await hog.wait()
    finally:
        registry.terminate()
        await registry.wait()
