"""KV allocator benchmark: alloc and free cost per call, radixkv vs SGLang's cat-based free.

For every configuration (pool size x page size x need_sort x batch) the same loop runs over
two allocators side by side in one process:

* ``radixkv``: ``TokenToKVPoolAllocator`` (page size 1) or ``PagedTokenToKVPoolAllocator``,
  once with its safety checks on (the default in use) and once with ``checks=False``
  (``--checks on|off`` keeps one);
* ``sglang_cat``: a faithful re-implementation of SGLang's allocators' ``alloc`` / ``free``
  (``free_pages = torch.cat((free_pages, idx))`` on every free; with need_sort the cat goes
  to ``release_pages``; paged frees ``torch.unique(idx // page_size)`` first).

Loop (after 3 warm-up rounds): ``ids = alloc(batch * page_size)``, then ``free(ids)``; each
call is timed with ``time.perf_counter_ns`` (after ``torch.cuda.synchronize()`` on CUDA).
The pool stays almost all free, the regime where a free that copies the free list costs
O(pool). (With need_sort, SGLang's cat goes to ``release_pages``, which grows by one batch
per round in this loop, so its cost tracks the rounds run, not the pool.) A configuration
runs until ``--budget`` seconds or ``--max-iters`` rounds. The
figures are medians (means also reported) in microseconds per call. ``free_ratio_vs_1M``
is the 12M-slot free median over the 1M-slot one for the same allocator and settings.

A second, smaller loop times ``backup_state()`` and ``restore_state()`` around a draft
``alloc`` (page size 1; with need_sort set up so that every draft alloc merges the pending
releases, the case where restore is O(free) instead of O(draft)).

Prints tables, then one JSON document (``{"meta", "records", "free_ratios",
"backup_restore"}``, one record per configuration); ``--json PATH`` also writes it to a
file. Never asserts on speed.

    python benchmarks/bench_allocator.py [--quick] [--json PATH] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

POOLS = (1 << 20, 12 << 20)  # 1M and 12M slots
BATCHES = (1, 32, 4096)  # pages per call (= slots with page size 1)
PAGE_SIZES = (1, 16)


class SGLangCatAllocator:
    """SGLang's ``TokenToKVPoolAllocator`` (page size 1) / ``PagedTokenToKVPoolAllocator``
    ``alloc`` / ``free`` / ``merge_and_sort_free``, re-implemented faithfully (no debug
    checks, as SGLang runs by default)."""

    def __init__(self, size: int, page_size: int, device, need_sort: bool):
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self.need_sort = need_sort
        self.clear()

    def clear(self):
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.is_not_in_free_group = True
        self.free_group = []

    def merge_and_sort_free(self):
        if len(self.release_pages) > 0:
            self.free_pages = torch.cat((self.free_pages, self.release_pages))
            self.free_pages, _ = torch.sort(self.free_pages)
            self.release_pages = torch.empty((0,), dtype=self.release_pages.dtype, device=self.device)

    def alloc(self, need_size: int):
        num_pages = need_size // self.page_size
        if self.need_sort and num_pages > len(self.free_pages):
            self.merge_and_sort_free()
        if num_pages > len(self.free_pages):
            return None
        out_pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        if self.page_size == 1:
            return out_pages
        offsets = torch.arange(self.page_size, device=self.device)
        return (out_pages[:, None] * self.page_size + offsets).reshape(-1)

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        if self.page_size == 1:
            pages = free_index
        else:
            pages = torch.unique(free_index // self.page_size)
        if self.need_sort:
            self.release_pages = torch.cat((self.release_pages, pages))
        else:
            self.free_pages = torch.cat((self.free_pages, pages))


def make(impl: str, pool: int, page_size: int, need_sort: bool, device, checks: bool):
    if impl == "sglang_cat":
        return SGLangCatAllocator(pool, page_size, device, need_sort)
    if page_size == 1:
        return TokenToKVPoolAllocator(pool, device, need_sort=need_sort, checks=checks)
    return PagedTokenToKVPoolAllocator(pool, page_size, device, need_sort=need_sort, checks=checks)


def time_loop(alloc, n_tokens: int, budget_s: float, max_iters: int, device) -> dict:
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(3):
        alloc.free(alloc.alloc(n_tokens))
    sync()
    a_ns: list[int] = []
    f_ns: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    while len(a_ns) < max_iters and (len(a_ns) < 3 or clock() < deadline):
        t0 = clock()
        ids = alloc.alloc(n_tokens)
        sync()
        t1 = clock()
        alloc.free(ids)
        sync()
        t2 = clock()
        a_ns.append(t1 - t0)
        f_ns.append(t2 - t1)
    return {
        "iters": len(a_ns),
        "alloc_us": statistics.median(a_ns) / 1e3,
        "free_us": statistics.median(f_ns) / 1e3,
        "alloc_us_mean": statistics.fmean(a_ns) / 1e3,
        "free_us_mean": statistics.fmean(f_ns) / 1e3,
    }


def time_backup_restore(pool: int, need_sort: bool, batch: int, budget_s: float,
                        max_iters: int, device) -> dict:
    """``s = backup_state(); alloc(batch); restore_state(s)`` (the speculative-draft
    pattern); backup and restore timed apart. Without need_sort half the pool is in use.
    With need_sort only ``batch // 2`` slots stay in ``free_pages`` and half the pool is
    pending release, so every draft alloc merges (O(pool log pool), inside the alloc) and
    the restore takes its O(free) path."""
    a = TokenToKVPoolAllocator(pool, device, need_sort=need_sort)
    held = a.alloc(pool - batch // 2 if need_sort else pool // 2)
    if held is None:
        raise RuntimeError(f"a fresh pool of {pool} could not give its setup's slots")
    a.free(held[::2])
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    b_ns: list[int] = []
    a_ns = []
    r_ns: list[int] = []
    clock = time.perf_counter_ns
    deadline = clock() + int(budget_s * 1e9)
    while len(b_ns) < max_iters and (len(b_ns) < 3 or clock() < deadline):
        t0 = clock()
        s = a.backup_state()
        t1 = clock()
        a.alloc(batch)
        sync()
        t2 = clock()
        a.restore_state(s)
        sync()
        t3 = clock()
        b_ns.append(t1 - t0)
        a_ns.append(t2 - t1)
        r_ns.append(t3 - t2)
    return {"iters": len(b_ns), "backup_us": statistics.median(b_ns) / 1e3,
            "draft_alloc_us": statistics.median(a_ns) / 1e3,
            "restore_us": statistics.median(r_ns) / 1e3}


def run(args) -> dict:
    records = []
    impls = ["radixkv"] + ([] if args.no_sglang else ["sglang_cat"])
    checks_modes = {"on": [True], "off": [False], "both": [True, False]}[args.checks]
    for pool in args.pools:
        for ps in args.page_sizes:
            for need_sort in (False, True):
                for impl in impls:
                    for checks in (checks_modes if impl == "radixkv" else [None]):
                        alloc = make(impl, pool, ps, need_sort, args.device, bool(checks))
                        for batch in args.batches:
                            alloc.clear()
                            r = time_loop(alloc, batch * ps, args.budget, args.max_iters, args.device)
                            records.append({
                                "impl": impl, "checks": checks, "pool_slots": pool,
                                "page_size": ps, "need_sort": need_sort,
                                "batch_pages": batch, "batch_tokens": batch * ps, **r,
                            })
                        del alloc
    by_key = {(r["impl"], r["checks"], r["page_size"], r["need_sort"], r["batch_pages"],
               r["pool_slots"]): r for r in records}
    ratios = []
    small, large = min(args.pools), max(args.pools)
    if small != large:
        for r in records:
            if r["pool_slots"] != large:
                continue
            base = by_key.get((r["impl"], r["checks"], r["page_size"], r["need_sort"],
                               r["batch_pages"], small))
            if base:
                ratio = r["free_us"] / base["free_us"]
                r["free_ratio_vs_1M"] = round(ratio, 3)
                ratios.append({
                    "impl": r["impl"], "checks": r["checks"], "page_size": r["page_size"],
                    "need_sort": r["need_sort"], "batch_pages": r["batch_pages"],
                    "free_us_small_pool": base["free_us"], "free_us_large_pool": r["free_us"],
                    "ratio": round(ratio, 3), "within_1_5x": ratio <= 1.5,
                })
    backups = []
    if not args.no_backup:
        for pool in args.pools:
            for need_sort in (False, True):
                for batch in (32, 4096):
                    r = time_backup_restore(pool, need_sort, batch, args.budget, args.max_iters,
                                            args.device)
                    backups.append({"impl": "radixkv", "pool_slots": pool, "page_size": 1,
                                    "need_sort": need_sort, "draft_slots": batch, **r})
    meta = {
        "device": str(args.device), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "python": platform.python_version(), "machine": platform.machine(),
        "budget_s": args.budget, "max_iters": args.max_iters, "pools": args.pools,
        "stat": "median microseconds per call",
    }
    return {"meta": meta, "records": records, "free_ratios": ratios, "backup_restore": backups}


def table(doc: dict) -> str:
    head = f"{'impl':<11}{'chk':>4}{'pool':>6}{'ps':>4}{'sort':>6}{'batch':>7}" \
           f"{'iters':>7}{'alloc us':>11}{'free us':>11}{'free 12M/1M':>13}"
    lines = [head, "-" * len(head)]
    for r in doc["records"]:
        chk = "-" if r["checks"] is None else ("on" if r["checks"] else "off")
        ratio = r.get("free_ratio_vs_1M")
        lines.append(
            f"{r['impl']:<11}{chk:>4}{r['pool_slots'] >> 20:>5}M{r['page_size']:>4}"
            f"{str(r['need_sort']):>6}{r['batch_pages']:>7}{r['iters']:>7}"
            f"{r['alloc_us']:>11.1f}{r['free_us']:>11.1f}"
            f"{'' if ratio is None else f'{ratio:.2f}x':>13}"
        )
    if doc.get("backup_restore"):
        lines += ["", f"{'backup/restore':<15}{'pool':>6}{'sort':>6}{'draft':>7}{'iters':>7}"
                      f"{'backup us':>11}{'draft alloc us':>16}{'restore us':>12}"]
        for r in doc["backup_restore"]:
            lines.append(
                f"{'radixkv':<15}{r['pool_slots'] >> 20:>5}M{str(r['need_sort']):>6}"
                f"{r['draft_slots']:>7}{r['iters']:>7}{r['backup_us']:>11.1f}"
                f"{r['draft_alloc_us']:>16.1f}{r['restore_us']:>12.1f}"
            )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short budget per configuration")
    p.add_argument("--json", metavar="PATH", help="also write the JSON document here")
    p.add_argument("--device", default="cpu")
    p.add_argument("--budget", type=float, default=None, help="seconds per configuration")
    p.add_argument("--max-iters", type=int, default=None)
    p.add_argument("--pools", type=int, nargs="+", default=list(POOLS))
    p.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES))
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--checks", choices=["on", "off", "both"], default="both")
    p.add_argument("--no-sglang", action="store_true", help="skip the cat-based baseline")
    p.add_argument("--no-backup", action="store_true", help="skip the backup/restore timing")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args(argv)
    if args.budget is None:
        args.budget = 0.05 if args.quick else 0.3
    if args.max_iters is None:
        args.max_iters = 200 if args.quick else 2000
    torch.set_num_threads(args.threads)
    doc = run(args)
    print(table(doc))
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return doc


if __name__ == "__main__":
    main()
