"""Prometheus metrics of the transfer layer, `pdkv_`-prefixed, through prometheus_client.

Shaped after what serving engines already expose for KV transfer (SGLang's
`sglang:kv_transfer_*`, vLLM's `vllm:nixl_*`): on a decode, histograms of whole-fetch
latency, of the time inside each READ (or gather launch), of bytes, transfer rate and
descriptors per fetch, failures by error class and the fetches in flight, each by `engine`
(the prefill engine read from: engines are few, rooms and addresses never become labels);
on a prefill rank, an exporter's pinned rooms, pages and tickets and its room counts. Every
service serves them at `GET /metrics` (open like `/health`).

Two modes, as prometheus_client chose when it was imported:

* one process (the default): exporters are read when scraped, through one collector that
  walks the live ones, so a scrape sees the rooms as they are; two exporters in one process
  (tests, a multi-rank worker) share the families.
* multiprocess (`PROMETHEUS_MULTIPROC_DIR`, as SGLang runs): each process writes mmap files
  that the serving process's `MultiProcessCollector` merges, and a custom collector of the
  scheduler's process is never asked. Exporters then write real Gauges and Counters, once
  as they are tracked and then every `ROOM_SAMPLE_SECONDS` from a task on their own loop
  (nothing outside this module changes as rooms do). The gauges merge as `livemostrecent`:
  one exporter owns an (engine, CP rank), so a restarted rank's values replace its dead
  predecessor's rather than add to them, and `mark_process_dead` drops them. The processes of
  one server (SGLang's TP and DP ranks) then share one scrape, so every series also carries
  the process's scope, `SCOPE_LABELS` (model name, TP rank, DP rank: the labels SGLang's own
  series carry), set once by the adapter (`set_scope`) and "" until then.

Beside those: registry lookups (latency, failures) and registrations refused, notification
failures and retransmissions (`observe_notification_failure`, `observe_retransmission`),
and `pdkv_build_info` (version, wire schema, lanes), a constant 1.

What counts once: `pdkv_fetch_seconds` (and bytes, rate, descriptors, failures) once per
read of a whole room, whether a `fetch` or one `RoomLease.read` / `read_once` under a claim;
`pdkv_read_seconds` once per batched READ or gather launch inside it (`OwnerStats.reads`
summed over the owners: one or more per owner).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata as _dist
from typing import TYPE_CHECKING, Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from transfer.results import FetchResult

__all__ = [
    "BUILD_INFO",
    "LOOKUP_SECONDS",
    "LOOKUP_FAILURES",
    "REGISTER_FAILURES",
    "NOTIFICATION_FAILURES",
    "RETRANSMISSIONS",
    "CLAIM_RELAY_SECONDS",
    "SCOPE_LABELS",
    "FETCH_SECONDS",
    "READ_SECONDS",
    "FETCH_BYTES",
    "FETCH_RATE",
    "FETCH_DESCRIPTORS",
    "FETCH_FAILURES",
    "FETCHES_IN_FLIGHT",
    "MULTIPROCESS",
    "ROOM_SAMPLE_SECONDS",
    "fetching",
    "fetch_engine",
    "observe_fetch",
    "observe_claim_relay",
    "observe_fetch_failure",
    "observe_lookup",
    "observe_notification_failure",
    "observe_read",
    "observe_register_failure",
    "observe_retransmission",
    "set_scope",
    "track_exporter",
    "untrack_exporter",
]

logger = logging.getLogger(__name__)

# Decided by prometheus_client at its import (PROMETHEUS_MULTIPROC_DIR set then or not).
MULTIPROCESS: bool = bool(getattr(values.ValueClass, "_multiprocess", False))
# How often a tracked exporter's rooms are written in multiprocess mode.
ROOM_SAMPLE_SECONDS = 1.0

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_BYTES = tuple(float(1 << p) for p in range(16, 34, 2))  # 64 KiB .. 8 GiB
_COUNTS = tuple(float(4**p) for p in range(0, 10))  # 1 .. 262,144
# 0.1 GB/s (a slow TCP path) .. 2 TB/s (a same-GPU gather): UCX over NICs, NVLink, HBM.
_RATES = tuple(g * 1e9 for g in (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 200, 400, 700, 1000, 1400, 2000))

# Multiprocess only: the server's processes share one scrape (see the module's doc).
SCOPE_LABELS: tuple[str, ...] = ("model_name", "tp_rank", "dp_rank") if MULTIPROCESS else ()
_scope: tuple[str, ...] = ("",) * len(SCOPE_LABELS)
_S = list(SCOPE_LABELS)

FETCH_SECONDS = Histogram(
    "pdkv_fetch_seconds",
    "Whole reads of a room (a fetch, or a read under a RoomLease): lookup (cached), reads from every owner, proof",
    [*_S, "engine", "protocol"],  # protocol: ticket | claims
    buckets=_SECONDS,
)
READ_SECONDS = Histogram(
    "pdkv_read_seconds",
    "Time inside one batched UCX READ or one gather launch (one or more per owner of a fetch)",
    [*_S, "engine", "lane"],  # lane: ucx | cuda_ipc
    buckets=_SECONDS,
)
FETCH_BYTES = Histogram("pdkv_fetch_bytes", "Bytes a fetch moved", [*_S, "engine"], buckets=_BYTES)
FETCH_RATE = Histogram(
    "pdkv_fetch_bytes_per_second",
    "Bytes a successful fetch moved over its whole seconds (FetchResult.gbps, in bytes)",
    [*_S, "engine"],
    buckets=_RATES,
)
FETCH_DESCRIPTORS = Histogram(
    "pdkv_fetch_descriptors", "UCX descriptors a fetch posted", [*_S, "engine"], buckets=_COUNTS
)
FETCH_FAILURES = Counter("pdkv_fetch_failures", "Fetches that raised, by error class", [*_S, "engine", "error"])
FETCHES_IN_FLIGHT = Gauge(
    "pdkv_fetches_in_flight", "Fetches begun and not yet ended", [*_S, "engine"], multiprocess_mode="livesum"
)
# No engine label: a mistyped engine id must not become a series.
LOOKUP_SECONDS = Histogram(
    "pdkv_registry_lookup_seconds",
    "A decode's registry lookups of an engine, waiting for its ranks included, by outcome (ok | failed)",
    [*_S, "outcome"],
    buckets=_SECONDS,
)
LOOKUP_FAILURES = Counter(
    "pdkv_registry_lookup_failures", "Registry lookups that raised, by error class", [*_S, "error"]
)
REGISTER_FAILURES = Counter(
    "pdkv_registry_register_failures",
    "A prefill rank's registration or renewal attempts that failed (the registry away or refusing), by error class",
    [*_S, "error"],
)
NOTIFICATION_FAILURES = Counter(
    "pdkv_notification_failures",
    "Notifications to an owner (kind: release | give_up) that could not be sent or were never acknowledged",
    [*_S, "kind"],
)
RETRANSMISSIONS = Counter(
    "pdkv_notification_retransmissions", "Notifications sent again, unacknowledged in time, by kind", [*_S, "kind"]
)
# On an engine's arbiter (its lowest CP rank): what a decode's claim by one call waits for
# beyond that rank's own grant. A relay is a few process wake-ups: finer buckets below 1 ms.
CLAIM_RELAY_SECONDS = Histogram(
    "pdkv_claim_relay_seconds",
    "An arbiter's relay of a decode's claim to its engine's other ranks, by outcome (ok | refused: a rank "
    "refused it, or was not reached or not registered)",
    [*_S, "engine", "outcome"],
    buckets=(0.0001, 0.0002, 0.0005, *_SECONDS[1:]),
)
BUILD_INFO = Gauge(
    "pdkv_build_info",
    "pdkv's version, wire schema and the lanes this build carries (always 1)",
    ["version", "schema", "lanes"],
    multiprocess_mode="max",
)


def _build_info() -> None:
    from transfer.metadata import SCHEMA_VERSION  # here: metadata is heavier than this module

    try:
        version = _dist.version("pdkv")
    except _dist.PackageNotFoundError:  # run from a checkout that was never installed
        version = "unknown"
    BUILD_INFO.labels(version, str(SCHEMA_VERSION), "ucx,cuda_ipc").set(1)


_build_info()


def set_scope(model_name: str, tp_rank: int, dp_rank: int) -> None:
    """This process's place in its server (SGLang's model name, attention-TP rank and DP
    rank), on every series from now on; multiprocess mode only (no labels otherwise)."""
    global _scope
    if not SCOPE_LABELS:
        return
    _scope = (model_name, str(tp_rank), str(dp_rank))
    _in_flight.clear()


def observe_fetch(result: FetchResult) -> None:
    """A whole read of a room that returned: a fetch, or a read under a lease."""
    engine, scope = result.engine_id, _scope
    FETCH_SECONDS.labels(*scope, engine, "claims" if result.control_messages else "ticket").observe(result.seconds)
    FETCH_BYTES.labels(*scope, engine).observe(result.nbytes)
    FETCH_DESCRIPTORS.labels(*scope, engine).observe(result.descriptors)
    if result.seconds > 0:
        FETCH_RATE.labels(*scope, engine).observe(result.nbytes / result.seconds)


def observe_claim_relay(engine_id: str, seconds: float, ok: bool) -> None:
    """An arbiter's relay of one claim to its engine's other ranks (`transfer.prefill.peers`)."""
    CLAIM_RELAY_SECONDS.labels(*_scope, engine_id, "ok" if ok else "refused").observe(seconds)


def observe_fetch_failure(engine_id: str, error: BaseException) -> None:
    FETCH_FAILURES.labels(*_scope, engine_id, type(error).__name__).inc()


def observe_read(lane: str, seconds: float) -> None:
    """One batched READ or gather launch, under the engine of the fetch it belongs to."""
    READ_SECONDS.labels(*_scope, fetch_engine(), lane).observe(seconds)


def observe_lookup(started: float, error: BaseException | None = None) -> None:
    """A registry lookup begun at `started` (`time.perf_counter()`) ended, raising `error` or not."""
    LOOKUP_SECONDS.labels(*_scope, "ok" if error is None else "failed").observe(time.perf_counter() - started)
    if error is not None:
        LOOKUP_FAILURES.labels(*_scope, type(error).__name__).inc()


def observe_register_failure(error: BaseException) -> None:
    REGISTER_FAILURES.labels(*_scope, type(error).__name__).inc()


def observe_notification_failure(kind: str = "release") -> None:
    """A notification to an owner (`kind`: release | give_up) that was lost for good: not
    sent, or never acknowledged after its retransmissions."""
    NOTIFICATION_FAILURES.labels(*_scope, kind).inc()


def observe_retransmission(kind: str = "release") -> None:
    """A notification sent again because it was not acknowledged in time."""
    RETRANSMISSIONS.labels(*_scope, kind).inc()


# ---- the decode: which engine a fetch reads, for what is observed inside it -------------------

_engine: contextvars.ContextVar[str] = contextvars.ContextVar("pdkv_fetch_engine", default="")
_in_flight: dict[str, Gauge] = {}  # children by engine: a fetch through the GPU lane counts microseconds


def fetch_engine() -> str:
    """The engine of the fetch being run ("" outside one): READs are observed under it."""
    return _engine.get()


class _Fetching:
    """One fetch in flight: counted while the block runs, and its engine bound for the tasks it starts."""

    __slots__ = ("_engine_id", "_gauge", "_token")

    def __init__(self, engine_id: str) -> None:
        self._engine_id = engine_id

    def __enter__(self) -> None:
        gauge = _in_flight.get(self._engine_id)
        if gauge is None:
            gauge = _in_flight[self._engine_id] = FETCHES_IN_FLIGHT.labels(*_scope, self._engine_id)
        self._gauge = gauge
        gauge.inc()
        self._token = _engine.set(self._engine_id)

    def __exit__(self, *exc: object) -> None:
        _engine.reset(self._token)
        self._gauge.dec()


def fetching(engine_id: str) -> _Fetching:
    """`with fetching(engine_id):` around a fetch: in flight meanwhile, even if cancelled."""
    return _Fetching(engine_id)


# ---- the prefill: an exporter's rooms -----------------------------------------------------------


class _RoomsView(Protocol):
    """What is read of an exporter."""

    engine_id: str
    cp_rank: int

    def room_metrics(self) -> dict[str, int]: ...


_exporters: weakref.WeakSet[_RoomsView] = weakref.WeakSet()

_GAUGES = {
    "live_rooms": ("pdkv_pinned_rooms", "Rooms whose source pages an exporter keeps pinned"),
    "pinned_pages": ("pdkv_pinned_pages", "Source pages an exporter keeps pinned"),
    "tickets_out": ("pdkv_tickets_out", "Tickets issued and not yet released"),
}
_COUNTERS = {
    "published": ("pdkv_rooms_published", "Rooms published for decodes"),
    "released": ("pdkv_rooms_released", "Rooms released by all their consumers"),
    "aborted": ("pdkv_rooms_aborted", "Rooms aborted"),
    "expired": ("pdkv_rooms_expired", "Rooms whose pin expired before release"),
}
_ROOM_LABELS = [*_S, "engine", "cp_rank"]


class _ExporterCollector(Collector):
    """One process: the live exporters' rooms, read at each scrape."""

    def collect(self) -> Iterator[Metric]:
        live = [((e.engine_id, str(e.cp_rank)), e.room_metrics()) for e in list(_exporters)]
        for key, (name, doc) in _GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=_ROOM_LABELS)
            for labels, rooms in live:
                gauge.add_metric(labels, rooms[key])
            yield gauge
        for key, (name, doc) in _COUNTERS.items():
            counter = CounterMetricFamily(name, doc, labels=_ROOM_LABELS)
            for labels, rooms in live:
                counter.add_metric(labels, rooms[key])
            yield counter


