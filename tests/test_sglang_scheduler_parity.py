"""What SGLang's Mooncake backend serves, through pdkv under SGLang 0.5.23's own scheduler
code (issue 41, item 1): the decode's radix-cache prefix, and a prefill split into pipeline
stages. `tests/test_sglang_parity.py` tests the same through a hand-driven loop of the classes.

The harness is `tests/sglang_scheduler.py` (what is real and what is stubbed is said there):
SGLang's `PrefillBootstrapQueue` and in-flight queue processing on every prefill rank, its
`DecodePreallocQueue` and `DecodeTransferQueue` on the decode, over SGLang's DSA pools,
allocators and metadata buffers. One cluster for the module:

* a prefill of PP 2 x CP 2: each pipeline stage holds the layers SGLang's `get_pp_indices`
  gives it (a `LayerSplitDSATokenToKVPool` of the stage's layers, split between its two CP
  ranks), each stage a scheduler group of its own; pdkv numbers the four owners
  (PP stage, CP rank) stage-major. SGLang 0.5.23's `ServerArgs` refuses the layer split
  with PP > 1, so each stage's processes publish a PP size of 1 and run the queue code
  SGLang runs without stages (its PP event loop's consensus between stages is not driven);
  pdkv is told the stage by `PDKV_SGLANG_PP_RANK` / `PDKV_SGLANG_PP_SIZE`;
* a decode with its radix cache on (`--disaggregation-decode-enable-radix-cache`): a real
  `RadixCache` that SGLang's prealloc queue matches each request against, and into which the
  harness's release inserts each finished request, its pages first set to a sentinel.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("PDKV_REQUIRE_SGLANG"):  # CI: a missing install fails rather than skips
    import sglang.srt.disaggregation.base.conn  # noqa: F401
pytest.importorskip("sglang.srt.disaggregation.base.conn", reason="sglang 0.5.23 is not installed")

from tests.sglang_scheduler import (  # noqa: E402
    INDEX_ITEM,
    KV_DIM,
    LAYERS,
    PAGE,
    Side,
    bootstrap_server,
    first_token,
    secret_for_children,
    started,
)

try:
    from tests.sglang_scheduler import import_sglang_scheduler_code

    import_sglang_scheduler_code()
except ImportError as exc:  # the scheduler's imports need scripts/sglang-cpu.txt
    if os.environ.get("PDKV_REQUIRE_SGLANG"):
        raise
    pytest.skip(f"SGLang's scheduler code does not import here: {exc}", allow_module_level=True)

SUCCESS = 4  # KVPoll
STAGES, CP = 2, 2
PAGE_BYTES = PAGE * KV_DIM * 2 + INDEX_ITEM  # one page of one layer: latent KV and indexer


class Cluster:
    """The PP 2 x CP 2 prefill (a `Side` per stage) and the decode with its radix cache."""

    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        self.stages = [Side("prefill", CP, url, pp_rank=pp, pp_size=STAGES) for pp in range(STAGES)]
        self.decode = Side("decode", 1, url, decode_radix=True)

    def start(self) -> None:
        managers = [m for side in (*self.stages, self.decode) for m in side.ready(timeout=600)]
        assert set(managers) == {"transfer.sglang.conn.PdkvKVManager"}

    def submit(self, rid: str, room: int, tokens: int | list[int]) -> None:
        for stage in self.stages:  # every stage schedules the request, as SGLang's PP stages do
            stage.send("req", rid, room, tokens, self.host, self.port, False)
        self.decode.send("req", rid, room, tokens, self.host, self.port, False)

    def received(self, rid: str) -> dict:
        return self.decode.wait("received", rid, timeout=60)[3]

    def senders_succeed(self, rid: str) -> None:
        for stage in self.stages:
            for rank in range(CP):
                _, _, _, reason, state, error, _ = stage.wait("done", rid, timeout=30, rank=rank)
                assert (reason, state, error) == ("FINISH_LENGTH", SUCCESS, None), (stage, rank)

    def pins(self) -> list[dict]:
        """Each prefill rank's rooms: the pages SGLang sent, those its pin freed, its counters."""
        seen = []
        for stage in self.stages:
            stage.send("pins")
            seen += [stage.wait("pins", timeout=30)[2] for _ in range(CP)]
        return seen

    def close(self) -> None:
        for side in (*self.stages, self.decode):
            side.close()


