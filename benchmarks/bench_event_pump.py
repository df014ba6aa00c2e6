"""Cost of pumping the event hub right after each RPC (``CacheManagerServicer.answer``).

A real server (``tooling.testing.ThreadedServer``: gRPC over a Unix socket, shared
pools, in a thread of this process) with a hybrid model (``FKF``, page 4); one client runs
``--steps`` steps of ``AllocExtend`` (a new request: one of 8 shared 32-token prefixes, 0-7
random tokens) + ``CacheFinished``, and every 10th step an ``Evict(0 tokens, 2 states)``.
Modes:

* ``off``: ``enable_kv_events`` false: the hook is one attribute test per call;
* ``on``: events on, no ZMQ outlet: each call's events are numbered into the ring;
* ``on+zmq``: plus the ZMQ outlet (``ipc://``, state events inline): each call's events are
  also encoded (msgpack) and queued to the publisher thread, in the call.

The pump task (``events_interval_s`` 60 s) and the sweeper (1000 s) stay out of the way.
Reported per mode: client-side RPC latency (mean / p50 over every call), and server-side the
time spent in the hook per call (``pump_events`` wrapped with a timer; ``off``: a timeit of
the hook's test itself), split into calls that recorded events (pumped) and calls that did
not (one ``pending_events()`` test), and events per call. Timing is never asserted; on a shared machine the
figures are provisional.

    python benchmarks/bench_event_pump.py [--steps 2000] [--seed 0] [--json]
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
import timeit
from typing import Any

import numpy as np
from radixkv.service.server.manager import ServeOptions
from tooling.testing import ThreadedServer

from radixkv.engine import EngineConfig
from radixkv.engine.protocol import ExtendItem
from radixkv.events.zmq_flags import PublisherConfig

PS = 4
MODES = ("off", "on", "on+zmq")


def _config(events: bool) -> EngineConfig:
    return EngineConfig(layer_types="FKF", page_size=PS, kv_tokens=16384, head_num=1, head_dim=8,
                        kda_num_heads=1, kda_head_dim=8, state_slots=256, request_rows=16,
                        max_context_len=256, enable_kv_events=events)


def run_mode(mode: str, steps: int, seed: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="rkv-pump-")
    kv = PublisherConfig(f"ipc://{tmp}/pub", state_events="inline") if mode == "on+zmq" else None
    opts = ServeOptions(kv_events=kv, events_interval_s=60.0, sweep_interval_s=1000.0)
    srv = ThreadedServer(_config(mode != "off"), options=opts)
    srv.start()
    try:
        server = srv.running()
        sv, hub = server.servicer, server.events
        if sv is None or hub is None:
            raise RuntimeError("a started manager has a servicer and an event hub")
        hook = {"calls": 0, "s": 0.0, "events": 0, "busy": 0, "busy_s": 0.0}
        if sv.pump_after_calls:
            inner = sv.pump_events

            def timed() -> int:
                t0 = time.perf_counter()
                n = inner()
                dt = time.perf_counter() - t0
                hook["s"] += dt
                hook["calls"] += 1
                hook["events"] += n
                if n:  # a call that recorded events: pumped (numbered, outlets run)
                    hook["busy"] += 1
                    hook["busy_s"] += dt
                return n

            sv.pump_events = timed  # type: ignore[method-assign]  # answer() calls the instance attribute
        c = srv.client()
        s = c.attach("bench").session
        rng = np.random.default_rng(seed)
        prefixes = [rng.integers(0, 30000, 32).astype(np.int32) for _ in range(8)]
        lat: list[float] = []
        for i in range(steps):
            toks = np.concatenate([prefixes[int(rng.integers(0, 8))],
                                   rng.integers(0, 30000, int(rng.integers(0, 8))).astype(np.int32)])
            for call in (lambda: c.alloc_extend(s, [ExtendItem(f"r{i}", toks)]),  # noqa: B023
                         lambda: c.cache_finished(s, [f"r{i}"])):  # noqa: B023
                t0 = time.perf_counter()
                call()
                lat.append(time.perf_counter() - t0)
            if i % 10 == 9:
                t0 = time.perf_counter()
                c.evict(s, 0, 2)
                lat.append(time.perf_counter() - t0)
        rpcs = len(lat)
        if not sv.pump_after_calls:  # the hook's whole cost with events off: its test
            n = 1_000_000
            hook_us = timeit.timeit("if sv.pump_after_calls: sv.pump_events()", globals={"sv": sv}, number=n) / n * 1e6
        else:
            hook_us = hook["s"] / max(1, hook["calls"]) * 1e6
        stats = hub.stats()
        c.close()
        arr = np.array(lat) * 1e6
        idle = hook["calls"] - hook["busy"]
        return {"mode": mode, "rpcs": rpcs, "rpc_mean_us": round(float(arr.mean()), 1),
                "rpc_p50_us": round(float(np.percentile(arr, 50)), 1),
                "hook_us_per_call": round(hook_us, 3), "hook_calls": hook["calls"],
                "hook_us_per_pumping_call": round(hook["busy_s"] / max(1, hook["busy"]) * 1e6, 3),
                "hook_us_per_idle_call": round((hook["s"] - hook["busy_s"]) / max(1, idle) * 1e6, 3),
                "events": hook["events"], "events_per_rpc": round(hook["events"] / rpcs, 2),
                "hub_pumps": stats.pumps, "hub_next_seq": stats.next_seq}
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print only the JSON")
    a = ap.parse_args(argv)
    rows = [run_mode(m, a.steps, a.seed) for m in MODES]
    out = {"benchmark": "event_pump", "python": platform.python_version(), "machine": platform.machine(),
           "timings": "provisional", "steps": a.steps, "modes": rows}
    if not a.json:
        print(f"{'mode':8} {'rpcs':>6} {'rpc mean us':>12} {'rpc p50 us':>11} {'hook us/call':>13} "
              f"{'us/pumping':>11} {'us/idle':>8} {'events/rpc':>11}")
        for r in rows:
            print(f"{r['mode']:8} {r['rpcs']:6d} {r['rpc_mean_us']:12.1f} {r['rpc_p50_us']:11.1f} "
                  f"{r['hook_us_per_call']:13.3f} {r['hook_us_per_pumping_call']:11.3f} "
                  f"{r['hook_us_per_idle_call']:8.3f} {r['events_per_rpc']:11.2f}")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
