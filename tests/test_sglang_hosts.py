"""pdkv's SGLang classes with prefill and decode on different hosts (network namespaces).

The bootstrap server and a CP=2 layer-split prefill (a process per rank, as
`tests/test_sglang.py` drives them) run on one stand-in host, a CP=1 decode on another,
joined by a bridge; UCX is held to TCP. Nothing sets an address: each prefill rank finds
the one it advertises as docs/sglang.md says ("Addresses"). Checked: every room byte for
byte, the senders' Success, that the registry holds no loopback URL, and a link cut under a
room: both sides Failed within the bounds docs/between-hosts.md states, no byte landing
after Failed, and the next room read whole once the link is back.

Skipped, with the reason, where namespaces cannot be made (no root, no iproute2).
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from tests import children
from tests.netns import HostNet, enter_netns, unavailable

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang.srt.disaggregation.base.conn  # noqa: F401
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")

from tests.test_sglang import AUX_ITEMS, AUX_ROWS, LAYERS, _aux_row, _env, _kv_args, _owned, _pattern, _prefill_rank

_WHY_NOT = unavailable()
ON_HOSTS = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no stand-in hosts: {_WHY_NOT}")

# docs/between-hosts.md, "Link cuts": the decode fails ~3 s after a cut (three silent
# heartbeats of 1 s), a prefill rank's sender within ~6 s (its reader's stream unacknowledged
# for 3 s, noticed at the next heartbeat, one of grace). Asserted with room for a loaded 2-core machine.
RECEIVER_BOUND_S = 4.5
SENDER_BOUND_S = 8.0
LOOPBACK = ("127.", "[::1]", "localhost", "0.0.0.0", "[::]")
# Across namespaces of one kernel UCX would pick cma, a same-host copy: hold it to the network.
HOST_ENV = {"UCX_TLS": "tcp"}


@pytest.fixture(autouse=True)
def _own_environment() -> Any:
    """The variables a test sets in this process end with it."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture
def hosts() -> Any:
    with HostNet(["prefill", "decode"], ipv6=True) as net:
        yield net


def _on(netns: str, fn: Callable[..., None], *args: Any) -> None:
    """`fn(*args)` in a fresh process, moved onto the stand-in host `netns` first."""
    enter_netns(netns)
    if os.environ.get("PDKV_TEST_LOG"):  # each process's log lines, stamped, for a failure's story
        import logging

        logging.basicConfig(level=logging.INFO, format=f"%(created).3f {fn.__name__} %(name)s %(message)s")
    os.environ.update(HOST_ENV)
    for name in ("SGLANG_HOST_IP", "HOST_IP", "PDKV_SGLANG_HOST", "PDKV_SGLANG_BIND"):
        os.environ.pop(name, None)  # nothing says the address: the rank finds it
    fn(*args)


def _bootstrap(host: str, out: Any, stop: Any) -> None:
    """SGLang's bootstrap server as its launcher starts it (`--host`, a free port)."""
    from transfer.sglang.conn import PdkvKVBootstrapServer

    server = PdkvKVBootstrapServer(host, 0)
    out.put(int(server.url.rsplit(":", 1)[1]))
    stop.wait(300)
    server.close()


def _start(ctx: Any, net: HostNet, host: str, fn: Callable[..., None], *args: Any) -> Any:
    p = ctx.Process(target=_on, args=(net.netns(host), fn, *args), daemon=True)
    p.start()
    return p


class Hosts:
    """The processes of one test: the bootstrap server and prefill ranks on "prefill", the
    decode on "decode"; every one is killed at the end."""

    def __init__(self, net: HostNet, bind: str = "0.0.0.0", ipv6: bool = False) -> None:
        self.net, self.ctx = net, children.context()
        self.procs: list[Any] = []
        self.stop = self.ctx.Event()
        ports = self.ctx.Queue()
        self.procs.append(_start(self.ctx, net, "prefill", _bootstrap, bind, ports, self.stop))
        port = ports.get(timeout=60)
        address = f"[{net.address6('prefill')}]" if ipv6 else net.address("prefill")
        self.bootstrap_addr = f"{address}:{port}"  # as SGLang's router names it to a decode
        self.registry = f"http://{self.bootstrap_addr}"

    def start(self, host: str, fn: Callable[..., None], *args: Any) -> None:
        self.procs.append(_start(self.ctx, self.net, host, fn, *args))

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


