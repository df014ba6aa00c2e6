"""Service metrics: RPC latency histograms and the engine's counters, for Prometheus.

Each server owns one :class:`ServiceMetrics` with its own ``CollectorRegistry``. The event
loop that owns the engine calls :meth:`ServiceMetrics.update` with a fresh ``EngineStats``
(at every lease sweep and Stats call); the HTTP exporter thread only reads that snapshot,
never the engine, so no lock is needed. Names follow Prometheus conventions and vLLM's
where vLLM has the metric (``radixkv_prefix_cache_queries_total`` / ``_hits_total``,
``radixkv_kv_cache_usage_perc``), so vLLM dashboards work. The full list:
``docs/service.md``, "Metrics".
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


def _labelled(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, label: str,
              values: dict[str, int]) -> Metric:
    """One metric family with one sample per ``values`` item, labelled ``label=key``."""
    family = kind(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class _StatsCollector(Collector):
    """The engine snapshot and the reliability figures, as the families the docstring lists."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        self.reliability: tuple[QuarantineStats, int, int] | None = None  # (quarantine, reply bytes, reply hits)
        self.tiers: dict[str, int] = {}  # CacheEngine.tier_stats(), empty with the host tier off

    def collect(self) -> Iterator[Metric]:
        yield from self._engine()
        yield from self._reliability()
        yield from self._tiers()

    def _tiers(self) -> Iterator[Metric]:
        t = self.tiers
        if "host_state_slots" in t:
            yield from self._host_states(t)
        if "host_capacity_tokens" not in t:
            return
        yield _labelled(GaugeMetricFamily, "radixkv_host_tier_tokens", "host-memory tier (tokens)", "state",
                        {"capacity": t["host_capacity_tokens"], "used": t["host_used_tokens"]})
        yield _labelled(CounterMetricFamily, "radixkv_tier_hit_tokens", "matched prompt tokens by the tier that "
                        "held them", "tier", {k: t[f"hit_tokens_{k}"] for k in ("device", "host", "storage")})
        yield _labelled(CounterMetricFamily, "radixkv_tier_pages", "pages moved between the tiers", "move",
                        {k: t[f"{k}_pages"] for k in ("loaded", "demoted", "host_dropped", "written_through")})
        yield CounterMetricFamily("radixkv_tier_loaded_bytes", "bytes loaded from the host tier into device rows",
                                  value=t["loaded_pages"] * t["page_bytes"])
        yield CounterMetricFamily("radixkv_tier_load_seconds", "seconds spent loading host pages (copies and waits)",
                                  value=t["load_ns"] / 1e9)
        if "storage_written" not in t:
            return
        sto = CounterMetricFamily("radixkv_storage_pages", "storage tier pages by outcome", labels=["outcome"])
        for outcome in ("written", "write_failed", "backup_dropped", "fetched"):
            sto.add_metric([outcome], t[f"storage_{outcome}"])
        yield sto
        yield CounterMetricFamily("radixkv_storage_read_bytes", "bytes read from storage into the host tier",
                                  value=t["storage_fetched"] * t["page_bytes"])
        yield CounterMetricFamily("radixkv_storage_read_seconds", "seconds matches waited on storage reads "
                                  "(misses and timeouts included)", value=t["storage_wait_us"] / 1e6)
        yield CounterMetricFamily("radixkv_storage_fetch_timeouts", "storage reads that ran past the timeout",
                                  value=t["storage_fetch_timeouts"])
        yield CounterMetricFamily("radixkv_storage_errors", "storage backend calls that raised",
                                  value=t["storage_errors"])
        yield GaugeMetricFamily("radixkv_storage_queue_pages", "pages queued for storage writes",
                                value=t["storage_pending"])

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

    @staticmethod
    def _host_states(t: dict[str, int]) -> Iterator[Metric]:
        """The host state tier of a hybrid model (``MambaRadixCache.host_state_counters``)."""
        yield _labelled(GaugeMetricFamily, "radixkv_host_state_slots", "host-memory state tier (Mamba states)",
                        "state", {"capacity": t["host_state_slots"], "used": t["host_state_used"]})
        yield _labelled(CounterMetricFamily, "radixkv_host_states", "Mamba states moved to, from or out of the "
                        "host tier", "move", {k: t[f"host_states_{k}"] for k in ("demoted", "loaded", "dropped")})
        yield CounterMetricFamily("radixkv_host_state_hits", "matches whose hit ended at a host-tier state",
                                  value=t["host_states_hits"])
        yield CounterMetricFamily("radixkv_host_state_hit_tokens", "matched tokens past the device state hit, "
                                  "up to a host-tier state", value=t["host_states_hit_tokens"])

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

    def update_tiers(self, tiers: dict[str, int]) -> None:
        """Replace the tier counters the exporter serves (``CacheEngine.tier_stats()``)."""
        self._stats.tiers = dict(tiers)

    def update_reliability(self, quarantine: QuarantineStats, reply_bytes: int, reply_hits: int) -> None:
        """Replace the quarantine (a ``QuarantineStats``: cumulative releases) and reply-cache
        snapshot the exporter serves (call from the engine's loop)."""
        self._stats.reliability = (quarantine, int(reply_bytes), int(reply_hits))

    def exposition(self) -> bytes:
        """The text format a Prometheus scrape gets."""
        return generate_latest(self.registry)

    def start_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0 picks a free port; bounded: see
        :mod:`~radixkv.service.server.metrics_http`). Returns the port."""
        from radixkv.service.server.metrics_http import start_metrics_http

        server, thread = start_metrics_http(self.registry, port, addr)
        self._http = (server, thread)
        return int(server.server_address[1])

    def stop_http(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None
