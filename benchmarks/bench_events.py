"""KV-event outlets: how fast radixkv encodes / decodes vLLM batches, converts events to Dynamo
JSON, and pushes batches through the ZMQ PUB socket to a subscriber.

The events come from a real RadixCache (page 16) fed random requests sharing prefixes, with
evictions. Prints a table and a JSON document; asserts nothing about speed.

    .venv/bin/python benchmarks/bench_events.py [--requests 400] [--tokens 1024] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import zmq

from radixkv.cache.radix_cache import RadixCache
from radixkv.events import DynamoEventAdapter, ZmqEventPublisher, decode_batch, drain_events, encode_batch


def workload(n_requests: int, n_tokens: int, page: int = 16, seed: int = 0):
    """Event batches (one per request) of a RadixCache under a 25%-of-traffic capacity."""
    rng = np.random.default_rng(seed)
    cache = RadixCache(page_size=page, enable_kv_events=True)
    prefixes = [rng.integers(0, 50_000, n_tokens // 2).astype(np.int32) for _ in range(8)]
    cap = n_requests * n_tokens // 4
    batches = []
    for _ in range(n_requests):
        tail = rng.integers(0, 50_000, n_tokens // 2).astype(np.int32)
        toks = np.concatenate([prefixes[int(rng.integers(0, 8))], tail])
        toks = toks[: toks.size - toks.size % page]
        over = cache.total_size() + toks.size - cap
        if over > 0:
            cache.evict(over)
        cache.insert(toks, np.arange(toks.size))
        batches.append(drain_events(cache))
    return batches


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    batches = workload(a.requests, a.tokens)
    n_events = sum(len(b) for b in batches)
    n_tokens = sum(int(e.token_ids.size) for b in batches for e in b if hasattr(e, "token_ids"))
    payloads = [encode_batch(b, ts=0.0) for b in batches]
    n_bytes = sum(map(len, payloads))

    t_enc = best(lambda: [encode_batch(b, ts=0.0) for b in batches], a.repeat)
    t_dec = best(lambda: [decode_batch(p) for p in payloads], a.repeat)

    def dynamo():
        ad = DynamoEventAdapter(16)
        for b in batches:
            for e in b:
                ad.encode(e)
    t_dyn = best(dynamo, a.repeat)

    def zmq_roundtrip():
        with tempfile.TemporaryDirectory() as tmp:
            ctx = zmq.Context()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.RCVHWM, 0)
            with ZmqEventPublisher(f"ipc://{tmp}/ev", hwm=0) as pub:
                sub.connect(pub.endpoint)
                while True:  # wait for the subscription (ZMQ's slow joiner)
                    pub.publish([])
                    if sub.poll(20):
                        sub.recv_multipart()
                        break
                while sub.poll(20):
                    sub.recv_multipart()
                t0 = time.perf_counter()
                for b in batches:
                    pub.publish(b)
                got = 0
                while got < len(batches) and sub.poll(5000):
                    sub.recv_multipart()
                    got += 1
                dt = time.perf_counter() - t0
            sub.close()
            ctx.term()
            return dt, got
    zt = [zmq_roundtrip() for _ in range(a.repeat)]
    t_zmq, received = min(zt)

    doc = {
        "requests": a.requests, "tokens_per_request": a.tokens, "batches": len(batches), "events": n_events,
        "event_tokens": n_tokens, "payload_bytes": n_bytes,
        "encode_s": t_enc, "decode_s": t_dec, "dynamo_json_s": t_dyn, "zmq_publish_receive_s": t_zmq,
        "zmq_batches_received": received,
        "encode_events_per_s": n_events / t_enc, "encode_MB_per_s": n_bytes / t_enc / 1e6,
        "decode_events_per_s": n_events / t_dec, "dynamo_events_per_s": n_events / t_dyn,
        "dynamo_tokens_per_s": n_tokens / t_dyn, "zmq_batches_per_s": received / t_zmq,
    }
    print(f"{len(batches)} batches, {n_events} events, {n_tokens} event tokens, {n_bytes} payload bytes")
    print(f"{'stage':<28}{'seconds':>10}{'events/s':>14}")
    for name, t in (("vLLM encode (array)", t_enc), ("vLLM decode", t_dec), ("Dynamo JSON (+tokens_hash)", t_dyn),
                    ("ZMQ publish -> receive", t_zmq)):
        print(f"{name:<28}{t:>10.4f}{n_events / t:>14.0f}")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
