"""What a service's `/metrics` text says of one histogram, for tests and benchmarks."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def histogram_totals(text: str, family: str, **labels: str) -> tuple[float, float]:
    """The (count, sum) of `family`'s series whose labels include `labels`; (0, 0) if none
    was observed yet. One series is expected to match."""
    totals = {"count": 0.0, "sum": 0.0}
    for f in text_string_to_metric_families(text):
        if f.name != family:
            continue
        for s in f.samples:
            kind = s.name.removeprefix(f"{family}_")
            if kind in totals and labels.items() <= s.labels.items():
                totals[kind] = s.value
    return totals["count"], totals["sum"]