def _control_urls(registry: str, engine: str) -> list[str]:
    """The control URLs the registry hands a decode for `engine`, once every rank is in (the
    ranks start slowly here: SGLang's import alone takes seconds)."""
    import asyncio

    from pdkv.errors import UnknownEngineError
    from transfer.deadline import Deadline
    from transfer.registry import registry_client
    from transfer.timeouts import Timeouts

    async def look() -> list[str]:
        client = registry_client(registry, Timeouts())
        end = time.monotonic() + 120
        try:
            while True:
                try:
                    found = await client.lookup(engine, Deadline.after(30))
                    return [rank.control_url for rank in found.ranks]
                except UnknownEngineError:  # not registered yet
                    if time.monotonic() > end:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await client.aclose()

    return asyncio.run(look())


def _decode_rooms(bootstrap_addr: str, rooms: dict[int, list[int]], dst: dict[int, list[int]], out: Any) -> None:
    """A decode on its own host: each room read through a receiver, checked byte for byte
    here; the registry's control URLs reported too."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from tests.test_sglang import _receive
    from transfer.sglang.conn import PdkvKVManager

    _env("", 0, 1)
    args, keep = _kv_args(range(LAYERS), fill=False)
    mgr = PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
    try:
        report: dict[str, Any] = {"urls": _control_urls(f"http://{bootstrap_addr}", "dp0")}  # while the ranks run
        for room, src in rooms.items():
            receiver, state = _receive(mgr, bootstrap_addr, room, dst[room], aux_index=room % AUX_ROWS)
            exact = state == KVPoll.Success and all(
                np.array_equal(keep[x].numpy()[dst[room]], _pattern(x, 0)[src])
                and np.array_equal(keep[LAYERS + x].numpy()[dst[room]], _pattern(x, 1)[src])
                for x in range(LAYERS)
            )
            aux = b"".join(t[room % AUX_ROWS].numpy().tobytes() for t in keep[2 * LAYERS :])
            report[room] = (int(state), exact and aux == _aux_row(room))
        out.put(report)
    finally:
        mgr.close()


def _across(hosts: HostNet, ipv6: bool) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    rooms = {701: ([[3, 4, 5], [9], [20, 21]], False), 702: ([[7, 8, 10, 11, 12]], False)}
    dst = {701: [30, 1, 2, 29, 28, 27], 702: [6, 17, 18, 19, 22]}
    run = Hosts(hosts, bind="::" if ipv6 else "0.0.0.0", ipv6=ipv6)
    try:
        sent = run.ctx.Queue()
        for rank in range(2):
            run.start("prefill", _prefill_rank, run.registry, rank, 2, rooms, sent)
        got = run.ctx.Queue()
        srcs = {room: sum(chunks, []) for room, (chunks, _) in rooms.items()}
        run.start("decode", _decode_rooms, run.bootstrap_addr, srcs, dst, got)
        report = got.get(timeout=120)
        senders = [sent.get(timeout=60) for _ in range(2 * len(rooms))]
    finally:
        run.close()
    for room in rooms:
        assert report[room] == (int(KVPoll.Success), True), (room, report[room])  # byte for byte, aux row too
    assert all(seen[-1] == KVPoll.Success and error is None for _, _, seen, _, error in senders), senders
    urls = report["urls"]
    assert len(urls) == 2 and not any(bad in url for url in urls for bad in LOOPBACK), urls
    where = f"[{hosts.address6('prefill')}]" if ipv6 else hosts.address("prefill")
    assert all(url.startswith(f"http://{where}:") for url in urls), urls  # the prefill host's routable address


@ON_HOSTS
def test_layer_split_prefill_to_a_decode_on_another_host(hosts: HostNet) -> None:
    """CP=2 prefill and its bootstrap server (on the wildcard, as `--host 0.0.0.0`) on one
    host, a CP=1 decode on another: rooms byte-exact, senders Success, and each rank
    registered the prefill host's own address, found with nothing set."""
    _across(hosts, ipv6=False)


@ON_HOSTS
def test_over_ipv6_the_urls_carry_brackets(hosts: HostNet) -> None:
    """The same with the bootstrap server on `::` and named by an IPv6 address: each rank
    advertises the prefill host's IPv6 address, bracketed in its URL."""
    _across(hosts, ipv6=True)


# ---- a link cut under a room ---------------------------------------------------------------------
CUT_ROOM, NEXT_ROOM = 801, 802
CUT_CHUNKS = [[3, 4, 5, 6], [9, 10, 11, 12]]  # the cut falls between the two
CUT_DST = [30, 1, 2, 29, 28, 27, 26, 25]
NEXT_CHUNKS = [[13, 14], [15, 16]]
NEXT_DST = [20, 21, 22, 23]
SENTINEL = 0xA5
WATCH_S = 2.0


