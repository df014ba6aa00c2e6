"""Service metrics: RPC latency histograms and the engine's counters, for Prometheus.

Each server owns one :class:`ServiceMetrics` with its own ``CollectorRegistry`` (several
servers in one process, as in tests, do not collide). The event loop that owns the engine
calls :meth:`ServiceMetrics.update` with a fresh ``EngineStats`` (after every RPC that
changes the engine is too often; the server refreshes at every lease sweep and on the Stats
RPC); the HTTP exporter thread only ever reads that snapshot, never the engine, so no lock
is needed around the engine.

Exported (Prometheus conventions: cumulative counts are counters ending in ``_total``, names
carry their unit; vLLM's names where vLLM has the metric, so that dashboards and hit-rate
queries written for vLLM work):

* ``radixkv_build_info{version}`` (always 1), and the process collector's ``process_*``
  (CPU seconds, resident memory, open file descriptors, start time);
* ``radixkv_rpc_latency_seconds{method,code}`` histogram (its ``_count``: calls);
  ``radixkv_auth_failures_total{method}``; ``radixkv_step_socket_refused_total{why}``
  (Step socket connections closed by its limits: ``handshake_timeout``, ``auth``, ...);
* ``radixkv_prefix_cache_queries_total`` / ``radixkv_prefix_cache_hits_total``: prompt tokens
  looked up / found in the cache (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``;
  hit rate: ``rate(..._hits_total[5m]) / rate(..._queries_total[5m])``);
  ``radixkv_match_queries_total`` (lookups), ``radixkv_inserted_tokens_total``,
  ``radixkv_evicted_tokens_total``;
* ``radixkv_kv_cache_usage_perc``: the fraction (0..1) of KV slots held by running requests
  or locked in the tree (vLLM's ``kv_cache_usage_perc``; evictable cached slots count as
  free, as in vLLM); ``radixkv_kv_tokens{state=available|evictable|protected|held}``,
  ``radixkv_kv_capacity_tokens``;
* ``radixkv_state_slots{state=...}``, ``radixkv_state_capacity_slots`` (Mamba states);
  ``radixkv_request_rows{state=available|used}``, ``radixkv_request_rows_capacity``;
* ``radixkv_sessions``, ``radixkv_running_requests`` (gauges);
* with the host tier on (``docs/tiers.md``, "Stats and metrics"): ``radixkv_tier_usage_tokens{tier=device|host}``
  and ``radixkv_tier_capacity_tokens{tier}``; ``radixkv_tier_hits_tokens_total{tier=device|host|storage}``
  (they sum to ``radixkv_prefix_cache_hits_total``); ``radixkv_tier_loaded_pages_total{tier=host|storage}``,
  ``radixkv_tier_loaded_bytes_total{tier}``, ``radixkv_tier_load_seconds_total{tier}`` (host: loads into
  device rows; storage: reads into host memory, time waited included); ``radixkv_tier_demoted_pages_total``,
  ``radixkv_tier_host_dropped_pages_total``; ``radixkv_storage_errors_total{kind=error|write_failed|
  fetch_timeout|backup_dropped}``, ``radixkv_storage_written_pages_total``, ``radixkv_storage_queue_pages``;
* ``radixkv_quarantined_sessions`` (gauge), ``radixkv_quarantine_released_sessions_total{why=gone|timeout}``,
  ``radixkv_reply_cache_bytes`` (gauge), ``radixkv_reply_cache_hits_total`` (idempotent retries
  answered from the reply cache).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixkv.engine.protocol import EngineStats

if TYPE_CHECKING:
    from radixkv.service.server.quarantine import QuarantineStats

#: Buckets for per-call latency: 50 us .. 2.5 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 2.5)


class _StatsCollector(Collector):
    """The engine snapshot and the reliability figures, as the families the docstring lists."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        self.reliability: tuple[QuarantineStats, int, int] | None = None  # (quarantine, reply bytes, reply hits)

    def collect(self) -> Iterator[Metric]:
        yield from self._engine()
        yield from self._tiers()
        yield from self._reliability()

    def _tiers(self) -> Iterator[Metric]:
        s = self.stats
        if s is None or not s.host_capacity:
            return
        usage = GaugeMetricFamily("radixkv_tier_usage_tokens", "tokens cached per tier (device: held, locked "
                                  "or evictable; host: with a host copy)", labels=["tier"])
        usage.add_metric(["device"], s.kv_capacity - s.kv_available)
        usage.add_metric(["host"], s.host_used)
        yield usage
        cap = GaugeMetricFamily("radixkv_tier_capacity_tokens", "capacity per tier (tokens)", labels=["tier"])
        cap.add_metric(["device"], s.kv_capacity)
        cap.add_metric(["host"], s.host_capacity)
        yield cap
        hits = CounterMetricFamily("radixkv_tier_hits_tokens", "prompt tokens found per tier", labels=["tier"])
        for tier in ("device", "host", "storage"):
            hits.add_metric([tier], getattr(s, f"tier_hit_{tier}"))
        yield hits
        for name, field, doc in (("loaded_pages", "loaded_pages", "pages loaded from the tier"),
                                 ("loaded_bytes", "loaded_bytes", "bytes loaded from the tier"),
                                 ("load_seconds", "load_us", "seconds spent loading from the tier")):
            fam = CounterMetricFamily(f"radixkv_tier_{name}", doc, labels=["tier"])
            for tier in ("host", "storage"):
                v = getattr(s, f"{tier}_{field}")
                fam.add_metric([tier], v / 1e6 if field == "load_us" else v)
            yield fam
        yield CounterMetricFamily("radixkv_tier_demoted_pages", "device pages demoted to the host tier",
                                  value=s.host_demoted_pages)
        yield CounterMetricFamily("radixkv_tier_host_dropped_pages", "pages dropped from the host tier",
                                  value=s.host_dropped_pages)
        errors = CounterMetricFamily("radixkv_storage_errors", "storage faults (pages, backend calls that raised)",
                                     labels=["kind"])
        for kind, v in (("error", s.storage_errors), ("write_failed", s.storage_write_failed),
                        ("fetch_timeout", s.storage_fetch_timeouts), ("backup_dropped", s.storage_backup_dropped)):
            errors.add_metric([kind], v)
        yield errors
        yield CounterMetricFamily("radixkv_storage_written_pages", "pages written to storage",
                                  value=s.storage_written_pages)
        yield GaugeMetricFamily("radixkv_storage_queue_pages", "pages waiting to be written to storage",
                                value=s.storage_pending)

    def _engine(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        yield CounterMetricFamily("radixkv_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                  value=s.queried_tokens)
        yield CounterMetricFamily("radixkv_prefix_cache_hits", "prompt tokens found in the prefix cache",
                                  value=s.hit_tokens)
        for name, value, doc in (("match_queries", s.queries, "prefix lookups"),
                                 ("inserted_tokens", s.inserted_tokens, "tokens inserted into the tree"),
                                 ("evicted_tokens", s.evicted_tokens, "tokens evicted from the tree")):
            yield CounterMetricFamily(f"radixkv_{name}", doc, value=value)
        used = s.kv_protected + s.kv_held
        yield GaugeMetricFamily("radixkv_kv_cache_usage_perc",
                                "fraction (0..1) of KV slots held by running requests or locked in the tree "
                                "(evictable cached slots count as free)",
                                value=used / s.kv_capacity if s.kv_capacity else 0.0)
        kv = GaugeMetricFamily("radixkv_kv_tokens", "KV slots by state (tokens)", labels=["state"])
        st = GaugeMetricFamily("radixkv_state_slots", "Mamba state slots by state", labels=["state"])
        for state in ("available", "evictable", "protected", "held"):
            kv.add_metric([state], getattr(s, f"kv_{state}"))
            st.add_metric([state], getattr(s, f"state_{state}"))
        yield kv
        yield st
        rows = GaugeMetricFamily("radixkv_request_rows", "req_to_token rows by state", labels=["state"])
        rows.add_metric(["available"], s.rows_available)
        rows.add_metric(["used"], s.rows_capacity - s.rows_available)
        yield rows
        for name, value, doc in (
            ("kv_capacity_tokens", s.kv_capacity, "KV capacity (tokens)"),
            ("state_capacity_slots", s.state_capacity, "Mamba state capacity (slots)"),
            ("request_rows_capacity", s.rows_capacity, "req_to_token rows"),
            ("sessions", s.sessions, "attached sessions"),
            ("running_requests", s.requests, "running requests"),
        ):
            yield GaugeMetricFamily(f"radixkv_{name}", doc, value=value)

    def _reliability(self) -> Iterator[Metric]:
        if self.reliability is None:
            return
        q, reply_bytes, reply_hits = self.reliability
        yield GaugeMetricFamily("radixkv_quarantined_sessions", "expired sessions whose holdings are quarantined",
                                value=q.held)
        rel = CounterMetricFamily("radixkv_quarantine_released_sessions", "quarantined sessions released",
                                  labels=["why"])
        rel.add_metric(["gone"], q.released_gone)
        rel.add_metric(["timeout"], q.released_timeout)
        yield rel
        yield GaugeMetricFamily("radixkv_reply_cache_bytes", "bytes of kept replies (idempotent calls)",
                                value=reply_bytes)
        yield CounterMetricFamily("radixkv_reply_cache_hits", "retries answered from the reply cache",
                                  value=reply_hits)


class ServiceMetrics:
    """RPC latencies and the last engine stats snapshot, in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rpc_latency = Histogram("radixkv_rpc_latency_seconds", "server-side latency of each RPC",
                                     ["method", "code"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.auth_failures = Counter("radixkv_auth_failures", "calls rejected for a missing or wrong token",
                                     ["method"], registry=self.registry)
        self.step_socket_refusals = Counter("radixkv_step_socket_refused",
                                            "Step socket connections closed by its limits (handshake timeout, "
                                            "wrong token, bad hello, oversize frame, connection limits)",
                                            ["why"], registry=self.registry)
        from radixkv import __version__

        Info("radixkv_build", "the radixkv version serving", registry=self.registry).info({"version": __version__})
        ProcessCollector(registry=self.registry)
        self._stats = _StatsCollector()
        self.registry.register(self._stats)
        self._http: tuple[Any, threading.Thread] | None = None  # (the WSGI server, its thread)
        self._latency: dict[tuple[str, str], Any] = {}  # rpc_latency's child per (method, code)

    def observe(self, method: str, code: str, seconds: float) -> None:
        child = self._latency.get((method, code))
        if child is None:  # labels() costs a lock and a tuple build per call: once per pair
            child = self._latency[(method, code)] = self.rpc_latency.labels(method, code)
        child.observe(seconds)

    def auth_failed(self, method: str) -> None:
        self.auth_failures.labels(method.rsplit("/", 1)[-1] or "?").inc()

    def step_socket_refused(self, why: str) -> None:
        self.step_socket_refusals.labels(why).inc()

    def update(self, stats: EngineStats) -> None:
        """Replace the engine snapshot the exporter serves (call from the engine's loop)."""
        self._stats.stats = stats

    def update_reliability(self, quarantine: QuarantineStats, reply_bytes: int, reply_hits: int) -> None:
        """Replace the quarantine (a ``QuarantineStats``: cumulative releases) and reply-cache
        snapshot the exporter serves (call from the engine's loop)."""
        self._stats.reliability = (quarantine, int(reply_bytes), int(reply_hits))

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
