"""Can the manager count the connections gRPC closes for not completing the handshake?
(issue 17, item 5; the answer, and why, is in docs/reliability.md.)

A bare ``grpc.aio`` server on a Unix socket with ``grpc.server_handshake_timeout_ms`` set,
one real channel (HTTP/2 preface and SETTINGS sent, ``channel_ready``, no call) and
``--silent`` raw connections that send nothing. Prints what channelz (the ``cygrpc``
functions the ``grpcio-channelz`` service wraps) shows of each before the timeout, which
sockets are left after it, and what listing the sockets and reading their data costs.

    python benchmarks/probe_channelz.py [--silent 300] [--timeout-s 3]
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import socket
import tempfile
import time

import grpc

# gRPC's channelz entry points live in its private Cython module, which typeshed does not describe.
cygrpc = importlib.import_module("grpc._cython.cygrpc")

_VARYING = ("lastMessageSentTimestamp",)  # differs between any two sockets


def _sockets(server_id: int) -> list[int]:
    ids: list[int] = []
    while True:
        page = json.loads(cygrpc.channelz_get_server_sockets(server_id, ids[-1] + 1 if ids else 0, 0))
        ids += [int(r["socketId"]) for r in page.get("socketRef", [])]
        if page.get("end", False):
            return ids


def _data(sock_id: int) -> dict:
    d = json.loads(cygrpc.channelz_get_socket(sock_id))["socket"]["data"]
    return {k: v for k, v in d.items() if k not in _VARYING}


async def probe(silent: int, timeout_s: float) -> None:
    path = os.path.join(tempfile.mkdtemp(), "s.sock")
    srv = grpc.aio.server(options=[("grpc.server_handshake_timeout_ms", int(timeout_s * 1000))])
    srv.add_insecure_port("unix:" + path)
    await srv.start()
    server_id = int(json.loads(cygrpc.channelz_get_servers(0))["server"][0]["ref"]["serverId"])
    channel = grpc.aio.insecure_channel("unix:" + path)
    await asyncio.wait_for(channel.channel_ready(), 30)
    real = _sockets(server_id)
    raw = [socket.socket(socket.AF_UNIX) for _ in range(silent)]
    for s in raw:
        s.connect(path)
    await asyncio.sleep(min(1.0, timeout_s / 3))
    t0 = time.perf_counter()
    ids = _sockets(server_id)
    t1 = time.perf_counter()
    data = {i: _data(i) for i in ids}
    t2 = time.perf_counter()
    key = {i: json.dumps(d, sort_keys=True) for i, d in data.items()}
    kinds = set(key.values())
    print(f"before the timeout: {len(ids)} sockets listed ({len(real)} real + {len(ids) - len(real)} silent); "
          f"distinct socket data (timestamps aside): {len(kinds)}")
    for k in sorted(kinds):
        n = sum(v == k for v in key.values())
        print(f"  {n} socket(s){' (the real one among them)' if key[real[0]] == k else ''}: {k}")
    print(f"cost: listing {(t1 - t0) * 1e3:.2f} ms, every socket's data {(t2 - t1) * 1e3:.1f} ms")
    await asyncio.sleep(timeout_s + 2)
    print(f"after the timeout: {len(_sockets(server_id))} socket(s) listed")
    for s in raw:
        s.close()
    await channel.close()
    await srv.stop(None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--silent", type=int, default=300)
    ap.add_argument("--timeout-s", type=float, default=3.0)
    a = ap.parse_args(argv)
    asyncio.run(probe(a.silent, a.timeout_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