def _wait_end(sender: Any) -> tuple[int, float, str | None]:
    from sglang.srt.disaggregation.base.conn import KVPoll

    end = time.monotonic() + 60
    while (state := sender.poll()) not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < end:
        time.sleep(0.002)
    at, error = time.monotonic(), None
    if state == KVPoll.Failed:
        try:
            sender.failure_exception()
        except Exception as exc:
            error = type(exc).__name__
    return int(state), at, error


def _send(
    mgr: Any, aux: list[torch.Tensor], registry: str, room: int, chunks: list[list[int]], between: Callable[[], None]
) -> Any:
    """A room's sender as SGLang's scheduler drives it: `between` runs after each chunk but the last."""
    from transfer.sglang.conn import PdkvKVSender

    sender = PdkvKVSender(mgr, registry, room)
    sender.init(sum(len(c) for c in chunks), aux_index=room % AUX_ROWS)
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        if last:
            blob, offset = _aux_row(room), 0
            for t, n in zip(aux, AUX_ITEMS):
                t[room % AUX_ROWS] = torch.frombuffer(bytearray(blob[offset : offset + n]), dtype=torch.uint8)
                offset += n
        sender.should_send_kv_chunk(len(chunk), last)
        sender.send(np.array(chunk, dtype=np.int32), [np.array(sum(chunks, []))] if last else None)
        if not last:
            between()
    return sender


def _prefill_through_a_cut(registry: str, cp_rank: int, events: dict[str, Any], out: Any) -> None:
    """A CP rank: the cut room's first chunk, the second once the link is down (it cannot
    reach the decode); then, with the link back, the next room whole."""
    from transfer.sglang.conn import PdkvKVManager

    _env(registry, cp_rank, 2)
    args, keep = _kv_args(_owned(cp_rank, 2), fill=True)
    mgr = PdkvKVManager(args, "prefill", server_args=None, is_mla_backend=True)
    aux = keep[-len(AUX_ITEMS) :]
    try:

        def cut_between() -> None:
            out.put(("chunk", cp_rank))
            events["cut"].wait(60)

        sender = _send(mgr, aux, registry, CUT_ROOM, CUT_CHUNKS, cut_between)
        out.put(("cut", cp_rank, *_wait_end(sender)))
        events["back"].wait(120)
        sender = _send(mgr, aux, registry, NEXT_ROOM, NEXT_CHUNKS, lambda: None)
        out.put(("next", cp_rank, *_wait_end(sender)))
    finally:
        mgr.close()


def _holds(keep: list[torch.Tensor], dst: list[int], src: list[int]) -> bool:
    """Whether the decode's pages `dst` hold the prefill's pages `src` in every layer."""
    return all(
        np.array_equal(keep[x].numpy()[dst], _pattern(x, 0)[src])
        and np.array_equal(keep[LAYERS + x].numpy()[dst], _pattern(x, 1)[src])
        for x in range(LAYERS)
    )


