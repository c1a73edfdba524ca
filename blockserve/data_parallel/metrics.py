"""GET /metrics of the data-parallel front end: every replica's Prometheus metrics labelled
`replica="i"`, their totals labelled `replica="total"`, and the router's own, as one valid text
exposition (parsed and rendered with prometheus_client, so names, labels and escaping stay valid).

    totals      counters and gauges summed; histograms summed bucket by bucket (every replica runs
                the same code, so the same buckets); `*_ratio` gauges (KV usage) averaged;
                `*_created` (a counter's start time) the earliest
    down        a replica out of rotation keeps its last scraped counters and histograms, in its
                own samples and in the totals (what it served stays counted: a total never goes
                backwards), and loses its gauges (it runs nothing now);
                blockserve_router_replica_up{replica} says 0
    stale       a live replica whose scrape failed keeps its last scraped samples;
                blockserve_router_replica_scraped{replica} says 0 (1: read in this scrape)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

TOTAL = "total"  # the replica label of the totals


@dataclass(frozen=True)
class ReplicaMetrics:
    """One replica's last scraped metric families, whether it is in rotation, and whether they
    were read in this scrape."""

    families: tuple[Metric, ...]
    alive: bool
    scraped: bool


def parse(text: str) -> tuple[Metric, ...]:
    """A replica's /metrics body as metric families; ValueError if it is not valid exposition text."""
    return tuple(text_string_to_metric_families(text))


def _total(family: Metric, values: list[float]) -> float:
    if family.name.endswith("_created"):
        return min(values)
    if family.type == "gauge" and family.name.endswith("_ratio"):
        return sum(values) / len(values)
    return sum(values)


def merge(replicas: Sequence[ReplicaMetrics | None]) -> list[Metric]:
    """The families of every replica (index i, None: never scraped) with each sample labelled
    replica="i", followed in each family by the totals labelled replica="total"."""
    merged: dict[str, Metric] = {}
    totals: dict[str, dict[tuple, list[float]]] = {}
    for index, replica in enumerate(replicas):
        if replica is None:
            continue
        for family in replica.families:
            if family.type == "gauge" and not family.name.endswith("_created") and not replica.alive:
                continue
            out = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            sums = totals.setdefault(family.name, {})
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "replica"}
                out.add_sample(sample.name, {"replica": str(index), **labels}, sample.value)
                sums.setdefault((sample.name, tuple(labels.items())), []).append(sample.value)
    for name, family in merged.items():
        for (sample_name, labels), values in totals[name].items():
            family.add_sample(sample_name, {"replica": TOTAL, **dict(labels)}, _total(family, values))
    return list(merged.values())


def router_families(routed: dict[str, int], replicas: Sequence[tuple[int, bool, bool, int]]) -> list[Metric]:
    """The front end's own: requests routed by reason, and per replica (index, alive, scraped,
    in flight) whether it is up, whether its metrics were read now, and its requests in flight."""
    requests = CounterMetricFamily("blockserve_router_requests",
                                   "Requests the front end routed, by why it chose the replica.", labels=["reason"])
    for reason, count in routed.items():
        requests.add_metric([reason], count)
    up = GaugeMetricFamily("blockserve_router_replica_up", "1 while the replica is in rotation, 0 once it died.",
                           labels=["replica"])
    scraped = GaugeMetricFamily("blockserve_router_replica_scraped",
                                "1 if the replica's metrics above were read in this scrape, 0 if they are the last "
                                "ones read (it is down or did not answer).", labels=["replica"])
    in_flight = GaugeMetricFamily("blockserve_router_in_flight", "Requests the front end has in flight on the replica.",
                                  labels=["replica"])
    for index, alive, was_scraped, count in replicas:
        up.add_metric([str(index)], int(alive))
        scraped.add_metric([str(index)], int(was_scraped))
        in_flight.add_metric([str(index)], count)
    return [requests, up, scraped, in_flight]


class _Families:
    """What generate_latest renders: a fixed list of families."""

    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> list[Metric]:
        return self._families


def render(families: Iterable[Metric]) -> bytes:
    return generate_latest(_Families(families))
