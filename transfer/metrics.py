"""Prometheus metrics of the transfer layer, `pdkv_`-prefixed, through prometheus_client.

Shaped after what serving engines already expose for KV transfer (SGLang's
`sglang:kv_transfer_*`, vLLM's `vllm:nixl_*`): a histogram of whole-fetch latency, of the
time inside each READ (or gather launch), of bytes and descriptors per fetch, failures by
error class, and an exporter's pinned rooms and pages. Every service serves them at
`GET /metrics` (open like `/health`: no room ids or addresses are exported).

Exporters are read when scraped, through one collector that walks the live ones: two
exporters in one process (tests, a multi-rank worker) then share the families.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "FETCH_SECONDS",
    "READ_SECONDS",
    "FETCH_BYTES",
    "FETCH_DESCRIPTORS",
    "FETCH_FAILURES",
    "track_exporter",
    "untrack_exporter",
]

_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_BYTES = tuple(float(1 << p) for p in range(16, 34, 2))  # 64 KiB .. 8 GiB
_COUNTS = tuple(float(4**p) for p in range(0, 10))  # 1 .. 262,144

FETCH_SECONDS = Histogram(
    "pdkv_fetch_seconds",
    "Whole fetches: lookup (cached), reads from every owner, proof of the pin",
    ["path"],  # ticket | claims
    buckets=_SECONDS,
)
READ_SECONDS = Histogram(
    "pdkv_read_seconds", "Time inside one batched UCX READ or one gather launch", ["lane"], buckets=_SECONDS
)
FETCH_BYTES = Histogram("pdkv_fetch_bytes", "Bytes a fetch moved", buckets=_BYTES)
FETCH_DESCRIPTORS = Histogram("pdkv_fetch_descriptors", "UCX descriptors a fetch posted", buckets=_COUNTS)
FETCH_FAILURES = Counter("pdkv_fetch_failures", "Fetches that raised, by error class", ["error"])


class _RoomsView(Protocol):
    """What the collector reads of an exporter."""

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


class _ExporterCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        live = list(_exporters)
        families: list[GaugeMetricFamily | CounterMetricFamily] = []
        for key, (name, doc) in _GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["engine", "cp_rank"])
            for e in live:
                family.add_metric([e.engine_id, str(e.cp_rank)], e.room_metrics()[key])
            families.append(family)
        for key, (name, doc) in _COUNTERS.items():
            counter = CounterMetricFamily(name, doc, labels=["engine", "cp_rank"])
            for e in live:
                counter.add_metric([e.engine_id, str(e.cp_rank)], e.room_metrics()[key])
            families.append(counter)
        yield from families


REGISTRY.register(_ExporterCollector())


def track_exporter(exporter: _RoomsView) -> None:
    """Report `exporter`'s rooms while it lives (untracked when it is collected)."""
    _exporters.add(exporter)


def untrack_exporter(exporter: _RoomsView) -> None:
    _exporters.discard(exporter)