@dataclass
class _Sampler:
    """Multiprocess: one exporter's series, what its counters were last, and the task writing them."""

    labels: tuple[str, str]
    seen: dict[str, int] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None

    def write(self, rooms: dict[str, int]) -> None:
        labels = (*_scope, *self.labels)
        for key, gauge in _room_gauges.items():
            gauge.labels(*labels).set(rooms[key])
        for key, counter in _room_counters.items():
            delta = rooms[key] - self.seen.get(key, 0)
            if delta > 0:
                counter.labels(*labels).inc(delta)
            self.seen[key] = rooms[key]

    def zero(self) -> None:
        """Gone: its gauges read 0 (series cannot be removed in multiprocess mode)."""
        for gauge in _room_gauges.values():
            gauge.labels(*_scope, *self.labels).set(0)


_room_gauges: dict[str, Gauge] = {}
_room_counters: dict[str, Counter] = {}
_samplers: weakref.WeakKeyDictionary[_RoomsView, _Sampler] = weakref.WeakKeyDictionary()

if MULTIPROCESS:
    _room_gauges = {k: Gauge(n, d, _ROOM_LABELS, multiprocess_mode="livemostrecent") for k, (n, d) in _GAUGES.items()}
    _room_counters = {k: Counter(n, d, _ROOM_LABELS) for k, (n, d) in _COUNTERS.items()}