@pytest.fixture(scope="module")
def cluster():
    """The bootstrap server, the PP 2 x CP 2 prefill and the decode with its radix cache."""
    with (
        secret_for_children("scheduler-parity-secret"),
        bootstrap_server() as registry,
        started(Cluster(registry.url)) as c,
    ):
        yield c


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def test_a_pp2_by_cp2_prefill_to_a_decode_byte_exact(cluster):
    """Four owners, one layer each: every layer's KV and indexer pages and the aux row reach
    the decode byte for byte, and every rank's sender (both stages, both CP ranks) succeeds."""
    rooms = {"s1": (4101, 100), "s2": (4203, 3 * PAGE), "s3": (4305, 2 * PAGE + 1)}  # no shared prefix
    for rid, (room, tokens) in rooms.items():
        cluster.submit(rid, room, tokens)
    for rid, (room, tokens) in rooms.items():
        got = cluster.received(rid)
        assert got["bad"] == [] and got["first_token"] == [first_token(room)], (rid, got)
        assert got["held"] == 0 and len(got["pages"]) == _pages(tokens)
        assert got["moved"] == _pages(tokens) * LAYERS * PAGE_BYTES  # every layer, from its stage's owner
        cluster.senders_succeed(rid)


def test_a_decode_with_a_prefix_reads_only_the_pages_past_it(cluster):
    """The decode's radix cache holds the first two pages of B's prompt (A's, sentinel-filled
    once A was received): SGLang's prealloc queue passes `decode_prefix_len` = 2 pages, and
    pdkv reads only B's pages past them. B's bytes exact past the prefix, the prefix pages
    still the sentinel, fewer bytes moved; every sender succeeds, and each prefill rank's pin
    frees exactly the pages SGLang sent of the room, each once: the prefix's 2 pages as soon
    as the decode said its read starts past them (ahead of its release: `freed_ahead`), the
    rest on its release; none expired or aborted."""
    shared = [1500 + i for i in range(2 * PAGE)]
    a_ids = shared + [1700 + i for i in range(PAGE + 10)]  # 4 pages; 3 whole ones cached after
    b_ids = shared + [1800 + i for i in range(PAGE + 5)]  # its third page differs from A's
    cluster.submit("pa", 4401, a_ids)
    got = cluster.received("pa")
    assert got["bad"] == [] and got["held"] == 0 and got["moved"] == _pages(len(a_ids)) * LAYERS * PAGE_BYTES
    cluster.senders_succeed("pa")

    ahead_before = [rank["counters"]["freed_ahead"] for rank in cluster.pins()]
    cluster.submit("pb", 4502, b_ids)
    got = cluster.received("pb")
    assert got["held"] == 2 * PAGE, got  # SGLang matched A's first two pages
    assert got["bad"] == [], got  # past the prefix B's bytes, the prefix pages the sentinel
    assert got["first_token"] == [first_token(4502)]
    read = _pages(len(b_ids)) - 2
    assert got["moved"] == read * LAYERS * PAGE_BYTES  # 2 of 4 pages' bytes moved
    print(f"decode prefix: {got['moved']} bytes moved of {_pages(len(b_ids)) * LAYERS * PAGE_BYTES}")
    cluster.senders_succeed("pb")

    for rank, before in zip(cluster.pins(), ahead_before):
        sent, freed = rank["sent"][4502], rank["freed"][4502]
        assert len(sent) == _pages(len(b_ids)), rank
        assert rank["counters"]["freed_ahead"] - before == 2, rank
        # the prefix's two pages ahead of the release, then exactly the rest: each page once
        assert freed == [sorted(sent[:2]), sorted(sent[2:])], rank
        assert rank["counters"]["expired"] == 0 and rank["counters"]["aborted"] == 0, rank
