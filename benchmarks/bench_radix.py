"""RadixCache benchmark: per-op latency, hit rate and host memory per cached token.

Workload (seeded): requests of 1,026-8,191 prompt tokens plus 64-512 output tokens, built
from 12 shared system prompts (512-1,536 tokens), 64 interleaved multi-turn conversations
(each turn = the previous prompt + its output + 64-768 new tokens; a conversation that
would pass 8,191 prompt tokens starts over) and 25% one-shot documents, over a 2M-token
pool. Each request runs the scheduler's cycle:

    match_prefix -> inc_lock_ref -> evict (if the pool is short) -> alloc -> insert
    -> free duplicate rows -> dec_lock_ref

Keys reach each cache in the container it prefers (RadixKey for radixkv, Python lists for
the reference), built before timing starts. Only the five cache calls are timed:
``time.perf_counter_ns`` (wall; mean/p50/p99) and the thread's CPU time (``cpu_mean_us``,
which a busy, shared machine does not inflate by descheduling the process; it includes
~0.4 us of clock overhead). ``evict_tree_only`` is evict minus the time spent inside the
allocator's ``free`` (one call per evict). The same run also drives a "naive" reference:
an SGLang-style tree written from scratch (list keys, per-token compare loop, int64 tensor
values with per-node torch ops, heap rebuilt on every evict); it is not SGLang itself.

Memory: a separate pass inserts the requests' sequences into an empty cache (no
eviction) under ``tracemalloc`` until it holds ``--pool`` tokens, and divides the traced
growth (numpy and bytes included) plus the torch storage it holds by the cached tokens.

Prints a table, then one JSON document (``--json`` for JSON only). Never asserts on speed.

    python benchmarks/bench_radix.py [--requests 2000] [--page-sizes 1 16] [--no-naive]
"""
from __future__ import annotations

import argparse
import gc
import heapq
import json
import os
import platform
import sys
import time
import tracemalloc

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_timer import op_timer  # noqa: E402

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from radixkv.cache import RadixCache, RadixKey  # noqa: E402

OPS = ("match_prefix", "insert", "lock", "unlock", "evict")


