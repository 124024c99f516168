"""The bootstrap registry over real sockets: leases, completeness, the shared secret."""

import asyncio
import time

import numpy as np
import pytest
import torch

from pdkv import AuthError, DSAKVPool, MetadataError, NotReadyError, UnknownEngineError, tiny
from tests.wire_helpers import rank_descriptor
from transfer.control import ControlClient
from transfer.deadline import Deadline
from transfer.decode import DecodeFetcher
from transfer.metadata import EngineDescriptor
from transfer.prefill import PrefillExporter
from transfer.registry import HttpRegistry
from transfer.registry.server import Registry, RegistryServer
from transfer.timeouts import Timeouts


async def test_engine_complete_only_with_every_rank_and_expires_without_renewal():
    server = RegistryServer(timeouts=Timeouts(lease=0.4), grace=0.0)
    url = await server.start()
    client = ControlClient(Timeouts())
    try:
        with pytest.raises(UnknownEngineError, match="never registered"):
            await client.request("GET", f"{url}/v1/engines/e0", EngineDescriptor)
        for r in (0, 1):
            await client.request("PUT", f"{url}/v1/engines/e0/ranks/{r}", body=rank_descriptor(r))
        with pytest.raises(NotReadyError, match=r"\[2\]"):
            await client.request("GET", f"{url}/v1/engines/e0", EngineDescriptor)
        await client.request("PUT", f"{url}/v1/engines/e0/ranks/2", body=rank_descriptor(2))
        engine = await client.request("GET", f"{url}/v1/engines/e0", EngineDescriptor)
        assert [r.cp_rank for r in engine.ranks] == [0, 1, 2]
        await asyncio.sleep(0.6)  # nobody renews
        with pytest.raises(NotReadyError, match="it was before"):  # seen: it may come back, so waited for
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


def test_an_engine_never_seen_is_unknown_only_after_the_registrys_grace():
    """A registry cannot tell a mistyped engine from one whose prefill has not registered
    yet, or has not renewed since the registry restarted: during its first `grace` seconds it
    answers "not yet" (wait); after, "never heard of" (fail). An engine seen before is
    always waited for (its lease lapsed, it may be restarting)."""
    registry = Registry(lease=10.0, grace=5.0, now=100.0)
    with pytest.raises(NotReadyError, match="not registered yet"):
        registry.lookup("nope", now=104.0)
    with pytest.raises(UnknownEngineError, match="never registered"):
        registry.lookup("nope", now=105.5)
    registry.put(rank_descriptor(0), now=100.0)
    with pytest.raises(NotReadyError, match=r"\[1, 2\]"):
        registry.lookup("e0", now=106.0)
    assert registry.expire(now=111.0) == [("e0", 0)]
    with pytest.raises(NotReadyError, match="it was before"):
        registry.lookup("e0", now=200.0)
    registry.remove("e0", 0)
    with pytest.raises(NotReadyError, match="it was before"):
        registry.lookup("e0", now=300.0)
    assert Registry(lease=7.0).grace == 7.0  # by default one lease: every live rank renews within it


async def test_a_mistyped_engine_fails_typed_at_once_not_at_the_lookup_deadline():
    """A decode's fetch from an engine the registry never saw (past its grace) fails with
    UnknownEngineError in well under a second, where it waited out the 30 s lookup."""
    layout = tiny(layer_num=3)
    server = RegistryServer(grace=0.0)
    url = await server.start()
    try:
        async with (
            PrefillExporter(DSAKVPool(layout), "prefill0", 0, 1, url),
            DecodeFetcher(DSAKVPool(layout), url) as fetcher,
        ):
            started = time.monotonic()
            with pytest.raises(UnknownEngineError, match="'nope' was never registered"):
                await fetcher.fetch("nope", 1, [1, 2], timeout=30)
            assert time.monotonic() - started < 1.0
            client = HttpRegistry(url, Timeouts())
            try:
                started = time.monotonic()
                with pytest.raises(UnknownEngineError):
                    await client.lookup("prefil0", Deadline.after(30))
                assert time.monotonic() - started < 1.0
            finally:
                await client.aclose()
    finally:
        await server.aclose()


async def test_a_decode_that_asks_before_its_prefill_registered_waits_for_it():
    """The start-up race: a decode looks the engine up moments before its prefill registers
    (the registry in its grace): the lookup waits, and the fetch reads the room once it comes."""
    layout = tiny(layer_num=3)
    src = DSAKVPool(layout)
    src.slab.view(-1).copy_(torch.arange(src.slab.nbytes) % 241)
    server = RegistryServer(grace=30.0)
    url = await server.start()
    try:
        async with DecodeFetcher(DSAKVPool(layout), url) as fetcher:
            early = asyncio.create_task(fetcher.fetch("late0", 1, [1, 2], timeout=30))
            await asyncio.sleep(0.3)
            assert not early.done()
            async with PrefillExporter(src, "late0", 0, 1, url) as exp:
                exp.publish_room(1, np.array([4, 5]))
                exp.mark_ready(1, layout.layer_num)
                result = await early
            assert result.nbytes > 0
            dst = fetcher.pool
            for layer in range(layout.layer_num):  # byte for byte: source pages 4, 5 in pages 1, 2
                for kind, size in ((0, layout.kv_page_bytes), (1, layout.index_page_bytes)):
                    a = (src.kv_buffer, src.index_buffer)[kind][layer].view(torch.uint8).reshape(-1)
                    b = (dst.kv_buffer, dst.index_buffer)[kind][layer].view(torch.uint8).reshape(-1)
                    assert torch.equal(b[size : 3 * size], a[4 * size : 6 * size])
    finally:
        await server.aclose()


async def test_the_registry_answers_ready_and_says_whether_it_is_in_its_grace():
    server = RegistryServer(grace=30.0)
    url = await server.start()
    client = ControlClient(Timeouts())
    try:
        ready = await client.get_json(f"{url}/ready")
        assert ready["status"] == "ready" and ready["in_grace"] is True
    finally:
        await client.aclose()
        await server.aclose()
