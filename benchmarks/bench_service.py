"""Cache-manager service benchmark: worker processes replaying a chat workload over gRPC,
against the embedded engine doing the same work in the same run.

Workload (seeded): every request is one chat turn: a shared system prompt (64 tokens), the
conversation's history (its earlier prompts and outputs) and a new user message of 16-48
tokens; it then generates 8 tokens. Each worker owns 16 conversations and picks them in
turn (a conversation longer than 700 tokens starts over). A *scheduler step* is one batch
call: the worker takes ``B`` requests, calls ``alloc_extend`` once for all of them, then
``alloc_decode`` 8 times (one token each), then ``cache_finished`` once, so a request costs
``10 / B`` calls.

Runs: a real server process (``radixkv serve``, Unix socket, shared-memory pools) and
``W`` = 1, 2, 4 worker processes (multiprocessing spawn), each with its own session, at
``B`` = 1, 8, 32 requests per step (``max(requests // B, min_steps)`` steps per worker). The
tree is flushed between runs. ``--transport socket`` (default, ``connect()``'s default)
sends the step calls over the manager's Step socket (plain frames on a Unix socket,
``radixkv.service.client.step_socket``), ``stream`` over the client's persistent gRPC Step
stream (``connect(..., step_socket=False)``), ``unary`` as one unary RPC each. The embedded baseline
replays exactly the same batches (all ``W`` workers' streams, one after the other) on a
fresh in-process ``CacheEngine`` with the same config and, like the server
(``--torch-threads 1``), one torch thread. Both sides first run 2 warm-up steps
per worker (other seeds, untimed) and flush the tree.

Reported per (W, B): requests/s (all workers together, wall clock), step latency p50/p99
(each batch call, as the worker sees it), the embedded engine's requests/s and step p50,
and ``overhead`` = remote seconds per request / embedded seconds per request (remote:
wall time of the run / requests of all workers). CPU time too, which a loaded machine
distorts less than wall time (every RPC wakes two processes, and on a busy machine each
wake-up may wait for a core): ``remote cpu`` = CPU seconds of the server process (all its
threads, ``/proc/PID/task/*/schedstat``) + of every worker process (``time.process_time``)
during the run, per request; ``embed cpu`` likewise for the embedded replay; ``cpu
overhead`` their ratio; ``main thr`` = the part of the server's and the workers' CPU spent
in their main threads (the server's event loop, which makes every engine call; the rest is
gRPC's own threads). Also the p50 of a single ``heartbeat`` call (one round trip, W=1).
Prints a table, then JSON (``--json FILE`` writes it too). Timing is never asserted; on a
shared machine the figures are provisional.

Decode reserves: ``--decode-reserve N`` (default 16) sets ``EngineConfig.decode_reserve`` of
BOTH the server and the embedded engine (the same work on each side): every running request
holds N KV slots ahead, so a decode step whose requests all hold >= 2 needs no allocator
call and the client answers it locally, replaying it on the manager before the session's
next call (``radixkv.service.client.local_decode``; ``--no-local-decode``: every decode is an RPC).
With 8 decode steps per request and N >= 9, a scheduler step is 2 calls over the Step stream
(AllocExtend, and CacheFinished with the ApplyDecodes replay riding on it; 3 with
``--transport unary``) instead of 10; ``rpcs_per_step`` is what the workers sent (their
clients' counters over the timed run) per scheduler step.

    python benchmarks/bench_service.py [--workers 1 2 4] [--batches 1 8 32] [--requests 256]
                                       [--min-steps 16] [--transport socket|stream|unary]
                                       [--decode-reserve 16] [--no-local-decode]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import signal
import sys
import tempfile
import time

import numpy as np

CONFIG = dict(kv_tokens=131072, request_rows=256, max_context_len=1024, max_requests_per_session=64,
              lease_ttl_s=120.0)
SYSTEM_LEN, MSG_MIN, MSG_MAX, GEN, CONVS, MAX_HISTORY = 64, 16, 48, 8, 16, 700
WARMUP_STEPS = 2


class ChatWorkload:
    """The request stream of one worker (deterministic from its seed)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.system = np.random.default_rng(7).integers(1, 32000, SYSTEM_LEN).astype(np.int32)
        self.history: list[np.ndarray] = [np.empty(0, np.int32) for _ in range(CONVS)]
        self.turn = 0
        self.n = 0

    def next_batch(self, b: int, tag: str):
        """``b`` requests: (rid, prompt int32, generated tokens int32[GEN])."""
        out = []
        for _ in range(b):
            c = self.turn % CONVS
            self.turn += 1
            if self.history[c].size > MAX_HISTORY:
                self.history[c] = np.empty(0, np.int32)
            msg = self.rng.integers(1, 32000, int(self.rng.integers(MSG_MIN, MSG_MAX + 1))).astype(np.int32)
            prompt = np.concatenate([self.system, self.history[c], msg])
            gen = self.rng.integers(1, 32000, GEN).astype(np.int32)
            self.history[c] = np.concatenate([self.history[c], msg, gen])
            self.n += 1
            out.append((f"{tag}-{self.n}", prompt, gen))
        return out


