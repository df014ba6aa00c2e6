"""The manager's sockets under abuse (issue 34): what a local attacker costs it, and what a
worker attached before the attack sees.

Each part starts its own ``radixkv serve`` process (Unix socket, the Step socket on), attaches
one worker that heartbeats every 10 ms, measures its heartbeat p50/p99 for ``--seconds``
before and during the attack, and reports the manager's CPU share, open descriptors, RSS and
log output (lines and bytes) during the attack:

``fdflood``: the manager under ``ulimit -n 64`` (soft and hard); 120 silent connections to
the Step socket (the manager runs out of descriptors accepting them).
``partial``: 4 connections that say hello, announce a 60 MiB frame and send all of it but one
byte (``--max-message-bytes 64 MiB``; a frame's deadline is then 5 s + 15 s: run it with
``--seconds 25`` to see them closed).
``grpc-partial``: the same against the gRPC ``Step`` stream (a raw HTTP/2 client, ``h2``):
4 connections each open the stream with the worker's token, send a gRPC message header
announcing 60 MiB and then as much of the body as HTTP/2 flow control lets through in 10 s
(at most all but one byte); reports the bytes each got through, the stream's grpc-status once
ended (4: DEADLINE_EXCEEDED) and whether the connection was closed. ``grpc-partial-unary``: the
same aimed at the unary ``Match``; ``grpc-partial-waves``: three such waves one after the other
(``--handshake-timeout-s 1``), RSS while held and after each wave's streams ended.
``metrics``: ``--metrics-port 0``; 200 idle TCP connections to it; then whether a scrape
still answers.
``replay``: the ZMQ outlet with its replay endpoint (``ipc://``); the worker first makes
~500 event batches (inserts), then 8 DEALER sockets of the attacker ask for a replay from
seq 0 over and over (reading the answers), and one sends malformed requests.

Usage: ``python benchmarks/bench_transport_abuse.py PART [--seconds 10]`` (PART: one of the above).
Timing is never asserted; on a shared machine the figures are provisional (load printed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
    return round(kb / 1024, 1)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Serve:
    """A ``radixkv serve`` process (its log in a file) and its address."""

    def __init__(self, extra: list[str], ulimit: str | None = None):
        self.dir = tempfile.mkdtemp(prefix="rkv-abuse-")
        self.token = secrets.token_urlsafe(24)
        tok = os.path.join(self.dir, "token")
        with open(os.open(tok, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.token)
        self.address = f"unix://{self.dir}/s.sock"
        self.log = open(os.path.join(self.dir, "serve.log"), "w+")
        cmd = [sys.executable, "-m", "radixkv", "serve", "--address", self.address, "--token-file", tok,
               "--kv-tokens", "65536", "--log-level", "INFO"] + [a.format(dir=self.dir) for a in extra]
        if ulimit:
            cmd = ["sh", "-c", f"ulimit {ulimit}; exec " + " ".join(cmd)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def log_text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        for name in os.listdir(self.dir):
            os.unlink(os.path.join(self.dir, name))
        os.rmdir(self.dir)


def heartbeats(c: Any, s: Any, seconds: float) -> dict[str, float]:
    lat = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        t = time.perf_counter()
        c.heartbeat(s)
        lat.append(time.perf_counter() - t)
        time.sleep(0.01)
    return {"heartbeats": len(lat), "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
            "p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2)}


def during(srv: Serve, c: Any, s: Any, seconds: float) -> dict[str, Any]:
    pid = srv.proc.pid
    log0, cpu0, t0 = len(srv.log_text()), proc_cpu_s(pid), time.monotonic()
    hb = heartbeats(c, s, seconds)
    text = srv.log_text()[log0:]
    dt = time.monotonic() - t0
    return {**hb, "manager_cpu_pct": round(100 * (proc_cpu_s(pid) - cpu0) / dt, 1), "fds": fds(pid),
            "rss_mb": rss_mb(pid), "log_lines": text.count("\n"), "log_bytes": len(text),
            "accept_tracebacks": len(re.findall(r"socket.accept\(\) out of system resource", text))}


def step_path(address: str) -> str:
    return address[len("unix://"):] + ".step"


def fdflood(srv: Serve, c: Any, s: Any, seconds: float) -> dict[str, Any]:
    held = []
    for _ in range(120):
        f = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        f.setblocking(False)
        try:
            f.connect(step_path(srv.address))
            held.append(f)
        except OSError:
            f.close()
    out = during(srv, c, s, seconds)
    out["connected"] = len(held)
    for f in held:
        f.close()
    return out


def fates(held: list[socket.socket]) -> list[str]:
    """Whether the manager closed each socket, sent something, or neither (the error); closes them."""
    out = []
    for f in held:
        f.settimeout(0.5)
        try:
            out.append("closed" if f.recv(1 << 16) == b"" else "answered")
        except OSError as e:
            out.append(type(e).__name__)
        f.close()
    return out


def partial(srv: Serve, c: Any, s: Any, seconds: float) -> dict[str, Any]:
    from radixkv.service.wire._gen import cache_manager_pb2 as pb
    from radixkv.service.wire.step import FRAME, SOCKET_VERSION

    n = 60 << 20
    held, answers = [], []
    chunk = b"\x0a" * (1 << 20)
    for _ in range(4):
        f = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        f.connect(step_path(srv.address))
        hello = pb.StepHello(token=srv.token, version=SOCKET_VERSION).SerializeToString()
        f.sendall(FRAME.pack(len(hello)) + hello)
        f.recv(1 << 16)
        try:
            f.sendall(FRAME.pack(n))
            for _ in range(59):
                f.sendall(chunk)
            f.sendall(chunk[:-1])
        except OSError as e:
            answers.append(type(e).__name__)
        held.append(f)
    out = during(srv, c, s, seconds)
    out["connections"] = answers + fates(held)
    return out


def grpc_partial(srv: Serve, c: Any, s: Any, seconds: float,
                 method: str = "/radixkv.v1.CacheManager/Step") -> dict[str, Any]:
    from tooling.raw_h2 import PartialStep

    held = [PartialStep(srv.address[len("unix://"):], srv.token, 60 << 20, 10.0, method) for _ in range(4)]
    sent = [h.sent for h in held]
    out = during(srv, c, s, seconds)
    status = [h.status() if h.wait_end(0.5) else None for h in held]  # the stream's grpc-status, if ended
    out.update(body_bytes_sent=sent, stream_status=status, connections=fates([h.sock for h in held]))
    return out


def grpc_partial_unary(srv: Serve, c: Any, s: Any, seconds: float) -> dict[str, Any]:
    return grpc_partial(srv, c, s, seconds, "/radixkv.v1.CacheManager/Match")


def grpc_partial_waves(srv: Serve, c: Any, s: Any, seconds: float) -> dict[str, Any]:
    """Three waves of ``grpc-partial``, each after the last one's streams ended (deadline
    1 s + 16 s): whether the memory they held is taken again or added."""
    from tooling.raw_h2 import PartialStep

    pid, out = srv.proc.pid, {}
    for wave in range(3):
        held = [PartialStep(srv.address[len("unix://"):], srv.token, 60 << 20, 10.0) for _ in range(4)]
        peak = rss_mb(pid)
        ended = [h.status() if h.wait_end(60.0) else None for h in held]
        c.heartbeat(s)
        out[f"wave_{wave}"] = {"rss_mb_held": peak, "stream_status": ended, "rss_mb_ended": rss_mb(pid)}
        for h in held:
            h.close()
    out.update(during(srv, c, s, seconds))
    return out


def metrics(srv: Serve, c: Any, s: Any, seconds: float) -> dict[str, Any]:
    import urllib.request

    m = re.search(r"metrics http://([\d.]+):(\d+)/metrics", srv.log_text())
    if m is None:
        raise RuntimeError("no metrics port in the log")
    host, port = m.group(1), int(m.group(2))
    held, failed = [], 0
    t0 = time.monotonic()
    for i in range(200):
        if i % 10 == 0:
            c.heartbeat(s)  # the worker stays live while the connections are made
        try:
            held.append(socket.create_connection((host, port), timeout=2))
        except OSError:
            failed += 1
    connect_s = round(time.monotonic() - t0, 2)
    out = during(srv, c, s, seconds)
    out.update(connected=len(held), connect_failed=failed, connect_s=connect_s)
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            out["scrape"] = r.status
    except OSError as e:
        out["scrape"] = type(e).__name__
    alive = 0
    for h in held:
        h.settimeout(0.01)
        try:
            alive += h.recv(1) != b""
        except TimeoutError:
            alive += 1
        except OSError:
            pass
        h.close()
    out["idle_still_open"] = alive
    return out


def replay(srv: Serve, c: Any, s: Any, seconds: float) -> dict[str, Any]:
    import threading

    import zmq

    from radixkv.engine.protocol import ExtendItem

    for i in range(500):  # ~one event batch each (the pump runs every 5 ms)
        c.alloc_extend(s, [ExtendItem(f"r{i}", np.arange(i * 64 + 1, i * 64 + 65, dtype=np.int32))])
        c.cache_finished(s, [f"r{i}"])
        time.sleep(0.006)
    stop, counts = threading.Event(), {"answers": 0, "messages": 0, "malformed_sent": 0}
    ctx = zmq.Context()

    def flood() -> None:
        socks = []
        for _ in range(8):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"ipc://{srv.dir}/replay")
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(d)
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(f"ipc://{srv.dir}/replay")
        poller = zmq.Poller()
        for d in socks + [bad]:
            poller.register(d, zmq.POLLIN)
        while not stop.is_set():
            bad.send_multipart([b"", b"\x00"])
            counts["malformed_sent"] += 1
            for d, _ in poller.poll(100):
                while d.poll(0):
                    _, sq, _p = d.recv_multipart()
                    counts["messages"] += 1
                    if sq == b"\xff" * 8 and d is not bad:
                        counts["answers"] += 1
                        d.send_multipart([b"", (0).to_bytes(8, "big")])
        for d in socks + [bad]:
            d.close()

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    out = during(srv, c, s, seconds)
    stop.set()
    t.join(10)
    ctx.term()
    out.update(counts)
    return out


PARTS = {"fdflood": (fdflood, ["--handshake-timeout-s", "600"], "-n 64"),  # the silent ones stay
         "partial": (partial, ["--max-message-bytes", str(64 << 20)], None),
         "grpc-partial": (grpc_partial, ["--max-message-bytes", str(64 << 20)], None),
         "grpc-partial-unary": (grpc_partial_unary, ["--max-message-bytes", str(64 << 20)], None),
         "grpc-partial-waves": (grpc_partial_waves,
                                ["--max-message-bytes", str(64 << 20), "--handshake-timeout-s", "1"], None),
         "metrics": (metrics, ["--metrics-port", "0"], None),
         "replay": (replay, ["--enable-kv-events", "--kv-events-endpoint", "ipc://{dir}/events",
                             "--kv-events-replay-endpoint", "ipc://{dir}/replay"], None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args(argv)
    from radixkv.service.client import connect

    attack, extra, ulimit = PARTS[args.part]
    srv = Serve(extra, ulimit)
    report: dict[str, Any] = {"part": args.part, "load_avg_start": os.getloadavg()}
    try:
        c = connect(srv.address, token=srv.token, wait_s=120, timeout_s=60)
        s = c.attach("beater").session
        report["before"] = during(srv, c, s, args.seconds)
        report["during"] = attack(srv, c, s, args.seconds)
        c.close()
    finally:
        report["load_avg_end"] = os.getloadavg()
        srv.close()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
