"""The Prometheus endpoint under idle connections (issue 34, item 3): any local user can
connect to a loopback port, so the exporter bounds what connections may hold: at most
``MAX_CONNECTIONS`` at once (one more is closed at once and counted), a read timeout for each,
and a scrape still answers. Every wait is a bounded poll for a state, never a measure."""
from __future__ import annotations

import socket
import time
import urllib.request

from radixkv.service.server import metrics_http
from radixkv.service.server.manager import ServeOptions
from tooling.testing import ThreadedServer

WAIT_S = 60.0


def closed_by_peer(s: socket.socket, wait_s: float) -> bool:
    s.settimeout(wait_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def until(what, predicate):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {WAIT_S} s")
        time.sleep(0.02)


def test_idle_connections_are_bounded_timed_out_and_a_scrape_still_answers(monkeypatch):
    opts = ServeOptions(metrics_port=0, sweep_interval_s=0.2, grace_s=1.0)
    with ThreadedServer({"kv_tokens": 256}, options=opts) as srv:
        port = srv.server.metrics_port
        httpd = srv.server.metrics._http[0]
        # the bound: with the read timeout far away, one connection more than the bound is closed at once
        monkeypatch.setattr(metrics_http._Handler, "timeout", 600.0)
        n = metrics_http.MAX_CONNECTIONS + 24
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
        until("the extra connections refused", lambda: httpd.refused == 24)
        assert sum(closed_by_peer(s, 0.2) for s in idle) == 24  # the others are held
        for s in idle:
            s.close()
        # the timeout: idle connections are closed by the exporter
        monkeypatch.setattr(metrics_http._Handler, "timeout", 0.5)
        until("the held connections gone", lambda: httpd.open == 0)
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(metrics_http.MAX_CONNECTIONS)]
        assert all(closed_by_peer(s, WAIT_S) for s in idle)
        for s in idle:
            s.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            assert r.status == 200 and b"radixkv_build_info" in r.read()
        assert httpd.refused == 24

