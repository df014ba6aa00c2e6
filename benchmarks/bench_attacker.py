"""The cache manager with an attacker present (issue 17): what hostile calls cost the manager,
and what legitimate workers see while an abuser runs.

Two parts, both against a real ``radixkv serve`` process (Unix socket, 5 s leases):

``oversize``: single hostile calls, as an authenticated client could send them: a Match of
500,000 empty queries (under 1 MiB), one of 4,000,000 (7.6 MiB) and an AllocExtend of
2,000,000 one-token items on a detached session (21 MiB). For each: the status it got and the
seconds until the answer, while a worker with a keep-alive stream is attached; afterwards,
whether that worker's session is still live and the manager's RSS.

``load``: ``--workers`` worker processes (spawned) run the chat workload of
``bench_service.py`` (alloc_extend, 8 decode steps, cache_finished per step, B=4) for
``--seconds`` each, twice: alone, then with an abuser present: one authenticated process
sending the largest calls the limits allow in a loop (a Match of ``max_items`` queries
carrying ``max_tokens`` tokens; an AllocExtend of ``max_items`` one-token items, refused for
want of rows), ``--health-streams`` unauthenticated ``Health.Watch`` streams and
``--idle-conns`` connections that never speak HTTP/2. Reported: the legitimate calls'
p50/p99 latency in both runs and their ratio, calls whose session had gone stale (a lease
that expired: must be 0), the abuser's calls by status, and at the end conservation and the
manager's invariants (``check_invariants``).

``watchers``: (events on) the manager's CPU and a worker's heartbeat p50 while idle, then
with ``--watchers`` WatchEvents streams that ask for a 1 ms poll (clamped by the manager).

Usage: ``python benchmarks/bench_attacker.py [oversize|load|watchers|all] [--seconds 15]``. Timing is
never asserted; on a shared machine the figures are provisional (the load average is printed).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_service import ChatWorkload, run_steps  # noqa: E402

CONFIG: dict[str, int | float] = dict(kv_tokens=65536, request_rows=128, max_context_len=1024,
                                      max_requests_per_session=64, lease_ttl_s=5.0)
METHOD = "/radixkv.v1.CacheManager/"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def raw_call(ch, method: str, raw: bytes, token: str, timeout: float = 300.0) -> tuple[str, float]:
    import grpc

    t = time.perf_counter()
    try:
        ch.unary_unary(METHOD + method)(raw, metadata=(("authorization", "Bearer " + token),), timeout=timeout)
        code = "OK"
    except grpc.RpcError as e:
        code = e.code().name
    return code, time.perf_counter() - t


def oversize(address: str, token: str, server_pid: int) -> dict:
    import grpc
    from radixkv.service.client import connect
    from radixkv.service.wire import codec as wire
    from radixkv.service.wire._gen import cache_manager_pb2 as pb

    from radixkv.engine.protocol import ExtendItem
    from radixkv.errors import StaleSessionError

    c = connect(address, token=token, wait_s=60, timeout_s=300)
    victim = c.attach("live-worker").session
    ka = c.start_keepalive(victim, interval_s=0.5)
    s = c.attach("abuser").session
    ref = wire.session_to_msg(s)
    dead = c.attach("detached").session
    c.detach(dead)
    ch = grpc.insecure_channel("unix:" + address[len("unix://"):],
                               options=[("grpc.max_send_message_length", 64 << 20)])
    out: dict = {}
    for name, method, raw in (
            ("match_500k_empty", "Match", pb.MatchRequest(session=ref, queries=[pb.MatchQuery()] * 500_000)),
            ("match_4M_empty", "Match", pb.MatchRequest(session=ref, queries=[pb.MatchQuery()] * 4_000_000)),
            ("alloc_extend_2M_stale", "AllocExtend", wire.extend_request_to_msg(
                wire.session_to_msg(dead), [ExtendItem("r", np.ones(1, np.int32))] * 2_000_000))):
        data = raw.SerializeToString()
        code, secs = raw_call(ch, method, data, token)
        out[name] = {"bytes": len(data), "code": code, "seconds": round(secs, 3)}
    try:
        c.heartbeat(victim)
        out["live_worker_session"] = "live"
    except StaleSessionError as e:
        out["live_worker_session"] = f"lost: {e}"
    out["keepalive_error"] = repr(ka.error) if ka.error is not None else None
    out["server_rss_mb"] = round(rss_mb(server_pid), 1)
    ka.stop()
    c.detach(s)
    c.close()
    ch.close()
    return out


def proc_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` so far (utime + stime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def watchers(address: str, token: str, server_pid: int, n: int, seconds: float) -> dict:
    import grpc
    from radixkv.service.client import connect
    from radixkv.service.wire import codec as wire
    from radixkv.service.wire._gen import cache_manager_pb2 as pb


    c = connect(address, token=token, wait_s=60, timeout_s=60)
    s = c.attach("beater").session

    def measure() -> dict:
        cpu0, t0 = proc_cpu_s(server_pid), time.monotonic()
        lat = []
        while time.monotonic() - t0 < seconds:
            t = time.perf_counter()
            c.heartbeat(s)
            lat.append(time.perf_counter() - t)
            time.sleep(0.01)
        return {"manager_cpu_pct": round(100 * (proc_cpu_s(server_pid) - cpu0) / (time.monotonic() - t0), 1),
                "heartbeat_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
                "heartbeat_max_ms": round(max(lat) * 1e3, 2)}

    out = {"idle": measure()}
    ch = grpc.insecure_channel("unix:" + address[len("unix://"):])
    w = c.attach("watcher").session
    req = pb.WatchEventsRequest(session=wire.session_to_msg(w), from_now=True, poll_interval_s=0.001)
    call: grpc.UnaryStreamMultiCallable[bytes, bytes] = ch.unary_stream("/radixkv.v1.CacheManager/WatchEvents")
    streams = [call(req.SerializeToString(), metadata=(("authorization", "Bearer " + token),)) for _ in range(n)]
    time.sleep(1.0)
    out[f"{n}_watchers_at_1ms"] = measure()
    for st in streams:
        st.cancel()
    ch.close()
    c.close()
    return out


def worker_main(idx: int, address: str, token: str, seconds: float, b: int, results) -> None:
    from radixkv.service.client import connect

    from radixkv.errors import RadixKVError, StaleSessionError

    c = connect(address, token=token, wait_s=120, timeout_s=120)
    s = c.attach(f"legit-{idx}").session
    ka = c.start_keepalive(s, interval_s=0.5)
    wl = ChatWorkload(seed=idx)
    lat: list[float] = []
    stale = errors = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            run_steps(c, s, wl, b, 1, f"w{idx}", lat)
        except StaleSessionError:
            stale += 1
            s = c.attach(f"legit-{idx}").session
        except RadixKVError:
            errors += 1
    results.put((idx, lat, stale, errors, repr(ka.error) if ka.error is not None else None))
    ka.stop()
    c.close()


def abuser_main(address: str, token: str, limits: tuple[int, int, int], health_streams: int, idle_conns: int,
                stop, results) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from radixkv.service.client import connect
    from radixkv.service.wire import codec as wire
    from radixkv.service.wire._gen import cache_manager_pb2 as pb

    from radixkv.engine.protocol import ExtendItem

    max_items, max_tokens, _ = limits
    c = connect(address, token=token, wait_s=60, timeout_s=300)
    s = c.attach("abuser").session
    ka = c.start_keepalive(s, interval_s=0.5)
    ref = wire.session_to_msg(s)
    per = max_tokens // max_items
    match = pb.MatchRequest(session=ref, queries=[pb.MatchQuery(
        token_ids_i32=wire.pack(np.arange(i * per, (i + 1) * per) % 30000, wire.I32)) for i in range(max_items)])
    extend = wire.extend_request_to_msg(ref, [ExtendItem(f"a{i}", np.array([i], np.int32)) for i in range(max_items)])
    calls = [("Match", match.SerializeToString()), ("AllocExtend", extend.SerializeToString())]
    path = address[len("unix://"):]
    ch = grpc.insecure_channel("unix:" + path)
    anon = [grpc.insecure_channel("unix:" + path) for _ in range(health_streams)]
    # typeshed's HealthStub omits Watch, which grpcio-health-checking's stub has
    watches = [health_pb2_grpc.HealthStub(a).Watch(health_pb2.HealthCheckRequest())  # type: ignore[attr-defined]
               for a in anon]
    idle = []
    for _ in range(idle_conns):
        sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sk.connect(path)
        idle.append(sk)
    codes: dict[str, int] = {}
    k = 0
    while not stop.is_set():
        method, raw = calls[k % 2]
        code, _ = raw_call(ch, method, raw, token)
        codes[f"{method}:{code}"] = codes.get(f"{method}:{code}", 0) + 1
        k += 1
    results.put(("abuser", codes, {"bytes": {m: len(r) for m, r in calls}}))
    for w in watches:
        w.cancel()
    for sk in idle:
        sk.close()
    for a in anon:
        a.close()
    ka.stop()
    ch.close()
    c.close()


def run_load(ctx, address: str, token: str, args, limits, abuse: bool) -> dict:
    results = ctx.Queue()
    stop = ctx.Event()
    abuser = None
    if abuse:
        abuser = ctx.Process(target=abuser_main, daemon=True,
                             args=(address, token, limits, args.health_streams, args.idle_conns, stop, results))
        abuser.start()
        time.sleep(2.0)  # the abuser is at work before the workers start
    procs = [ctx.Process(target=worker_main, daemon=True, args=(i, address, token, args.seconds, args.batch, results))
             for i in range(args.workers)]
    for p in procs:
        p.start()
    lat: list[float] = []
    stale = errors = 0
    ka_errors = []
    for _ in procs:
        _, ls, st, er, kae = results.get(timeout=600)
        lat += ls
        stale += st
        errors += er
        if kae:
            ka_errors.append(kae)
    for p in procs:
        p.join(60)
    out: dict = {"calls": len(lat), "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
                 "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2), "stale_session_calls": stale,
                 "other_errors": errors, "keepalive_errors": ka_errors}
    if abuser is not None:
        stop.set()
        _, codes, sizes = results.get(timeout=600)
        abuser.join(60)
        out["abuser"] = {"calls": codes, **sizes, "health_streams": args.health_streams,
                         "idle_connections": args.idle_conns}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", nargs="?", default="all", choices=["oversize", "load", "watchers", "all"])
    ap.add_argument("--watchers", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=15.0, help="each load run (default %(default)s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--health-streams", type=int, default=16)
    ap.add_argument("--idle-conns", type=int, default=50)
    args = ap.parse_args(argv)

    from radixkv.service.client import connect
    from radixkv.service.server.cli import main as serve_main
    from radixkv.service.wire.limits import limits_for

    ctx = mp.get_context("spawn")
    d = tempfile.mkdtemp(prefix="rkv-attack-")
    token = secrets.token_urlsafe(24)
    tok_file = os.path.join(d, "token")
    with open(os.open(tok_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(token)
    address = f"unix://{d}/s.sock"
    flags = sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in CONFIG.items()), [])
    server = ctx.Process(target=serve_main, daemon=True,
                         args=(["serve", "--address", address, "--token-file", tok_file, "--log-level", "WARNING",
                                "--sweep-interval-s", "0.5", "--max-message-bytes", str(64 << 20)] + flags
                               + (["--enable-kv-events"] if args.part == "watchers" else []),))
    server.start()
    spid = server.pid
    if spid is None:  # a started Process has one
        raise RuntimeError("the manager process did not start")
    limits = tuple(limits_for(int(CONFIG["kv_tokens"]), int(CONFIG["request_rows"])))
    report: dict = {"config": CONFIG, "limits": limits, "load_avg_start": os.getloadavg()}
    try:
        admin = connect(address, token=token, wait_s=120, timeout_s=300)
        if args.part in ("oversize", "all"):
            report["oversize"] = oversize(address, token, spid)
        if args.part == "watchers":
            report["watchers"] = watchers(address, token, spid, args.watchers, min(args.seconds, 10.0))
        if args.part in ("load", "all"):
            report["alone"] = run_load(ctx, address, token, args, limits, abuse=False)
            report["with_abuser"] = run_load(ctx, address, token, args, limits, abuse=True)
            report["p99_ratio"] = round(report["with_abuser"]["p99_ms"] / report["alone"]["p99_ms"], 2)
            st = admin.stats()
            report["end"] = {"conservation": st.kv_available + st.kv_evictable + st.kv_protected + st.kv_held
                             == st.kv_capacity, "requests": st.requests}
            admin.check_invariants()
            report["end"]["invariants"] = "hold"
        report["server_rss_mb_end"] = round(rss_mb(spid), 1)
        admin.close()
    finally:
        report["load_avg_end"] = os.getloadavg()
        if server.is_alive():
            os.kill(spid, signal.SIGTERM)
            server.join(30)
        if server.is_alive():
            server.kill()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
