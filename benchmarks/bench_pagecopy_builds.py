"""Two builds of ``radixkv.memory._native`` side by side: ``HostKVPool.load`` through each, and a
plain ``copy_`` of the same bytes, rounds interleaved in one process (docs/tiers.md, "The
compiled page copy"). For a change to ``radixkv/memory/csrc/pagecopy.c``: build the old source
next to the new one, then time both::

    git show REV:radixkv/memory/csrc/pagecopy.c > build/pagecopy_old.c
    cc -O3 -shared -fPIC $(python3-config --includes) build/pagecopy_old.c -o build/pagecopy_old.so
    python benchmarks/bench_pagecopy_builds.py build/pagecopy_old.so radixkv/memory/_native*.so

Layout as ``bench_tiers.py`` (4 layers x 8 heads x 128 dims, fp16), CPU, 1 torch thread; the
median of ``--reps`` rounds after a warm-up; the bytes each build wrote are checked.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from radixkv.memory import native
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.kv_pool import MHATokenToKVPool


def _copy_pages(path: str) -> Callable[..., Any]:
    spec = importlib.util.spec_from_file_location("_native", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn: Callable[..., Any] = mod.copy_pages
    return fn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("builds", nargs=2, help="two built _native shared objects (A, then B)")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    builds = {f"{tag} ({path})": _copy_pages(path) for tag, path in zip("AB", a.builds)}
    layers, heads, dim = 4, 8, 128
    for ps in (16, 64):
        for n in (64, 256):
            pool = MHATokenToKVPool(n * ps, ps, torch.float16, heads, dim, layers, "cpu", checks=False)
            host = HostKVPool(pool, n)
            g = torch.Generator().manual_seed(0)
            host.pages.copy_(torch.randint(0, 256, host.pages.shape, dtype=torch.uint8, generator=g))
            pages, first = torch.randperm(n, generator=g) + 1, torch.randperm(n, generator=g)
            rows = first.repeat_interleave(ps) * ps + torch.arange(ps).repeat(n)
            nbytes = n * host.page_bytes
            src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)

            def run(name: str, host: HostKVPool = host, pages: torch.Tensor = pages, rows: torch.Tensor = rows,
                    src: torch.Tensor = src, dst: torch.Tensor = dst) -> None:
                if name == "plain":
                    dst.copy_(src)
                    return
                native.copy_pages = builds[name]
                host.load(pages, rows)

            times: dict[str, list[float]] = {"plain": [], **{k: [] for k in builds}}
            for name in times:
                run(name)
            for _ in range(a.reps):
                for name in times:
                    t0 = time.perf_counter()
                    run(name)
                    times[name].append(time.perf_counter() - t0)
            want = host.pages.view(torch.float16).view(n + 1, layers, 2, ps, heads, dim)[pages][:, 1, 0]
            for name in builds:
                pool.k_buffer[1].zero_()
                run(name)
                got = pool.k_buffer[1][rows].view(torch.uint8)  # bytes: random fp16 holds NaNs
                if not torch.equal(got, want.reshape(n * ps, heads, dim).contiguous().view(torch.uint8)):
                    raise RuntimeError(f"{name} wrote wrong bytes at page size {ps}, batch {n}")
            med = {k: statistics.median(v) for k, v in times.items()}
            ratios = "  ".join(f"{k}: {med['plain'] / med[k]:.2f}" for k in builds)
            gbps = nbytes / med["plain"] / 1e9
            print(f"page {ps:2d} tokens x {n:3d}: ratio to plain  {ratios}  (plain {gbps:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
