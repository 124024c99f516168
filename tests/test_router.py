"""The PD router end to end: real processes, loopback UCX, every byte verified by decode."""

import asyncio
import dataclasses
import os
import signal
from pathlib import Path

import pytest
import pytest_asyncio

from pdkv.errors import UnknownRoomError
from transfer.app.api import DecodeReply, DecodeRequest
from transfer.app.router import Deployment, DeploymentSpec

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = DeploymentSpec(
    engines=(2, 3),
    decoders=2,
    preset="tiny",
    prefill_pool_tokens=8192,
    decode_pool_tokens=8192,
    layer_delay=0.02,
    start_timeout=180,
)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def deployment():
    async with Deployment(SPEC) as d:
        yield d


async def _settled(d: Deployment, timeout: float = 10.0) -> dict:
    """Stats once nothing is pinned anywhere (frees are asynchronous), or the last seen."""
    for _ in range(int(timeout / 0.1)):
        stats = await d.stats()
        if all(s["pinned_pages"] == 0 for s in stats["prefill"]) and all(
            s["pages_in_use"] == 0 for s in stats["decode"]
        ):
            return stats
        await asyncio.sleep(0.1)
    return stats


async def test_50_requests_over_two_engines_and_two_decoders(deployment):
    sizes = [1 + (i * 37) % 400 for i in range(50)]
    outs = await asyncio.gather(
        *(deployment.submit(n, prefix_id=i % 3 if i % 4 == 0 else -1, prefix_tokens=64) for i, n in enumerate(sizes))
    )
    assert [o.error for o in outs if not o.ok] == []
    assert {o.engine_id for o in outs} == {"prefill0", "prefill1"}
    for o, n in zip(outs, sizes):
        assert o.decode.verified_bytes == n * 7 * (48 + 132)
    stats = await _settled(deployment)
    assert sum(s["fetches"] for s in stats["decode"]) >= 50
    assert all(s["fetches"] > 0 for s in stats["decode"])


async def test_cancelling_a_request_in_flight_releases_every_page(deployment):
    task = asyncio.create_task(deployment.submit(2000, engine_id="prefill1"))
    # Cancel once the room is pinned: prefill is part-way (7 layers x 20 ms), and the decode
    # cannot have answered, since it releases the room before it answers.
    for _ in range(200):
        stats = await deployment.stats()
        if any(s["pinned_pages"] for s in stats["prefill"]):
            break
        await asyncio.sleep(0.005)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await _settled(deployment)
    assert all(s["pinned_pages"] == 0 and s["live_rooms"] == 0 for s in stats["prefill"]), stats
    assert all(s["pages_in_use"] == 0 for s in stats["decode"]), stats
    # The deployment keeps serving afterwards.
    assert (await deployment.submit(100, engine_id="prefill1")).ok


async def test_failing_leg_cancels_the_other_and_is_reported(deployment):
    too_big = await deployment.submit(10**6, engine_id="prefill0")  # more than either pool holds
    assert not too_big.ok and "CapacityError" in too_big.error
    # A prefill leg that cannot be reached: the decode, which would start with its ticket,
    # is never asked, and the room is aborted everywhere.
    engine = dataclasses.replace(deployment.engines[0], intake="http://127.0.0.1:9")
    before = (await deployment.stats())["decode"][0]["failures"]
    out = await deployment.router.submit_to(engine, deployment.decoders[0], 50)
    assert not out.ok and "PeerLostError" in out.error
    stats = await _settled(deployment)
    assert stats["decode"][0]["failures"] == before
    assert all(s["pinned_pages"] == 0 for s in stats["prefill"])
    assert all(s["pages_in_use"] == 0 for s in stats["decode"])


async def test_an_abort_that_overtakes_its_decode_request_refuses_it(deployment):
    """The abort and the decode request travel on separate connections; either may land first."""
    decoder, room = deployment.decoders[0], 987654321
    before = (await deployment.stats())["decode"][0]
    await deployment.client.request("POST", f"{decoder.url}/v1/rooms/{room}/abort")
    late = DecodeRequest(engine_id="prefill0", room=room, num_tokens=64, prefix_id=-1, prefix_tokens=0)
    with pytest.raises(UnknownRoomError, match="aborted before its fetch arrived"):
        await asyncio.wait_for(deployment.client.request("POST", f"{decoder.url}/v1/decode", DecodeReply, late), 5)
    after = (await deployment.stats())["decode"][0]
    assert after["failures"] == before["failures"] + 1 and after["pages_in_use"] == 0


async def test_a_dead_worker_is_noticed_and_requests_fail_fast(deployment):
    victim = next(c for c in deployment.launcher.children if c.name == "decode1")
    os.kill(victim.pid, signal.SIGKILL)
    victim.popen.wait(timeout=10)
    out = await asyncio.wait_for(deployment.submit(30, decoder=1), 5)
    assert not out.ok and "decode1 exited" in out.error
    assert deployment.dead_children() == ["decode1 (exit -9)"]
    assert (await deployment.submit(30, decoder=0)).ok  # the rest keeps serving


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


async def test_shutdown_leaves_no_child_behind():
    spec = DeploymentSpec(engines=(2,), decoders=1, preset="tiny", prefill_pool_tokens=512, decode_pool_tokens=512)
    d = Deployment(spec)
    async with d:
        assert (await d.submit(40)).ok
        pids = [c.pid for c in d.launcher.children]
    assert all(not _alive(p) for p in pids)
    assert {c.name: c.popen.returncode for c in d.launcher.children} == {c.name: 0 for c in d.launcher.children}


def _prefill_command_lines(spec: DeploymentSpec, tmp_path, monkeypatch) -> list[list[str]]:
    """The arguments the supervisor would start each prefill rank of `spec`'s engine with."""
    from transfer.app.supervisor import Supervisor

    spawned: list[list[str]] = []
    sup = Supervisor(spec, tmp_path)
    monkeypatch.setattr(sup, "_spawn", lambda name, module, args, host: spawned.append(args))
    sup.registry_url = "http://127.0.0.1:1"
    sup._spawn_engine("prefill0", spec.engines[0])
    return spawned


async def test_the_owner_progress_setting_reaches_each_prefill_ranks_timeouts(tmp_path, monkeypatch):
    """A deployment between hosts over TCP lowers how often owners drive UCX: the spec's
    value must reach every prefill rank's `Timeouts`, through its command line."""
    from transfer.app import prefill_worker

    spawned = _prefill_command_lines(DeploymentSpec(engines=(2,), owner_progress=0.002), tmp_path, monkeypatch)
    assert len(spawned) == 2
    for args in spawned:
        parsed = prefill_worker.parse_args([*args, "--preset", "tiny"])
        assert prefill_worker.PrefillEngineRank(parsed).timeouts.ticket_progress_interval == 0.002
        assert parsed.broadcast_ctas == 8  # the deployment's default cap


async def test_the_broadcast_sm_cap_reaches_each_prefill_ranks_command_line(tmp_path, monkeypatch):
    """The SMs a prefill's owner broadcast may take are a deployment setting (it runs
    beside the model's compute): the spec's cap must reach every prefill rank."""
    from transfer.app import prefill_worker

    spawned = _prefill_command_lines(DeploymentSpec(engines=(3,), broadcast_ctas=16), tmp_path, monkeypatch)
    assert [prefill_worker.parse_args(args).broadcast_ctas for args in spawned] == [16, 16, 16]
