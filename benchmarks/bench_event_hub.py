"""Fan-out cost of the manager's event hub (``radixkv.service.server.event_hub``).

Events: real ``BlockStored`` / ``BlockRemoved`` events of a ``RadixCache`` (page 16, one-
to four-page nodes, evictions), pre-recorded so the cache's own cost is not counted.

Parts:

* ``hub``: in-process. The hub pumps the events in batches of ``--batch``; ``W`` cursors
  (``W`` = 0, 1, 4) read every batch and take each record's wire form (``KVEvent`` bytes,
  encoded once per record however many readers); ``zmq``: the same with the ZMQ outlet on
  (``ipc://``, background publisher thread, a SUB socket in this process receiving every
  batch, timed until the last one arrived). Reported: events/s through the hub.
* ``grpc``: a ``radixkv serve`` process (spawned, its own interpreter); its ring is filled
  with ``--grpc-events`` events by batched inserts (untimed), then ``W`` = 1, 4 watcher
  threads in this process stream them all from ``start_seq`` 0 through
  ``RemoteCacheEngine.watch_events`` (decoding included; the watchers share this process's
  GIL). Reported: events/s per watcher and in total, wall time until every watcher has all.

Prints a table, then JSON. Timing is never asserted; on a shared machine the figures are
provisional.

    python benchmarks/bench_event_hub.py [--events 200000] [--batch 64] [--grpc-events 20000]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.service.server.event_hub import EventHub

PS = 16


def recorded_events(n: int, seed: int = 0) -> list[Any]:
    """``n`` events of a real RadixCache (inserts of 1-4 page nodes, evictions)."""
    from radixkv.cache.radix_cache import RadixCache
    from radixkv.events.sources import drain_events

    cache = RadixCache(page_size=PS, enable_kv_events=True)
    rng = np.random.default_rng(seed)
    out: list[Any] = []
    while len(out) < n:
        toks = rng.integers(0, 1000, PS * int(rng.integers(1, 5))).astype(np.int32)
        cache.insert(toks, np.arange(toks.size))
        if rng.random() < 0.3:
            cache.evict(PS * 2)
        out.extend(drain_events(cache))
    return out[:n]


def bench_hub(events: list[Any], batch: int, watchers: int, zmq_on: bool) -> dict[str, Any]:
    from radixkv.service.server.event_hub import EventHub
    from radixkv.service.server.servicer import encode_record

    pending: list[Any] = []

    def source() -> list[Any]:
        out = list(pending)
        pending.clear()
        return out

    hub = EventHub(source, capacity=1 << 16, encode=encode_record)
    cursors = [hub.subscribe(f"w{i}", 0) for i in range(watchers)]
    outlet = _ZmqOutlet(hub) if zmq_on else None

    t0 = time.perf_counter()
    n_batches = 0
    for i in range(0, len(events), batch):
        pending.extend(events[i:i + batch])
        hub.pump()
        n_batches += 1
        for c in cursors:
            for r in hub.read(c).records:
                hub.encoded(r)
        if outlet is not None:
            outlet.drain(False)
    if outlet is not None:
        while hub.stats().outlet_retries and hub.run_outlets():
            pass
        deadline = time.monotonic() + 30
        while outlet.received < outlet.pub.stats().next_seq and time.monotonic() < deadline:
            outlet.drain(True)
    dt = time.perf_counter() - t0
    res = {"part": "zmq" if zmq_on else "hub", "watchers": watchers, "events": len(events), "batch": batch,
           "seconds": dt, "events_per_s": len(events) / dt}
    if outlet is not None:
        res["zmq_batches_sent"] = outlet.pub.stats().next_seq
        res["zmq_batches_received"] = outlet.received
        outlet.close()
    hub.check_invariants()
    return res


class _ZmqOutlet:
    """The hub's ZMQ outlet (an ``ipc://`` publisher) and a SUB socket here counting its batches."""

    def __init__(self, hub: EventHub):
        import zmq

        from radixkv.events.zmq_publisher import ZmqEventPublisher

        self.dir = tempfile.mkdtemp(prefix="rkv-bh-")
        self.pub = ZmqEventPublisher(f"ipc://{self.dir}/pub", put_timeout_s=0.0)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self.sub.connect(self.pub.endpoint)
        time.sleep(0.3)  # slow joiner
        self.received = 0
        hub.add_outlet("zmq", lambda recs: self.pub.publish([r.event for r in recs]))

    def drain(self, block: bool) -> None:
        """Receive what has arrived (``block``: wait up to 2 s for the first batch)."""
        while self.sub.poll(2000 if block else 0):
            self.sub.recv_multipart()
            self.received += 1
            block = False

    def close(self) -> None:
        self.sub.close()
        self.pub.close()
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


