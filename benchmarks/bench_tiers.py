"""Tier load throughput: host -> device and storage (file) -> host, each beside a plain copy of
the same bytes in the same run (issue 31's target: >= 0.8 of the plain copy at 64+ pages).

* ``host_to_device``: the host tier's ``HostKVPool.load(pages, rows)`` (host page ids -> device KV
  rows of an ``MHATokenToKVPool``; on the CPU one compiled pass when built) against
  ``dst.copy_(src)`` of as many contiguous bytes (pinned on CUDA), and the torch path of the same
  load (snapshot, then one indexed write per layer and K/V) in the same rounds (``torch path``).
* ``storage_to_host``: ``FileStorage.batch_get`` into host page rows against reading the same
  bytes from one plain file per page (``readinto``) in the same directory tree. Both read from a
  warm page cache (the pages were just written): this times the software path, not the disk.

Layout: ``--layers`` x ``--heads`` x ``--head-dim`` fp16 K and V (a 32 x 8 x 128 model scaled to
4 layers by default), pages of 16 and 64 tokens, batches of 1, 8, 64 and 256 pages. Each figure
is the median of ``--reps`` timed rounds after one warm-up, tier and plain interleaved. Prints a
table and, with ``--json F``, writes ``{"meta", "rows"}``. Never asserts on speed; checks bytes.

    python benchmarks/bench_tiers.py [--device cpu|cuda] [--json F] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.kv_pool import MHATokenToKVPool
from radixkv.storage.file import FileStorage
from radixkv.storage.keys import layout_fingerprint, page_keys, storage_seed

PAGE_SIZES = (16, 64)
BATCHES = (1, 8, 64, 256)


def _load(host: HostKVPool, pages: torch.Tensor, rows: torch.Tensor) -> None:
    """The tier's own load: host ``pages`` into device ``rows``, waited for (on CUDA the copy
    runs on the pool's side stream; :func:`_timed` synchronizes the device after it)."""
    event = host.load(pages, rows)
    if event is not None:
        event.synchronize()


def _load_torch(host: HostKVPool, pages: torch.Tensor, rows: torch.Tensor) -> None:
    """The torch path of the same load (a snapshot, then one indexed write per layer and K/V):
    what ``HostKVPool.load`` does without the compiled copy, timed beside it."""
    event = host.load_from(host.snapshot(pages), rows)
    if event is not None:
        event.synchronize()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """Wall and process-CPU seconds of one call (CPU time: every thread of the process, which
    a busy machine inflates less than wall time)."""
    _sync(device)
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _timed_pair(tier: Callable[[], Any], plain: Callable[[], Any], reps: int,
                device: torch.device, **others: Callable[[], Any]) -> dict[str, float]:
    """Median wall and CPU seconds of ``tier``, ``plain`` and each of ``others``: one warm-up
    each, rounds interleaved."""
    fns = {"tier": tier, "plain": plain, **others}
    for fn in fns.values():
        fn()
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            runs[name].append(_timed(fn, device))
    out = {}
    for name, r in runs.items():
        out[f"{name}_s"] = statistics.median(w for w, _ in r)
        out[f"{name}_cpu_s"] = statistics.median(c for _, c in r)
    return out


def _row(part: str, page_size: int, batch: int, nbytes: int, t: dict[str, float]) -> dict[str, Any]:
    return {"part": part, "page_size": page_size, "batch_pages": batch, "bytes": nbytes, **t,
            "tier_gbps": nbytes / t["tier_s"] / 1e9, "plain_gbps": nbytes / t["plain_s"] / 1e9,
            "ratio": t["plain_s"] / t["tier_s"], "cpu_ratio": t["plain_cpu_s"] / max(t["tier_cpu_s"], 1e-9),
            **({"torch_path_ratio": t["plain_s"] / t["torch_path_s"],
                "torch_path_cpu_ratio": t["plain_cpu_s"] / max(t["torch_path_cpu_s"], 1e-9)}
               if "torch_path_s" in t else {})}