def _decode_through_a_cut(bootstrap_addr: str, events: dict[str, Any], out: Any) -> None:
    """The decode: the cut room into pages holding a sentinel, watched for WATCH_S after it
    failed; then the next room once the link is back."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from tests.test_sglang import _receive
    from transfer.sglang.conn import PdkvKVManager, PdkvKVReceiver

    _env("", 0, 1)
    args, keep = _kv_args(range(LAYERS), fill=False)
    for t in keep[: 2 * LAYERS]:
        t[CUT_DST] = SENTINEL
    mgr = PdkvKVManager(args, "decode", server_args=None, is_mla_backend=True)
    try:
        _control_urls(f"http://{bootstrap_addr}", "dp0")  # the prefill is up
        receiver = PdkvKVReceiver(mgr, bootstrap_addr, CUT_ROOM)
        receiver.init(0)
        first = len(CUT_CHUNKS[0])
        state, told, end = KVPoll.Bootstrapping, False, time.monotonic() + 60
        while state not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < end:
            state = receiver.poll()
            if state == KVPoll.WaitingForInput:
                receiver.send_metadata(np.array(CUT_DST, dtype=np.int32), aux_index=CUT_ROOM % AUX_ROWS)
            if not told and _holds(keep, CUT_DST[:first], CUT_CHUNKS[0]):
                out.put(("first chunk read",))  # the link may go now
                told = True
            time.sleep(0.002)
        failed_at, error = time.monotonic(), None
        if state == KVPoll.Failed:
            try:
                receiver.failure_exception()
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        pages = [t[CUT_DST].clone() for t in keep[: 2 * LAYERS]]
        read_first = _holds(keep, CUT_DST[:first], CUT_CHUNKS[0])  # read before the cut
        untouched = all((p[first:] == SENTINEL).all() for p in pages)  # the second never came
        time.sleep(WATCH_S)
        still = all(torch.equal(p, t[CUT_DST]) for p, t in zip(pages, keep[: 2 * LAYERS]))
        out.put(("cut", int(state), failed_at, error, read_first, untouched, still))
        events["back"].wait(120)
        receiver, state = _receive(mgr, bootstrap_addr, NEXT_ROOM, NEXT_DST, aux_index=NEXT_ROOM % AUX_ROWS)
        exact = _holds(keep, NEXT_DST, sum(NEXT_CHUNKS, []))
        why = None
        if state == KVPoll.Failed:
            try:
                receiver.failure_exception()
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
        out.put(("next", int(state), exact, why))
    finally:
        mgr.close()


def _take(q: Any, n: int, timeout: float) -> list[tuple[Any, ...]]:
    got, end = [], time.monotonic() + timeout
    while len(got) < n:
        try:
            got.append(q.get(timeout=max(0.1, end - time.monotonic())))
        except queue.Empty:
            raise AssertionError(f"only {got} of {n} reports within {timeout}s") from None
    return got


@ON_HOSTS
def test_a_link_cut_mid_room_fails_both_sides_within_the_bound_and_the_next_room_reads(hosts: HostNet) -> None:
    """The prefill host's cable comes out between a room's two chunks, the decode holding
    its pages: the receiver reaches Failed within RECEIVER_BOUND_S of the cut, each CP rank's
    sender within SENDER_BOUND_S (before the link is back: its reader's stream died), no byte
    lands in the decode's pages for WATCH_S after Failed, and with the cable back the next
    room is read whole and both senders succeed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    run = Hosts(hosts)
    try:
        events = {"cut": run.ctx.Event(), "back": run.ctx.Event()}
        sent, got = run.ctx.Queue(), run.ctx.Queue()
        for rank in range(2):
            run.start("prefill", _prefill_through_a_cut, run.registry, rank, events, sent)
        run.start("decode", _decode_through_a_cut, run.bootstrap_addr, events, got)
        _take(sent, 2, 120)  # both ranks sent their first chunk
        _take(got, 1, 120)  # the decode read it
        hosts.link("prefill", up=False)
        cut_at = time.monotonic()
        events["cut"].set()  # the second chunk goes out into a cut link
        (_, state, failed_at, error, read_first, untouched, still) = _take(got, 1, 60)[0]
        senders = _take(sent, 2, 60)
        hosts.link("prefill", up=True)
        back_at = time.monotonic()
        events["back"].set()
        (_, next_state, exact, why) = _take(got, 1, 120)[0]
        next_senders = _take(sent, 2, 120)
    finally:
        run.close()
    after = [round(r[3] - cut_at, 2) for r in senders]
    print(f"receiver Failed {failed_at - cut_at:.2f}s after the cut; senders {after}")
    assert state == int(KVPoll.Failed) and error is not None and error.startswith("PeerLostError"), error
    assert failed_at - cut_at < RECEIVER_BOUND_S, failed_at - cut_at
    assert read_first and untouched and still  # no byte landed after Failed, nor for WATCH_S after
    for _, rank, s, at, why in senders:
        assert s == int(KVPoll.Failed) and why == "RoomAbortedError", (rank, s, why)
        assert at - cut_at < SENDER_BOUND_S and at < back_at, (rank, at - cut_at)  # not at the link's return
    assert next_state == int(KVPoll.Success) and exact, why
    assert all(s == int(KVPoll.Success) for _, _, s, _, _ in next_senders), next_senders


# ---- what is advertised and bound (no stand-in hosts needed) ---------------------------------------
def test_an_exporter_never_advertises_loopback_or_the_wildcard_to_a_registry_other_hosts_read():
    from pdkv import DSAKVPool, tiny
    from transfer.addresses import AddressError, advertised_for
    from transfer.prefill import PrefillExporter

    remote = "http://198.51.100.7:8998"  # a registry other hosts read (TEST-NET-2: never contacted)
    pool = DSAKVPool(tiny(layer_num=2))
    with pytest.raises(AddressError, match="127.0.0.1"):
        PrefillExporter(pool, "x", 0, 1, remote)  # the library's default bind, loopback, is safe locally only
    for host, advertise in (("0.0.0.0", "127.0.0.1"), ("0.0.0.0", "::1"), ("::1", None), ("0.0.0.0", "0.0.0.0")):
        with pytest.raises(AddressError):
            PrefillExporter(pool, "x", 0, 1, remote, host=host, advertise=advertise)
    with pytest.raises(AddressError):
        PrefillExporter(pool, "x", 0, 1, "etcd://127.0.0.1:2379,198.51.100.8:2379")  # one member other hosts reach
    # A registry on loopback is read on this host only: loopback may be advertised there.
    assert advertised_for("127.0.0.1", None, "http://127.0.0.1:8998") == "127.0.0.1"
    assert advertised_for("0.0.0.0", None, "http://localhost:8998") == "127.0.0.1"
    assert advertised_for("::", None, "http://[::1]:8998") == "::1"
    assert advertised_for("0.0.0.0", "203.0.113.9", remote) == "203.0.113.9"  # NAT: the operator's word


async def test_over_ipv6_loopback_the_control_plane_and_a_fetch_work():
    """Registry and exporter on ::1: their URLs carry brackets, and a decode reads a room
    through them byte for byte."""
    import asyncio

    from pdkv import DSAKVPool, tiny
    from transfer.decode import DecodeFetcher
    from transfer.prefill import PrefillExporter
    from transfer.registry.server import RegistryServer

    layout = tiny(layer_num=2)
    src = DSAKVPool(layout)
    src.slab.view(-1).copy_(torch.arange(src.slab.nbytes) % 241)
    registry = RegistryServer(host="::1")
    url = await registry.start()
    assert url.startswith("http://[::1]:")
    try:
        async with PrefillExporter(src, "v6", 0, 1, url, host="::1") as exporter:
            assert exporter.control_url.startswith("http://[::1]:")
            async with DecodeFetcher(DSAKVPool(layout), url) as fetcher:
                exporter.publish_room(1, np.array([4, 9, 2]))
                exporter.mark_ready(1, layout.layer_num)
                await asyncio.wait_for(fetcher.fetch("v6", 1, [1, 2, 3], timeout=20), 30)
                for layer in range(layout.layer_num):
                    got = fetcher.pool.kv_buffer[layer].view(torch.uint8).reshape(layout.num_pages, -1)[[1, 2, 3]]
                    want = src.kv_buffer[layer].view(torch.uint8).reshape(layout.num_pages, -1)[[4, 9, 2]]
                    assert torch.equal(got, want)
    finally:
        await registry.aclose()


def test_sglang_addresses_and_nics_from_the_environment_and_server_args(monkeypatch):
    """PDKV_SGLANG_HOST is advertised (an address forwarded here binds the wildcard), refused
    if loopback for a bootstrap server other hosts read; PDKV_SGLANG_BIND binds; SGLang's
    --disaggregation-ib-device becomes NIXL's UCX device list unless UCX_NET_DEVICES is set."""
    import types

    from pdkv.errors import LayoutError
    from transfer.addresses import AddressError
    from transfer.sglang.topology import topology, ucx_devices

    _env("http://198.51.100.7:8998", 0, 1)
    args, _ = _kv_args(range(LAYERS), fill=False)
    monkeypatch.setenv("PDKV_SGLANG_HOST", "127.0.0.1")
    with pytest.raises(AddressError, match="PDKV_SGLANG_HOST"):
        topology(args, True)
    monkeypatch.setenv("PDKV_SGLANG_HOST", "203.0.113.9")
    t = topology(args, True)
    assert (t.advertise, t.bind) == ("203.0.113.9", "0.0.0.0")
    monkeypatch.setenv("PDKV_SGLANG_HOST", "[2001:db8::9]")
    monkeypatch.setenv("PDKV_SGLANG_BIND", "::")
    t = topology(args, True)
    assert (t.advertise, t.bind) == ("2001:db8::9", "::")
    monkeypatch.setenv("PDKV_SGLANG_REGISTRY", "http://127.0.0.1:8998")  # a local deployment
    monkeypatch.setenv("PDKV_SGLANG_HOST", "127.0.0.1")
    monkeypatch.delenv("PDKV_SGLANG_BIND")
    assert (topology(args, True).advertise, topology(args, True).bind) == ("127.0.0.1", "127.0.0.1")

    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    ib = types.SimpleNamespace(disaggregation_ib_device="mlx5_0,mlx5_3")
    assert ucx_devices(args, ib) == "mlx5_0, mlx5_3"
    assert ucx_devices(args, types.SimpleNamespace(disaggregation_ib_device=None)) is None
    with pytest.raises(LayoutError, match="port"):
        ucx_devices(args, types.SimpleNamespace(disaggregation_ib_device="mlx5_0:1"))
    monkeypatch.setenv("UCX_NET_DEVICES", "mlx5_1:1")
    assert ucx_devices(args, ib) is None  # the operator's setting wins