# ----------------------------------------------------------------------------- workload
def make_workload(n_requests: int, seed: int = 0, vocab: int = 32000):
    """List of (prompt int32 array, full = prompt + output int32 array)."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, vocab, int(n), dtype=np.int32)  # noqa: E731
    systems = [rand(rng.integers(512, 1537)) for _ in range(12)]
    convs: list[np.ndarray | None] = [None] * 64
    out = []
    for _ in range(n_requests):
        if rng.random() < 0.25:
            sp = systems[rng.integers(12)]
            prompt = np.concatenate([sp, rand(rng.integers(max(1026, sp.size + 64), 8192) - sp.size)])
            conv = None
        else:
            conv = int(rng.integers(64))
            hist, new = convs[conv], int(rng.integers(64, 769))
            if hist is None or hist.size + new > 8191:
                sp = systems[rng.integers(12)]
                lo = max(1026, sp.size + 64)
                prompt = np.concatenate([sp, rand(rng.integers(lo, lo + 1024) - sp.size)])
            else:
                prompt = np.concatenate([hist, rand(new)])
        full = np.concatenate([prompt, rand(rng.integers(64, 513))])
        if conv is not None:
            convs[conv] = full
        out.append((prompt, full))
    return out


# ----------------------------------------------------------------------------- naive reference
class _NNode:
    def __init__(self):
        self.children = {}
        self.parent = None
        self.key = []
        self.value: torch.Tensor | None = None  # set by whoever makes the node
        self.lock_ref = 0
        self.last_access_time = time.monotonic()

    def __lt__(self, other):
        return self.last_access_time < other.last_access_time


class NaiveRadixCache:
    """SGLang-style radix tree from scratch: list keys, per-token matching, int64 tensors."""

    def __init__(self, allocator, page_size=1):
        self.alloc, self.page_size = allocator, page_size
        self.root = _NNode()
        self.root.value = torch.empty(0, dtype=torch.int64)
        self.root.lock_ref = 1
        self.evictable, self.protected, self.leaves = 0, 0, set()

    def _ck(self, key):
        return key[0] if self.page_size == 1 else tuple(key[:self.page_size])

    def _match_len(self, a, b):
        if self.page_size == 1:
            i = 0
            for x, y in zip(a, b):
                if x != y:
                    break
                i += 1
            return i
        i, n, p = 0, min(len(a), len(b)), self.page_size
        while i < n and a[i:i + p] == b[i:i + p]:
            i += p
        return i

    def _split(self, child, k):
        new = _NNode()
        new.children = {self._ck(child.key[k:]): child}
        new.parent, new.lock_ref = child.parent, child.lock_ref
        new.key, new.value = child.key[:k], child.value[:k].clone()
        new.parent.children[self._ck(child.key)] = new
        child.parent, child.key, child.value = new, child.key[k:], child.value[k:].clone()
        return new

    def match_prefix(self, key):
        key = key[:len(key) // self.page_size * self.page_size]
        node, vals, now = self.root, [], time.monotonic()
        while key and self._ck(key) in node.children:
            child = node.children[self._ck(key)]
            child.last_access_time = now
            k = self._match_len(child.key, key)
            if k < len(child.key):
                node = self._split(child, k)
                vals.append(node.value)
                break
            vals.append(child.value)
            node, key = child, key[k:]
        idx = torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)
        return idx, node

    def insert(self, key, value):
        node, total, now = self.root, 0, time.monotonic()
        while key and self._ck(key) in node.children:
            node = node.children[self._ck(key)]
            node.last_access_time = now
            k = self._match_len(node.key, key)
            total += k
            key, value = key[k:], value[k:]
            if k < len(node.key):
                node = self._split(node, k)
        if key:
            new = _NNode()
            new.parent, new.key, new.value = node, key, value.clone()
            node.children[self._ck(key)] = new
            self.evictable += len(key)
            self.leaves.discard(node)
            self.leaves.add(new)
        return total

    def inc_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable -= len(node.key)
                self.protected += len(node.key)
                self.leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node):
        while node is not self.root:
            if node.lock_ref == 1:
                self.evictable += len(node.key)
                self.protected -= len(node.key)
                if not node.children:
                    self.leaves.add(node)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, n):
        heap = list(self.leaves)
        heapq.heapify(heap)
        done, freed = 0, []
        while done < n and heap:
            x = heapq.heappop(heap)
            freed.append(x.value)
            done += len(x.key)
            del x.parent.children[self._ck(x.key)]
            self.leaves.discard(x)
            self.evictable -= len(x.key)
            p = x.parent
            if p is not self.root and not p.children and p.lock_ref == 0:
                self.leaves.add(p)
                heapq.heappush(heap, p)
        if freed:
            self.alloc.free(torch.cat(freed))
        return done

    def total_size(self):
        return self.evictable + self.protected


# ----------------------------------------------------------------------------- driver
def _allocator(pool: int, page_size: int):
    if page_size == 1:
        return TokenToKVPoolAllocator(pool, device="cpu")
    return PagedTokenToKVPoolAllocator(pool, page_size, device="cpu")


def _stats(ns, cpu_ns=None):
    if not ns:
        return {"n": 0, "mean_us": None, "p50_us": None, "p99_us": None}
    a = np.asarray(ns, dtype=np.float64) / 1e3
    out = {"n": int(a.size), "mean_us": round(float(a.mean()), 3),
           "p50_us": round(float(np.percentile(a, 50)), 3),
           "p99_us": round(float(np.percentile(a, 99)), 3)}
    if cpu_ns is not None:
        out["cpu_mean_us"] = round(float(np.mean(cpu_ns)) / 1e3, 3)
    return out


class FreeTimer:
    """Wraps an allocator and accumulates the wall time of its ``free`` (and SGLang's
    ``free_segment``) calls, so the evict figure can be split into tree work and the
    allocator's own work."""

    def __init__(self, alloc):
        self._alloc, self.ns = alloc, 0

    def __getattr__(self, name):
        return getattr(self._alloc, name)

    def free(self, idx):
        t0 = time.perf_counter_ns()
        self._alloc.free(idx)
        self.ns += time.perf_counter_ns() - t0

    def free_segment(self, idx, *, start_pos):
        t0 = time.perf_counter_ns()
        self._alloc.free_segment(idx, start_pos=start_pos)
        self.ns += time.perf_counter_ns() - t0