def run_steps(engine, session, workload: ChatWorkload, b: int, steps: int, tag: str, lat: list[float]):
    """``steps`` scheduler steps of ``b`` requests; appends each call's latency (s)."""
    from radixkv.engine.protocol import DecodeItem, ExtendItem

    for _ in range(steps):
        batch = workload.next_batch(b, tag)
        t = time.perf_counter()
        engine.alloc_extend(session, [ExtendItem(rid, p) for rid, p, _ in batch])
        lat.append(time.perf_counter() - t)
        for i in range(GEN):
            t = time.perf_counter()
            engine.alloc_decode(session, [DecodeItem(rid, int(g[i])) for rid, _, g in batch])
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.cache_finished(session, [rid for rid, _, _ in batch])
        lat.append(time.perf_counter() - t)


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of process ``pid`` (ns resolution from schedstat;
    clock ticks from /proc/PID/stat where schedstat is missing)."""
    total, base = 0, f"/proc/{pid}/task"
    try:
        for tid in os.listdir(base):
            try:
                with open(f"{base}/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass  # a thread that just ended
        return total / 1e9
    except FileNotFoundError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds of one thread (``tid == pid``: the process's main thread, which runs the
    server's event loop and so every engine call)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def worker_main(idx: int, address: str, token: str, plan, barrier, results, transport: str = "socket",
                heartbeat: bool = False, local_decode: bool = True):
    """One worker process: for each (B, steps) of ``plan``, wait at the barrier, run, report
    (with ``heartbeat``, then time 300 single calls after the last run)."""
    from radixkv.service.client import connect

    c = connect(address, token=token, wait_s=120, timeout_s=120, step_stream=transport != "unary",
                step_socket=transport == "socket", local_decode=local_decode)
    s = c.attach(f"bench-{idx}").session
    c.start_keepalive(s)
    for run, (b, steps) in enumerate(plan):
        run_steps(c, s, ChatWorkload(seed=10**6 + idx), b, WARMUP_STEPS, f"warm{idx}r{run}", [])
        barrier.wait(timeout=600)  # all warm; the main process flushes the tree
        barrier.wait(timeout=600)  # go
        wl = ChatWorkload(seed=1000 * run + idx)
        lat: list[float] = []
        rpcs0 = sum(c.rpc_counts.values())
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        run_steps(c, s, wl, b, steps, f"w{idx}r{run}", lat)  # each step's last call replays its decodes
        results.put((idx, run, time.perf_counter() - t0, wl.n, lat, time.process_time() - c0,
                     time.thread_time() - m0, sum(c.rpc_counts.values()) - rpcs0))
        if heartbeat and run == len(plan) - 1:
            hb = []
            for _ in range(300):
                t = time.perf_counter()
                c.heartbeat(s)
                hb.append(time.perf_counter() - t)
            results.put(("heartbeat", hb))
        barrier.wait(timeout=600)  # idle while the main process runs the embedded baseline
    c.detach(s)
    c.close()


def embedded_run(w: int, b: int, steps: int, run: int, config: dict):
    from radixkv.engine import CacheEngine, EngineConfig

    e = CacheEngine(EngineConfig(**config))
    sessions = [e.attach(f"e{i}").session for i in range(w)]
    for i in range(w):
        run_steps(e, sessions[i], ChatWorkload(seed=10**6 + i), b, WARMUP_STEPS, f"warm{i}r{run}", [])
    assert e.flush(sessions[0])
    lat: list[float] = []
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for i in range(w):
        wl = ChatWorkload(seed=1000 * run + i)
        run_steps(e, sessions[i], wl, b, steps, f"w{i}r{run}", lat)
        n += wl.n
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    e.check_invariants()
    return wall, n, lat, cpu


def pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=256, help="requests per worker per run (rounded to B)")
    ap.add_argument("--min-steps", type=int, default=16, help="scheduler steps per worker per run, at least")
    ap.add_argument("--transport", choices=("socket", "stream", "unary"), default="socket",
                    help="step calls over the manager's Step socket, the client's gRPC Step stream, "
                         "or one unary RPC each")
    ap.add_argument("--decode-reserve", type=int, default=16,
                    help="EngineConfig.decode_reserve of the server AND the embedded engine (default %(default)s)")
    ap.add_argument("--no-local-decode", action="store_true",
                    help="clients send every alloc_decode as an RPC (connect(..., local_decode=False))")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    config = dict(CONFIG, decode_reserve=args.decode_reserve)

    import torch
    from radixkv.service.client import connect
    from radixkv.service.server.cli import main as serve_main

    torch.set_num_threads(1)  # the embedded baseline runs with the server's --torch-threads 1
    load0 = os.getloadavg()[0]

    ctx = mp.get_context("spawn")
    d = tempfile.mkdtemp(prefix="rkv-bench-")
    token = secrets.token_urlsafe(24)
    tok_file = os.path.join(d, "token")
    with open(os.open(tok_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(token)
    address = f"unix://{d}/s.sock"
    flags = sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in config.items()), [])
    server = ctx.Process(target=serve_main, args=(["serve", "--address", address, "--token-file", tok_file,
                                                   "--log-level", "WARNING", "--sweep-interval-s", "1"] + flags,),
                         daemon=True)
    server.start()
    spid = server.pid
    if spid is None:  # a started Process has one
        raise RuntimeError("the manager process did not start")
    rows: list[dict] = []
    heartbeat_ms = None
    try:
        admin = connect(address, token=token, wait_s=120, timeout_s=120)
        admin_s = admin.attach("admin").session
        admin.start_keepalive(admin_s)
        for w in args.workers:
            plan = [(b, max(1, args.requests // b, args.min_steps)) for b in args.batches]
            barrier = ctx.Barrier(w + 1)
            results = ctx.Queue()
            procs = [ctx.Process(target=worker_main, daemon=True,
                                 args=(i, address, token, plan, barrier, results, args.transport, w == 1,
                                       not args.no_local_decode))
                     for i in range(w)]
            for p in procs:
                p.start()
            for run, (b, steps) in enumerate(plan):
                barrier.wait(timeout=600)
                assert admin.flush(admin_s), "requests still running after the warm-up"
                s_cpu0, s_main0 = proc_cpu_s(spid), thread_cpu_s(spid, spid)
                barrier.wait(timeout=600)
                got = [results.get(timeout=600) for _ in range(w)]
                s_cpu = proc_cpu_s(spid) - s_cpu0
                s_main = thread_cpu_s(spid, spid) - s_main0
                if w == 1 and run == len(plan) - 1 and heartbeat_ms is None:
                    hb = results.get(timeout=600)[1]
                    heartbeat_ms = {"p50": pct(hb, 50), "p99": pct(hb, 99)}
                admin.check_invariants()
                wall = max(g[2] for g in got)
                n = sum(g[3] for g in got)
                lat = [x for g in got for x in g[4]]
                e_wall, e_n, e_lat, e_cpu = embedded_run(w, b, steps, run, config)
                w_cpu = sum(g[5] for g in got)
                w_main = sum(g[6] for g in got)
                barrier.wait(timeout=600)
                assert e_n == n
                rows.append({
                    "workers": w, "batch": b, "requests": n,
                    "remote_req_per_s": n / wall, "remote_step_p50_ms": pct(lat, 50),
                    "remote_step_p99_ms": pct(lat, 99),
                    "embedded_req_per_s": e_n / e_wall, "embedded_step_p50_ms": pct(e_lat, 50),
                    "embedded_step_p99_ms": pct(e_lat, 99),
                    "overhead": (wall / n) / (e_wall / e_n),
                    "remote_cpu_us_per_req": (s_cpu + w_cpu) / n * 1e6,
                    "remote_server_cpu_us_per_req": s_cpu / n * 1e6, "remote_worker_cpu_us_per_req": w_cpu / n * 1e6,
                    "remote_server_main_cpu_us_per_req": s_main / n * 1e6,
                    "remote_worker_main_cpu_us_per_req": w_main / n * 1e6,
                    "embedded_cpu_us_per_req": e_cpu / e_n * 1e6,
                    "cpu_overhead": ((s_cpu + w_cpu) / n) / (e_cpu / e_n),
                    "rpcs_per_step": sum(g[7] for g in got) / (w * steps),
                })
            for p in procs:
                p.join(60)
        admin.detach(admin_s)
        admin.close()
    finally:
        if server.is_alive():
            os.kill(spid, signal.SIGTERM)
            server.join(30)
        if server.is_alive():
            server.kill()
        shutil.rmtree(d, ignore_errors=True)

    print(f"transport: {args.transport}, decode_reserve: {args.decode_reserve}, "
          f"local decode: {not args.no_local_decode}")
    print(f"{'W':>2} {'B':>3} {'req':>5} {'remote req/s':>12} {'step p50 ms':>11} {'step p99 ms':>11} "
          f"{'embed req/s':>11} {'embed p50 ms':>12} {'overhead':>8} {'remote cpu us/req (srv+wrk)':>27} "
          f"{'main thr srv+wrk':>16} {'embed cpu us/req':>16} {'cpu overhead':>12} {'rpc/step':>8}")
    for r in rows:
        cpu = (f"{r['remote_cpu_us_per_req']:.0f} ({r['remote_server_cpu_us_per_req']:.0f}+"
               f"{r['remote_worker_cpu_us_per_req']:.0f})")
        main = f"{r['remote_server_main_cpu_us_per_req']:.0f}+{r['remote_worker_main_cpu_us_per_req']:.0f}"
        print(f"{r['workers']:>2} {r['batch']:>3} {r['requests']:>5} {r['remote_req_per_s']:>12.1f} "
              f"{r['remote_step_p50_ms']:>11.3f} {r['remote_step_p99_ms']:>11.3f} {r['embedded_req_per_s']:>11.1f} "
              f"{r['embedded_step_p50_ms']:>12.3f} {r['overhead']:>7.2f}x {cpu:>27} "
              f"{main:>16} {r['embedded_cpu_us_per_req']:>16.0f} {r['cpu_overhead']:>11.2f}x "
              f"{r['rpcs_per_step']:>8.2f}")
    if heartbeat_ms:
        print(f"single call (heartbeat, W=1): p50 {heartbeat_ms['p50']:.3f} ms, p99 {heartbeat_ms['p99']:.3f} ms")
    doc = {"benchmark": "bench_service", "config": config, "gen_tokens": GEN, "transport": args.transport,
           "decode_reserve": args.decode_reserve, "local_decode": not args.no_local_decode,
           "min_steps": args.min_steps, "runs": rows,
           "heartbeat_ms": heartbeat_ms, "python": sys.version.split()[0], "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_avg_1m_start": load0, "load_avg_1m": os.getloadavg()[0]}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
