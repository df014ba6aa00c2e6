"""Loads from Mooncake Store through radixkv beside the raw client, in one run.

Starts a ``mooncake_master`` on free loopback ports (TCP) and four clients in this process:

* ``holder``: a plain ``MooncakeDistributedStore`` owning the only segment (so every object
  lives there and every read crosses the transport);
* ``raw``: a plain client (no segment) that writes the pages with ``batch_put_from`` and reads
  them with ``batch_get_into`` into a registered buffer (the fastest raw call) and with
  ``get_batch`` (bytes objects);
* two radixkv ``MooncakeStorage`` clients (no segment), ``verify=length`` (the default: the
  object is the page) and ``verify=checksum`` (a 64-byte header before it), each writing the
  same pages with ``batch_set`` and reading them with ``batch_get`` into registered rows.

So every reader fetches the same bytes from the same segment. Per batch size the calls
alternate in a shuffled order, ``--repeats`` times each; the median call time is reported,
and radixkv's throughput as a fraction of the raw ``batch_get_into`` (target >= 0.8 at 64+
pages). Every read is checked bit-equal to the pages written.

    python benchmarks/bench_mooncake.py [--page-bytes 65536] [--batches 1,8,64,256] [--repeats 30]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import numpy as np
import torch
from tooling.mooncake_master import MooncakeMaster, mooncake_missing

from radixkv.storage.keys import layout_fingerprint, page_keys, storage_seed
from radixkv.storage.mooncake import MooncakeStorage


def _time_s(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(page_bytes: int, batches: list[int], repeats: int) -> list[dict[str, Any]]:
    from mooncake.store import MooncakeDistributedStore

    top = max(batches)
    master = MooncakeMaster()
    master.start()
    clients: list[MooncakeStorage] = []
    meta, rpc = f"http://127.0.0.1:{master.metadata_port}/metadata", f"127.0.0.1:{master.rpc_port}"
    holder, raw = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        segment = 4 * top * (page_bytes + 4096) + (64 << 20)
        local = 2 * top * page_bytes + (16 << 20)  # get_batch's bytes come through the local buffer
        if holder.setup("127.0.0.1", meta, segment, 16 << 20, "tcp", "", rpc) != 0 or \
                raw.setup("127.0.0.1", meta, 0, local, "tcp", "", rpc) != 0:
            raise RuntimeError("a raw Mooncake client did not connect")
        readers = {v: MooncakeStorage.from_url(master.url(segment_bytes=0, buffer_bytes="16MiB", verify=v), page_bytes)
                   for v in ("length", "checksum")}
        clients += readers.values()
        if not all(c.wait_connected(60) for c in clients):
            raise RuntimeError("a radixkv Mooncake client did not connect")

        pages = torch.randint(0, 256, (top, page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        keys = page_keys(np.arange(top * 16, dtype=np.int32), 16, storage_seed(b"bench", layout_fingerprint(bench=1)))
        raw_keys = [f"raw/{k}" for k in keys]
        raw_dst = pages.clone()
        raw.register_buffer(raw_dst.data_ptr(), raw_dst.numel())
        if min(raw.batch_put_from(raw_keys, [raw_dst[i].data_ptr() for i in range(top)], [page_bytes] * top)) < 0:
            raise RuntimeError("the raw client could not write the pages")
        dsts = {v: pages.clone() for v in readers}
        for v, r in readers.items():
            r.register_buffer(dsts[v])
            if not all(r.batch_set(keys, dsts[v])):
                raise RuntimeError(f"radixkv ({v}) could not write the pages")
        for t in (raw_dst, *dsts.values()):
            t.zero_()

        rows, rng = [], random.Random(0)
        for n in batches:
            ptrs = [raw_dst[i].data_ptr() for i in range(n)]

            def raw_into(n: int = n, ptrs: list[int] = ptrs) -> None:
                if min(raw.batch_get_into(raw_keys[:n], ptrs, [page_bytes] * n)) != page_bytes:
                    raise RuntimeError("raw batch_get_into missed")

            def raw_bytes(n: int = n) -> None:
                if len(raw.get_batch(raw_keys[:n])[-1]) != page_bytes:
                    raise RuntimeError("raw get_batch missed")

            def radix(v: str, n: int = n) -> None:
                if not all(readers[v].batch_get(keys[:n], dsts[v][:n])):
                    raise RuntimeError(f"radixkv batch_get ({v}) missed")

            fns: dict[str, Callable[[], None]] = {
                "raw_batch_get_into": raw_into, "raw_get_batch": raw_bytes,
                "radixkv_length": lambda: radix("length"), "radixkv_checksum": lambda: radix("checksum")}
            for fn in fns.values():  # warm-up
                fn()
            times: dict[str, list[float]] = {k: [] for k in fns}
            order = list(fns)
            for _ in range(repeats):  # interleaved in a shuffled order: load drifts hit every reader alike
                rng.shuffle(order)
                for name in order:
                    times[name].append(_time_s(fns[name]))
            s = {k: statistics.median(v) for k, v in times.items()}
            for v, dst in (("raw", raw_dst), *dsts.items()):
                if not torch.equal(dst[:n], pages[:n]):
                    raise RuntimeError(f"radixkv ({v}) read bytes that differ")
            mib = n * page_bytes / (1 << 20)
            rows.append({"pages": n, "page_bytes": page_bytes, **{f"{k}_ms": round(t * 1e3, 4) for k, t in s.items()},
                         **{f"{k}_gib_s": round(mib / 1024 / t, 3) for k, t in s.items()},
                         "ratio_length": round(s["raw_batch_get_into"] / s["radixkv_length"], 3),
                         "ratio_checksum": round(s["raw_batch_get_into"] / s["radixkv_checksum"], 3)})
        return rows
    finally:
        for c in clients:
            c.close()
        raw.close()
        holder.close()
        master.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-bytes", type=int, default=65536)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    args = ap.parse_args()
    why = mooncake_missing()
    if why is not None:
        sys.exit(why)
    torch.set_num_threads(1)
    load = os.getloadavg()
    rows = run(args.page_bytes, [int(b) for b in args.batches.split(",")], args.repeats)
    machine = {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load],
               "loadavg_after": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
               "torch": torch.__version__, "mooncake": version("mooncake-transfer-engine-non-cuda")}
    if args.json:
        for row in rows:
            print(json.dumps({**row, **machine}))
        return
    print(json.dumps(machine))
    print(f"{'pages':>6} {'raw into ms':>12} {'raw bytes ms':>13} {'rkv len ms':>11} {'rkv cksum ms':>13} "
          f"{'raw GiB/s':>10} {'rkv len/raw':>12} {'rkv cksum/raw':>14}")
    for r in rows:
        print(f"{r['pages']:>6} {r['raw_batch_get_into_ms']:>12.3f} {r['raw_get_batch_ms']:>13.3f} "
              f"{r['radixkv_length_ms']:>11.3f} {r['radixkv_checksum_ms']:>13.3f} "
              f"{r['raw_batch_get_into_gib_s']:>10.2f} {r['ratio_length']:>12.2f} {r['ratio_checksum']:>14.2f}")


if __name__ == "__main__":
    main()