def cycle(keys, page_size, alloc, timer, match, split, lock, unlock, evict, insert, indices=None, ops=OPS,
          timing=op_timer):
    """Drive every request through match -> lock -> evict-if-short -> alloc -> insert ->
    free duplicates -> unlock, timing the cache's calls (``timing``, by default ``op_timer``:
    wall and thread CPU; ``count_radix.py`` passes one that only routes a call).

    ``match(key)``'s result goes through ``split`` (untimed) to ``(prefix_len, node, rows)``;
    when ``rows`` is None, ``indices(node, prefix_len)`` fetches them, timed as
    ``prefix_indices``. Returns the per-op nanoseconds, the allocator time inside each evict,
    every request's hit, the hit rate and the evicted tokens."""
    wall, cpu, timed = timing(ops)
    hit = queried = evicted = 0
    hits, free_in_evict = [], []
    gc.collect()
    gc.freeze()  # the prebuilt keys are not the cache's: keep them out of GC passes
    for pkey, fkey, plen, flen in keys:
        pre, node, idx = split(timed("match_prefix", match, pkey))
        timed("lock", lock, node)
        if idx is None:
            idx = timed("prefix_indices", indices, node, pre)
        hits.append(pre)
        hit, queried = hit + pre, queried + plen
        need = flen - pre
        want = -(-need // page_size) * page_size
        avail = alloc.available_size()
        if avail < want:
            before = timer.ns
            evicted += timed("evict", evict, want - avail)
            free_in_evict.append(timer.ns - before)
        rows = alloc.alloc(want)
        value = torch.cat([idx, rows[:need]])
        aligned = flen - flen % page_size
        done = timed("insert", insert, fkey, value[:aligned])
        spare = torch.cat([value[pre:done], rows[aligned - pre:]])
        if spare.numel():
            alloc.free(spare)
        timed("unlock", unlock, node)
    gc.unfreeze()
    return {"wall": wall, "cpu": cpu, "free_in_evict": free_in_evict, "hits": hits,
            "hit_rate": hit / queried, "evicted_tokens": int(evicted)}


def _split_radixkv(m):
    return m.prefix_len, m.last_node, m.device_indices


def _split_naive(r):
    return r[0].numel(), r[1], r[0]


def run_cycle(cache, alloc, keys, page_size, naive: bool, timer: FreeTimer):
    """:func:`cycle` over radixkv's RadixCache or the naive reference; per-op stats."""
    raw = cycle(keys, page_size, alloc, timer, cache.match_prefix, _split_naive if naive else _split_radixkv,
                cache.inc_lock_ref, cache.dec_lock_ref, cache.evict, cache.insert)
    wall, cpu = raw["wall"], raw["cpu"]
    ops = {op: _stats(wall[op], cpu[op]) for op in OPS}
    ops["evict_tree_only"] = _stats([w - f for w, f in zip(wall["evict"], raw["free_in_evict"])])
    return {"ops": ops, "hit_rate": round(raw["hit_rate"], 4), "evicted_tokens": raw["evicted_tokens"],
            "cached_tokens_end": int(cache.total_size())}


def build_keys(work, page_size, naive):
    keys = []
    for prompt, full in work:
        aligned = full.size - full.size % page_size
        if naive:
            keys.append((prompt.tolist(), full[:aligned].tolist(), prompt.size, full.size))
        else:
            keys.append((RadixKey(prompt), RadixKey(full[:aligned]), prompt.size, full.size))
    return keys


def measure_memory(work, page_size, pool, naive):
    """Traced bytes (+ torch storage) per cached token of a tree grown to ~``pool`` tokens."""
    seqs, vals, start = [], [], 1
    for _, full in work:
        aligned = full.size - full.size % page_size
        seqs.append(full[:aligned].tolist() if naive else RadixKey(full[:aligned]))
        vals.append(torch.arange(start, start + aligned, dtype=torch.int64))
        start += aligned
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = NaiveRadixCache(None, page_size) if naive else RadixCache(None, None, page_size=page_size)
    for k, v in zip(seqs, vals):
        if cache.total_size() >= pool:
            break
        cache.insert(k, v)
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    storage = 0
    if isinstance(cache, NaiveRadixCache):  # its per-node value tensors (every node has one)
        seen: set[int] = set()
        stack = [cache.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.value is None:  # never: the root, inserts and splits all set one
                continue
            st = node.value.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                storage += st.nbytes()
    tokens = cache.total_size()
    return {"cached_tokens": int(tokens), "traced_bytes": int(traced), "tensor_bytes": int(storage),
            "bytes_per_token": round((traced + storage) / tokens, 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--pool", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive reference")
    ap.add_argument("--json", action="store_true", help="print only the JSON document")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: the allocator's small frees otherwise "
                         "stall on thread hand-offs when cores are shared)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    work = make_workload(args.requests, args.seed)
    plens = np.array([p.size for p, _ in work])
    result = {"benchmark": "radix_cache", "seed": args.seed, "requests": args.requests,
              "pool_tokens": args.pool, "prompt_tokens_mean": round(float(plens.mean()), 1),
              "prompt_tokens_min": int(plens.min()), "prompt_tokens_max": int(plens.max()),
              "python": platform.python_version(), "torch": torch.__version__,
              "machine": platform.machine(), "torch_threads": args.threads, "runs": {}}
    impls = ["radixkv"] + ([] if args.no_naive else ["naive"])
    for ps in args.page_sizes:
        for impl in impls:
            naive = impl == "naive"
            alloc = _allocator(args.pool, ps)
            timer = FreeTimer(alloc)
            cache = NaiveRadixCache(timer, ps) if naive else RadixCache(None, timer, page_size=ps)
            keys = build_keys(work, ps, naive)
            run = run_cycle(cache, alloc, keys, ps, naive, timer)
            del keys, cache
            run["memory"] = measure_memory(work, ps, args.pool, naive)
            result["runs"][f"{impl}/page{ps}"] = run
    if not args.json:
        print(f"{'run':<16}{'op':<16}{'n':>6}{'mean us':>10}{'p50 us':>10}{'p99 us':>10}"
              f"{'cpu mean':>10}")
        for name, run in result["runs"].items():
            for op, s in run["ops"].items():
                if s["n"]:
                    cpu = f"{s['cpu_mean_us']:>10.2f}" if "cpu_mean_us" in s else ""
                    print(f"{name:<16}{op:<16}{s['n']:>6}{s['mean_us']:>10.2f}{s['p50_us']:>10.2f}"
                          f"{s['p99_us']:>10.2f}{cpu}")
            mem = run["memory"]
            print(f"{name:<16}hit rate {run['hit_rate']:.4f}, evicted {run['evicted_tokens']} tokens, "
                  f"memory {mem['bytes_per_token']} B/token over {mem['cached_tokens']} tokens")
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