else:
    REGISTRY.register(_ExporterCollector())


async def _sample_forever(exporter: weakref.ref[_RoomsView], sampler: _Sampler) -> None:
    """Write the exporter's rooms every ROOM_SAMPLE_SECONDS while it lives (holding no reference)."""
    while True:
        await asyncio.sleep(ROOM_SAMPLE_SECONDS)
        live = exporter()
        if live is None:
            sampler.zero()
            return
        try:
            sampler.write(live.room_metrics())
        except Exception:  # a bad sample must not end the sampling
            logger.exception("exporter %s/cp%s: its rooms could not be written", *sampler.labels)
        del live


def track_exporter(exporter: _RoomsView) -> None:
    """Report `exporter`'s rooms while it lives (untracked when it is collected)."""
    _exporters.add(exporter)
    if not MULTIPROCESS or exporter in _samplers:
        return
    sampler = _samplers[exporter] = _Sampler((exporter.engine_id, str(exporter.cp_rank)))
    sampler.write(exporter.room_metrics())
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        logger.warning("exporter %s/cp%s tracked outside a loop: its rooms are written once", *sampler.labels)
        return
    sampler.task = loop.create_task(_sample_forever(weakref.ref(exporter), sampler))


def untrack_exporter(exporter: _RoomsView) -> None:
    """Stop reporting `exporter` (its last counts written, its gauges 0 in multiprocess mode)."""
    _exporters.discard(exporter)
    sampler = _samplers.pop(exporter, None)
    if sampler is None:
        return
    if sampler.task is not None:
        sampler.task.cancel()
    sampler.write(exporter.room_metrics())
    sampler.zero()
