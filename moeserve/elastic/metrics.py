"""Elastic EP's Prometheus metrics, registered in the server's own registry (server/metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "moeserve:elastic_"
_RECOVERY_BUCKETS = (0.5, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 60, 120)


class ElasticMetrics:
    def __init__(self, registry: CollectorRegistry, world_size: int):
        self.ranks_alive = Gauge(PREFIX + "ranks_alive", "Ranks serving in the current group",
                                 registry=registry)
        self.ranks_alive.set(world_size)
        self.rank_failures = Counter(PREFIX + "rank_failures", "Ranks lost (died or silent)",
                                     registry=registry)
        self.recoveries = Counter(PREFIX + "recoveries", "Groups re-formed and serving again "
                                  "(after a failure or a rejoin)", ["kind"], registry=registry)
        self.recovery_seconds = Histogram(PREFIX + "recovery_seconds", "From the event (death "
                                          "seen, or rank ready) to the first step on the new "
                                          "group", buckets=_RECOVERY_BUCKETS, registry=registry)
        self.last_recovery_seconds = Gauge(PREFIX + "last_recovery_seconds",
                                           "recovery_seconds of the latest recovery",
                                           registry=registry)
        self.requests_retried = Counter(PREFIX + "requests_retried", "Requests of a lost rank "
                                        "resumed on another", registry=registry)
        self.requests_failed = Counter(PREFIX + "requests_failed", "Requests of a lost rank "
                                       "ended with an error (could not be resumed)",
                                       registry=registry)
        self.relaunches = Counter(PREFIX + "relaunches", "Rank processes relaunched",
                                  registry=registry)
