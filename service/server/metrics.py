"""Service metrics: RPC latency histograms and the engine's counters, for Prometheus.

Each server owns one :class:`ServiceMetrics` with its own ``CollectorRegistry`` (several
servers in one process, as in tests, do not collide). The event loop that owns the engine
calls :meth:`ServiceMetrics.update` with a fresh ``EngineStats`` (after every RPC that
changes the engine is too often; the server refreshes at every lease sweep and on the Stats
RPC); the HTTP exporter thread only ever reads that snapshot, never the engine, so no lock
is needed around the engine.

Exported (prefix ``radixkv_``):

* ``rpc_latency_seconds{method,code}`` histogram; ``rpc_total`` via its ``_count``;
* ``auth_failures_total{method}``;
* ``kv_tokens{state=available|evictable|protected|held}``, ``kv_capacity_tokens``;
* ``state_slots{state=...}``, ``state_capacity_slots``; ``rows_available``, ``rows_capacity``;
* ``sessions``, ``requests``, ``hit_rate``;
* ``queries_total``, ``queried_tokens_total``, ``hit_tokens_total``, ``inserted_tokens_total``,
  ``evicted_tokens_total`` (counters, from the engine's cumulative stats);
* ``quarantined_sessions`` (gauge), ``quarantine_released{why=gone|timeout}`` (since start),
  ``reply_cache_bytes`` and ``reply_cache_hits`` (idempotent retries answered from the cache).
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixkv.engine.protocol import EngineStats

#: Buckets for per-call latency: 50 us .. 2.5 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 2.5)


class _StatsCollector(Collector):
    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        kv = GaugeMetricFamily("radixkv_kv_tokens", "KV slots by state (tokens)", labels=["state"])
        st = GaugeMetricFamily("radixkv_state_slots", "Mamba state slots by state", labels=["state"])
        for state in ("available", "evictable", "protected", "held"):
            kv.add_metric([state], getattr(s, f"kv_{state}"))
            st.add_metric([state], getattr(s, f"state_{state}"))
        yield kv
        yield st
        for name, value, doc in (
            ("kv_capacity_tokens", s.kv_capacity, "KV capacity (tokens)"),
            ("state_capacity_slots", s.state_capacity, "Mamba state capacity (slots)"),
            ("rows_capacity", s.rows_capacity, "req_to_token rows"),
            ("rows_available", s.rows_available, "free req_to_token rows"),
            ("sessions", s.sessions, "attached sessions"),
            ("requests", s.requests, "running requests"),
            ("hit_rate", s.hit_rate, "hit tokens / queried tokens since start"),
        ):
            yield GaugeMetricFamily(f"radixkv_{name}", doc, value=value)
        for name, value in (("queries", s.queries), ("queried_tokens", s.queried_tokens),
                            ("hit_tokens", s.hit_tokens), ("inserted_tokens", s.inserted_tokens),
                            ("evicted_tokens", s.evicted_tokens)):
            yield CounterMetricFamily(f"radixkv_{name}", f"engine {name.replace('_', ' ')}", value=value)


class ServiceMetrics:
    """RPC latencies and the last engine stats snapshot, in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rpc_latency = Histogram("radixkv_rpc_latency_seconds", "server-side latency of each RPC",
                                     ["method", "code"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.auth_failures = Counter("radixkv_auth_failures", "calls rejected for a missing or wrong token",
                                     ["method"], registry=self.registry)
        self.quarantined = Gauge("radixkv_quarantined_sessions", "expired sessions whose holdings are quarantined",
                                 registry=self.registry)
        self.quarantine_released = Gauge("radixkv_quarantine_released", "quarantined sessions released since start",
                                         ["why"], registry=self.registry)
        self.reply_cache_bytes = Gauge("radixkv_reply_cache_bytes", "bytes of kept replies (idempotent calls)",
                                       registry=self.registry)
        self.reply_cache_hits = Gauge("radixkv_reply_cache_hits", "retries answered from the reply cache",
                                      registry=self.registry)
        self._stats = _StatsCollector()
        self.registry.register(self._stats)
        self._http: tuple[object, object] | None = None

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.rpc_latency.labels(method, code).observe(seconds)

    def auth_failed(self, method: str) -> None:
        self.auth_failures.labels(method.rsplit("/", 1)[-1] or "?").inc()

    def update(self, stats: EngineStats) -> None:
        """Replace the engine snapshot the exporter serves (call from the engine's loop)."""
        self._stats.stats = stats

    def update_reliability(self, quarantine: object, reply_bytes: int, reply_hits: int) -> None:
        """Refresh the quarantine and reply-cache gauges (a ``QuarantineStats``)."""
        self.quarantined.set(quarantine.held)
        self.quarantine_released.labels("gone").set(quarantine.released_gone)
        self.quarantine_released.labels("timeout").set(quarantine.released_timeout)
        self.reply_cache_bytes.set(reply_bytes)
        self.reply_cache_hits.set(reply_hits)

    def exposition(self) -> bytes:
        """The text format a Prometheus scrape gets."""
        return generate_latest(self.registry)

    def start_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0 picks a free port). Returns the port."""
        from prometheus_client import start_http_server

        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = (server, thread)
        return int(server.server_address[1])

    def stop_http(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None
