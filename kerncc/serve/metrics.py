"""The server's Prometheus metrics (prometheus_client), one registry per server.

Gauges are read off the engine at scrape time (running and waiting requests, free and total KV
pages, the prefix cache's pages and hit rate), and so are the prefix cache's counters (tokens
asked and found, pages evicted: the engine counts them, `_EngineCounters` reads them); the
token counter and the latency histograms are fed as tokens arrive, on the engine's
thread (prometheus_client is thread-safe).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0)


class Metrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        gauges = (
            ("kerncc_requests_running", "sequences being served", lambda: engine.running),
            ("kerncc_requests_waiting", "requests waiting for admission", lambda: engine.waiting),
            ("kerncc_kv_pages_free", "free pages of the KV pool", lambda: engine.pool.free),
            ("kerncc_kv_pages_total", "pages of the KV pool", lambda: engine.pool.pages),
            ("kerncc_decode_steps_ahead", "decode steps issued a step ahead, their tokens fed "
             "on the device (since the start)", lambda: engine.ahead_steps),
            ("kerncc_prefix_cache_pages", "KV pages the prefix cache keeps (held or not)",
             lambda: engine.pool.cached),
            ("kerncc_prefix_cache_hit_rate", "prompt tokens taken from the prefix cache over "
             "prompt tokens admitted (since the start)", lambda: engine.prefix.hit_rate),
        )
        for name, doc, read in gauges:
            Gauge(name, doc, registry=self.registry).set_function(read)
        self.registry.register(_EngineCounters(engine))
        self.tokens = Counter("kerncc_tokens_generated", "tokens generated",
                              registry=self.registry)
        self.requests = Counter("kerncc_requests_finished", "requests finished, by reason",
                                ["reason"], registry=self.registry)
        self.ttft = Histogram("kerncc_time_to_first_token_seconds",
                              "arrival to first generated token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.itl = Histogram("kerncc_inter_token_latency_seconds",
                             "time between two generated tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def token(self, arrived: float, times: list[float]) -> None:
        self.tokens.inc()
        if len(times) == 1:
            self.ttft.observe(times[0] - arrived)
        elif len(times) > 1:
            self.itl.observe(times[-1] - times[-2])

    def took(self, arrived: float, times: list[float], count: int) -> None:
        """`count` tokens at once, the last `count` of `times`: as `token` for each."""
        self.tokens.inc(count)
        start = len(times) - count
        for i in range(max(start, 0), len(times)):
            if i == 0:
                self.ttft.observe(times[0] - arrived)
            else:
                self.itl.observe(times[i] - times[i - 1])

    def finished(self, reason: str) -> None:
        self.requests.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCounters(Collector):
    """Counters the engine keeps (a Counter can only be incremented; these are read)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Any:
        counts = (
            ("kerncc_prefix_cache_queried_tokens", "prompt tokens admitted (asked of the "
             "prefix cache)", lambda: self.engine.prefix.queried),
            ("kerncc_prefix_cache_hit_tokens", "prompt tokens taken from the prefix cache, "
             "not computed", lambda: self.engine.prefix.hit),
            ("kerncc_prefix_cache_evictions", "cached KV pages evicted for new ones",
             lambda: self.engine.pool.evictions),
        )
        for name, doc, read in counts:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], read())
            yield family