def bench_host_to_device(device: torch.device, layers: int, heads: int, head_dim: int, page_size: int,
                         batches: tuple[int, ...], reps: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of :func:`_row` for the host -> device load at each batch size."""
    most = max(batches)
    pool = MHATokenToKVPool(most * page_size, page_size, torch.float16, heads, head_dim, layers, device,
                            checks=False)
    host = HostKVPool(pool, most)
    typed = host.pages.view(pool.store_dtype).view(most + 1, layers, 2, page_size, heads, head_dim)
    gen = torch.Generator().manual_seed(seed)
    host.pages.copy_(torch.randint(0, 256, host.pages.shape, dtype=torch.uint8, generator=gen))
    plain_src = torch.empty(most * host.page_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    plain_dst = torch.empty(most * host.page_bytes, dtype=torch.uint8, device=device)
    out = []
    for n in batches:
        pages = torch.randperm(most, generator=gen)[:n] + 1
        first = torch.randperm(most, generator=gen)[:n] + 1  # device pages, rows page-aligned
        rows = (first.repeat_interleave(page_size) * page_size
                + torch.arange(page_size).repeat(n)).to(device)
        nbytes = n * host.page_bytes
        t = _timed_pair(partial(_load, host, pages, rows),
                        partial(plain_dst[:nbytes].copy_, plain_src[:nbytes], non_blocking=True), reps, device,
                        torch_path=partial(_load_torch, host, pages, rows))
        for load in (_load_torch, _load):  # both paths' bytes checked
            pool.k_buffer[0].zero_()
            pool.v_buffer[0].zero_()
            load(host, pages, rows)
            got = torch.stack([pool.k_buffer[0][rows].cpu(), pool.v_buffer[0][rows].cpu()], 1)
            want = typed[pages][:, 0].transpose(1, 2).reshape(n * page_size, 2, heads, head_dim)
            if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
                raise RuntimeError(f"host -> device copy wrong at page size {page_size}, batch {n} ({load.__name__})")
        out.append(_row("host_to_device", page_size, n, nbytes, t))
    return out


def bench_storage_to_host(root: Path, page_bytes: int, page_size: int, batches: tuple[int, ...], reps: int,
                          threads: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of :func:`_row` for ``FileStorage.batch_get`` against plain per-page file reads."""
    most = max(batches)
    store = FileStorage(root / f"store-{page_bytes}", page_bytes=page_bytes, threads=threads)
    keys = page_keys(np.arange(most * page_size, dtype=np.int32), page_size,
                     storage_seed(b"", layout_fingerprint(bench="tiers", page_bytes=page_bytes)))
    src = torch.randint(0, 256, (most, page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    if not all(store.batch_set(keys, src)):
        raise RuntimeError(f"could not write the benchmark's pages under {root}")
    plain_paths = [root / f"plain-{page_bytes}" / k[:2] / k[2:4] / k for k in keys]
    for p, row in zip(plain_paths, src):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(row.numpy().tobytes())
    dst = torch.zeros(most, page_bytes, dtype=torch.uint8)
    plain_dst = torch.zeros(most, page_bytes, dtype=torch.uint8)

    def plain_read(n: int) -> None:
        view = plain_dst.numpy()
        for i in range(n):
            with open(plain_paths[i], "rb", buffering=0) as f:
                f.readinto(memoryview(view[i]))

    out = []
    for n in batches:
        t = _timed_pair(partial(store.batch_get, keys[:n], dst[:n]), partial(plain_read, n), reps,
                        torch.device("cpu"))
        if not (torch.equal(dst[:n], src[:n]) and torch.equal(plain_dst[:n], src[:n])):
            raise RuntimeError(f"storage -> host read wrong bytes at page size {page_size}, batch {n}")
        out.append(_row("storage_to_host", page_size, n, n * page_bytes, t))
    if store.stats().corrupt or store.stats().read_errors:
        raise RuntimeError(f"unexpected storage faults: {store.stats()}")
    return out


def run(device: torch.device, layers: int, heads: int, head_dim: int, page_sizes: tuple[int, ...],
        batches: tuple[int, ...], reps: int, work_dir: str | None, storage_threads: int = 4) -> dict[str, Any]:
    """Both parts at every page size: ``{"meta", "rows"}``."""
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="radixkv-bench-tiers-", dir=work_dir) as d:
        for ps in page_sizes:
            rows += bench_host_to_device(device, layers, heads, head_dim, ps, batches, reps)
            page_bytes = 2 * layers * ps * heads * head_dim * 2
            rows += bench_storage_to_host(Path(d), page_bytes, ps, batches, reps, storage_threads)
    meta = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(), "torch": torch.__version__,
            "layout": {"layers": layers, "heads": heads, "head_dim": head_dim, "dtype": "float16"},
            "reps": reps, "storage_threads": storage_threads, "cpus": os.cpu_count(), "loadavg_before": load_before,
            "python": platform.python_version()}
    return {"meta": meta, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [f"{'part':16} {'page':>4} {'batch':>5} {'MiB':>8} {'tier GB/s':>10} {'plain GB/s':>10} "
             f"{'ratio':>6} {'cpu ratio':>9} {'torch path':>10} {'(cpu)':>6}"]
    for r in result["rows"]:
        torch_path = (f" {r['torch_path_ratio']:10.2f} {r['torch_path_cpu_ratio']:6.2f}"
                      if "torch_path_ratio" in r else "")
        lines.append(f"{r['part']:16} {r['page_size']:4d} {r['batch_pages']:5d} {r['bytes'] / 2**20:8.2f} "
                     f"{r['tier_gbps']:10.3f} {r['plain_gbps']:10.3f} {r['ratio']:6.2f} {r['cpu_ratio']:9.2f}"
                     + torch_path)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES))
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared CPU more threads stall each copy)")
    ap.add_argument("--storage-threads", type=int, default=4, help="FileStorage's threads")
    ap.add_argument("--dir", default=None, help="where the storage part writes its files (default: a temp dir)")
    ap.add_argument("--quick", action="store_true", help="1 layer, 3 reps, batches up to 64 (a smoke run)")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.reps, a.batches = 1, 3, [b for b in a.batches if b <= 64]
    torch.set_num_threads(a.threads)
    result = run(torch.device(a.device), a.layers, a.heads, a.head_dim, tuple(a.page_sizes), tuple(a.batches),
                 a.reps, a.dir, a.storage_threads)
    result["meta"]["loadavg_after"] = os.getloadavg()
    args = sys.argv[1:] if argv is None else argv
    result["meta"]["command"] = " ".join(["python", "benchmarks/bench_tiers.py", *args])
    print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