def _serve(argv: list[str]) -> None:
    from radixkv.service.server.cli import main

    sys.exit(main(argv))


def bench_grpc(n_events: int, watcher_counts: list[int]) -> list[dict[str, Any]]:
    from radixkv.service.client import connect

    from radixkv.engine.protocol import ExtendItem

    d = tempfile.mkdtemp(prefix="rkv-bg-")
    token = secrets.token_urlsafe(24)
    tf = os.path.join(d, "token")
    with open(tf, "w") as f:
        f.write(token)
    os.chmod(tf, 0o600)
    address = f"unix://{d}/s.sock"
    argv = ["serve", "--address", address, "--token-file", tf, "--log-level", "WARNING", "--device", "cpu",
            "--kv-tokens", "65536", "--page-size", str(PS), "--enable-kv-events", "--lease-ttl-s", "600",
            "--kv-events-ring-size", str(max(65536, n_events)), "--max-requests-per-session", "256"]
    p = mp.get_context("spawn").Process(target=_serve, args=(argv,), daemon=True)
    p.start()
    out = []
    try:
        c = connect(address, token=token, wait_s=120)
        s = c.attach("filler").session
        rng = np.random.default_rng(1)
        made, k = 0, 0
        while made < n_events:  # 64 one-page requests per call: one BlockStored each (+ evictions)
            items = [ExtendItem(f"f{k + j}", rng.integers(0, 1 << 20, PS).astype(np.int32)) for j in range(64)]
            c.alloc_extend(s, items)
            c.cache_finished(s, [it.rid for it in items])
            k += 64
            made = len(c.take_events(s)) + made  # TakeEvents has its own cursor: counts, takes nothing from watchers
        for w in watcher_counts:
            clients = [connect(address, token=token, wait_s=30) for _ in range(w)]
            sessions = [cl.attach(f"watch{i}").session for i, cl in enumerate(clients)]
            counts = [0] * w
            done = threading.Barrier(w + 1)

            def run(i: int) -> None:
                for _ in clients[i].watch_events(sessions[i], poll_interval_s=0.05, start_seq=0):  # noqa: B023
                    counts[i] += 1  # noqa: B023
                    if counts[i] == made:  # noqa: B023
                        break
                done.wait()  # noqa: B023

            threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(w)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            done.wait(timeout=300)
            dt = time.perf_counter() - t0
            out.append({"part": "grpc", "watchers": w, "events": made, "seconds": dt,
                        "events_per_s_per_watcher": made / dt, "events_per_s_total": made * w / dt,
                        "complete": counts == [made] * w})
            for cl in clients:
                cl.close()
        c.close()
    finally:
        if p.is_alive():
            p.terminate()
            p.join(30)
        shutil.rmtree(d, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--grpc-events", type=int, default=20_000)
    ap.add_argument("--parts", nargs="+", default=["hub", "zmq", "grpc"], choices=["hub", "zmq", "grpc"])
    a = ap.parse_args(argv)
    events = recorded_events(a.events)
    results: list[dict[str, Any]] = []
    if "hub" in a.parts:
        for w in (0, 1, 4):
            results.append(bench_hub(events, a.batch, w, zmq_on=False))
    if "zmq" in a.parts:
        for w in (0, 4):
            results.append(bench_hub(events, a.batch, w, zmq_on=True))
    if "grpc" in a.parts:
        results.extend(bench_grpc(a.grpc_events, [1, 4]))
    print(f"{'part':<6}{'watchers':>9}{'events':>9}{'seconds':>9}{'events/s (per watcher)':>24}{'total events/s':>16}")
    for r in results:
        per = r.get("events_per_s_per_watcher", r.get("events_per_s"))
        tot = r.get("events_per_s_total", r.get("events_per_s"))
        print(f"{r['part']:<6}{r['watchers']:>9}{r['events']:>9}{r['seconds']:>9.3f}{per:>24,.0f}{tot:>16,.0f}")
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    print(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
