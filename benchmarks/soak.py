"""Soak: a cache manager under a mixed workload with worker churn, watched for drift.

    python benchmarks/soak.py --minutes 3 [--workers 6] [--out soak.json]

A ``radixkv serve`` process (quarantine on) serves worker processes started by the chaos
pool (fresh interpreters running ``tooling.chaos_worker``, never forked). Each
worker runs a random mix of extend / decode / cache / release / match calls over prompts
that share prefixes, then meets one fate:

* ``kill``: SIGKILLed from outside at a random moment;
* ``self_kill``: kills itself at a named point (between alloc and insert, holding locks,
  mid-call, mid-batch, after decode);
* ``detach``: finishes and detaches;
* ``vanish``: exits without detaching (its lease or dropped stream reclaims it);
* ``stop``: SIGSTOPped past its lease, SIGCONTed (its calls are refused as stale; it writes
  into the slots it held, which are quarantined), then killed.

Every ``--idle-every-s`` seconds the churn pauses until the manager is idle (no session);
then ``CheckInvariants`` runs, the conservation law is checked, the tree is evicted and every
KV slot must be free again (zero leaks; it also makes idle points comparable: the cache is
empty at each), and the manager's RSS,
thread count and open file descriptors are sampled (they are also sampled every 2 s). The
summary (JSON, and a table) reports the counts, the idle checks and the drift between the
first and the last idle point. Exit code 1 when an idle check failed or a session leaked.
Nothing is asserted about speed.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from radixkv.service.client import connect
from tooling.chaos import KILL_POINTS, StandbyPool
from tooling.proc_stats import drift, proc_sample

FATES = (("kill", 0.40), ("self_kill", 0.20), ("detach", 0.15), ("vanish", 0.15), ("stop", 0.10))


def start_server(directory: str, args: argparse.Namespace) -> dict[str, Any]:
    token = secrets.token_urlsafe(24)
    token_file = os.path.join(directory, "token")
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, token.encode())
    os.close(fd)
    address = f"unix://{directory}/sock/s.sock"
    p = subprocess.Popen([sys.executable, "-m", "radixkv.service.server.cli", "serve", "--address", address,
                          "--token-file", token_file, "--log-level", "WARNING", "--kv-tokens", str(args.kv_tokens),
                          "--request-rows", "512", "--max-context-len", "256", "--max-sessions", "256",
                          "--lease-ttl-s", str(args.ttl), "--sweep-interval-s", "0.1",
                          "--quarantine-s", str(args.quarantine_s), "--grace-s", "2"])
    client = connect(address, token=token, wait_s=120, timeout_s=30)
    client.stats()
    return {"process": p, "address": address, "token": token, "client": client}


def wait_idle(client: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.stats()
        if st.sessions == 0:
            return st
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    directory = tempfile.mkdtemp(prefix="radixkv-soak-")
    srv = start_server(directory, args)
    c, pid = srv["client"], srv["process"].pid
    pool = StandbyPool()
    counts: dict[str, int] = {f: 0 for f, _ in FATES}
    events: dict[str, int] = {}
    errors: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    samples = [proc_sample(pid)]
    fates, probs = [f for f, _ in FATES], np.array([p for _, p in FATES])
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    next_idle = t0 + args.idle_every_s
    next_sample = t0 + 2.0
    wid = 0
    active: dict[int, dict[str, Any]] = {}
    try:
        while True:
            now = time.monotonic()
            pausing = now >= next_idle or now >= end
            while not pausing and len(active) < args.workers:
                fate = str(rng.choice(fates, p=probs))
                spec = dict(wid=wid, address=srv["address"], token=srv["token"], seed=int(rng.integers(1 << 30)),
                            steps=int(rng.integers(3, 16)), keepalive=bool(rng.random() < 0.5) and fate != "stop",
                            ka_interval_s=0.2, hold=fate in ("kill", "stop", "self_kill"), hb_interval_s=0.2,
                            detach=fate == "detach", marker=float(wid % 1000 + 1), max_life_s=120,
                            kill_at=str(rng.choice(KILL_POINTS)) if fate == "self_kill" else None,
                            kill_nth=int(rng.integers(1, 3)))
                pool.spawn(spec)
                deadline = now + (float(rng.uniform(0.01, 0.5)) if fate == "kill" else 15.0)
                active[wid] = {"fate": fate, "deadline": deadline, "phase": 0}
                counts[fate] += 1
                wid += 1
            for ev in pool.drain(0.01):
                kind: str = ev.get("ev", "?")
                w: int = ev.get("wid", -1)  # -1: no worker (a standby's id, never active)
                events[kind] = events.get(kind, 0) + 1
                a = active.get(w)
                if kind == "error":
                    errors.append(ev)
                if a is None:
                    continue
                if kind in ("done", "point", "error"):
                    a["deadline"] = 0.0
                elif kind == "holding" and a["fate"] == "stop":
                    pool.workers[w].signal(signal.SIGSTOP)
                    a["phase"], a["deadline"] = 1, time.monotonic() + args.ttl + 0.5
                elif kind == "stale_write":
                    a["deadline"] = 0.0
            now = time.monotonic()
            for w in [w for w, a in active.items()
                      if a["deadline"] <= now or (pausing and not (a["fate"] == "stop" and a["phase"] >= 1))]:
                a = active[w]
                if a["fate"] == "stop" and a["phase"] == 1:
                    pool.workers[w].signal(signal.SIGCONT)  # it gets refused, writes stale, then dies
                    a["phase"], a["deadline"] = 2, now + 3.0
                    continue
                pool.kill(w)
                del active[w]
            if now >= next_sample:
                samples.append(proc_sample(pid))
                next_sample = now + 2.0
            if pausing and not active:
                st = wait_idle(c, 60)
                point: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1), "idle": st is not None}
                if st is not None:
                    try:
                        c.check_invariants()
                        law = st.kv_available + st.kv_evictable + st.kv_protected + st.kv_held == st.kv_capacity
                        point.update(invariants=True, law=law, kv_held=st.kv_held, requests=st.requests,
                                     rows_free=st.rows_available == st.rows_capacity, cached=st.kv_evictable)
                        # empty the tree so idle points compare like with like; every slot is free again
                        aud = c.attach("auditor").session
                        c.evict(aud, st.kv_capacity)
                        c.detach(aud)
                        after = c.stats()
                        point["all_free_after_evict"] = after.kv_available == after.kv_capacity
                    except Exception as e:  # reported, and the run fails
                        point.update(invariants=False, error=repr(e)[:300])
                s = proc_sample(pid)
                samples.append(s)
                point.update(rss_kib=s.rss_kib, threads=s.threads, fds=s.fds)
                idle.append(point)
                print(json.dumps({"idle_point": point}), flush=True)
                if time.monotonic() >= end:
                    break
                next_idle = time.monotonic() + args.idle_every_s
    finally:
        pool.close()
        c.close()
        srv["process"].send_signal(signal.SIGTERM)
        try:
            code = srv["process"].wait(30)
        except subprocess.TimeoutExpired:
            srv["process"].kill()
            code = srv["process"].wait(30)
        shutil.rmtree(directory, ignore_errors=True)
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"radixkv-{pid}-")] if os.path.isdir("/dev/shm") else []
    ok_points = [p for p in idle if p.get("idle") and p.get("invariants") and p.get("law") and p.get("kv_held") == 0
                 and p.get("rows_free") and p.get("all_free_after_evict")]
    idle_samples = [type(samples[0])(0.0, p["rss_kib"], p["threads"], p["fds"]) for p in idle]
    summary = {
        "minutes": args.minutes, "elapsed_s": round(time.monotonic() - t0, 1), "workers_spawned": wid,
        "fates": counts, "worker_events": events, "worker_errors": len(errors), "first_errors": errors[:3],
        "idle_points": len(idle), "idle_points_ok": len(ok_points),
        "server_exit_code": code, "shm_files_left": left,
        "drift_at_idle_points": {f: drift(idle_samples, f) for f in ("rss_kib", "threads", "fds")},
        "range_all_samples": {f: drift(samples, f) for f in ("rss_kib", "threads", "fds")},
        "samples": len(samples),
    }
    return summary


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=6, help="worker processes at once")
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--ttl", type=float, default=1.0, help="lease TTL of the manager (s)")
    ap.add_argument("--quarantine-s", type=float, default=10.0)
    ap.add_argument("--idle-every-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the summary JSON here too")
    args = ap.parse_args(argv)
    summary = run(args)
    print("\n| metric | value |\n| --- | --- |")
    for k in ("elapsed_s", "workers_spawned", "fates", "idle_points", "idle_points_ok", "worker_errors",
              "server_exit_code", "shm_files_left"):
        print(f"| {k} | {summary[k]} |")
    for f, d in summary["drift_at_idle_points"].items():
        print(f"| {f} at idle points (first / last / max / drift) | {d.get('first')} / {d.get('last')} / "
              f"{d.get('max')} / {d.get('drift')} |")
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    bad = summary["idle_points_ok"] != summary["idle_points"] or summary["worker_errors"] or summary["shm_files_left"] \
        or summary["server_exit_code"] != 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
