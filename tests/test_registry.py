"""The bootstrap registry over real sockets: leases, completeness, the shared secret."""

import asyncio

import pytest

from pdkv import AuthError, MetadataError, NotReadyError, UnknownEngineError
from tests.wire_helpers import rank_descriptor
from transfer.http import ControlClient
from transfer.metadata import EngineDescriptor
from transfer.registry.server import RegistryServer
from transfer.timeouts import Timeouts


async def test_engine_complete_only_with_every_rank_and_expires_without_renewal():
    server = RegistryServer(timeouts=Timeouts(lease=0.4))
    url = await server.start()
    client = ControlClient(Timeouts())
    try:
        with pytest.raises(UnknownEngineError):
            await client.request("GET", f"{url}/v1/engines/e0", EngineDescriptor)
        for r in (0, 1):
            await client.request("PUT", f"{url}/v1/engines/e0/ranks/{r}", body=rank_descriptor(r))
        with pytest.raises(NotReadyError, match=r"\[2\]"):
            await client.request("GET", f"{url}/v1/engines/e0", EngineDescriptor)
        await client.request("PUT", f"{url}/v1/engines/e0/ranks/2", body=rank_descriptor(2))
        engine = await client.request("GET", f"{url}/v1/engines/e0", EngineDescriptor)
        assert [r.cp_rank for r in engine.ranks] == [0, 1, 2]
        await asyncio.sleep(0.6)  # nobody renews
        with pytest.raises(UnknownEngineError):
            await client.request("GET", f"{url}/v1/engines/e0", EngineDescriptor)
        with pytest.raises(MetadataError, match="path names another"):
            await client.request("PUT", f"{url}/v1/engines/e0/ranks/0", body=rank_descriptor(1))
    finally:
        await client.aclose()
        await server.aclose()


async def test_shared_secret_guards_registration_and_lookup():
    server = RegistryServer(secret="s3cret")
    url = await server.start()
    anonymous, member = ControlClient(Timeouts()), ControlClient(Timeouts(), secret="s3cret")
    wrong = ControlClient(Timeouts(), secret="guess")
    try:
        for client in (anonymous, wrong):
            with pytest.raises(AuthError):
                await client.request("PUT", f"{url}/v1/engines/e0/ranks/0", body=rank_descriptor(0))
            with pytest.raises(AuthError):
                await client.request("GET", f"{url}/v1/engines/e0", EngineDescriptor)
        await member.request("PUT", f"{url}/v1/engines/e0/ranks/0", body=rank_descriptor(0))
        health = await anonymous.get_json(f"{url}/health")  # probes need no secret
        assert health["status"] == "ok"
    finally:
        for c in (anonymous, member, wrong):
            await c.aclose()
        await server.aclose()


async def test_garbage_bodies_get_metadata_errors_and_the_server_keeps_serving():
    server = RegistryServer()
    url = await server.start()
    client = ControlClient(Timeouts())
    try:
        sess = client._sess()
        for body in (b"", b"\xc1", b"\x93\x01\xa0", b"x" * 1000):
            async with sess.put(f"{url}/v1/engines/e0/ranks/0", data=body) as resp:
                assert resp.status == 400
        await client.request("PUT", f"{url}/v1/engines/e0/ranks/0", body=rank_descriptor(0))
    finally:
        await client.aclose()
        await server.aclose()


def test_an_etcd_url_lists_a_clusters_members_with_credentials_and_a_prefix():
    from transfer.registry.etcd import etcd_target

    members, prefix, user, password = etcd_target("etcd://ann:p%40ss@10.0.0.1:2379,10.0.0.2,etcd-3:32379/kv/a")
    assert members == [("10.0.0.1", 2379), ("10.0.0.2", 2379), ("etcd-3", 32379)]
    assert (prefix, user, password) == ("kv/a", "ann", "p@ss")
    assert etcd_target("etcd://localhost") == ([("localhost", 2379)], "pdkv", None, None)
    with pytest.raises(ValueError, match="HOST:PORT"):
        etcd_target("etcd://h1:2379,h2:port/x")
    with pytest.raises(ValueError, match="no host"):
        etcd_target("etcd:///x")
