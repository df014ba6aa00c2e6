"""radixkv's RadixCache / MambaRadixCache next to SGLang's own, side by side in one run.

Part ``radix`` (default; SGLang 0.5.23). The workload is ``bench_radix.py``'s (its
``make_workload``, imported: 1,026-8,191-token prompts from shared system prompts, multi-turn
conversations and one-shot documents, over a 2M-token pool). Each request runs the
scheduler's cycle on BOTH caches:

    match_prefix -> inc_lock_ref -> evict (if the pool is short) -> alloc -> insert
    -> free duplicate rows -> dec_lock_ref

each cache with its own allocator (radixkv's ``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator``; SGLang's of the same names, on CPU, ``need_sort=False`` as
a non-disaggregated server builds them) and keys in the container it expects, built before
timing (radixkv: ``RadixKey`` over int32; SGLang 0.5.23: its ``RadixKey`` over
``array('q')``, what its scheduler passes). Runs alternate per repetition (rep 0: radixkv
first, rep 1: SGLang first, ...), same seed, fresh caches each time.

SGLang calls go through its parameter objects (``MatchPrefixParams`` / ``InsertParams`` /
``EvictParams``, built inside the timed call, as its scheduler does). SGLang 0.5.23's
``match_prefix`` returns only the prefix length and node; the scheduler reads the prefix's
KV rows later with ``path_device_indices`` (a path walk and one ``torch.cat``), which is
timed separately (``prefix_indices``). radixkv's ``match_prefix`` returns the rows itself,
so the comparable figure is ``match_prefix+indices`` (both: match plus the rows).
``evict`` includes the allocator's frees (SGLang: one per evicted leaf; radixkv: one per
call); ``evict_tree_only`` is evict minus the wall time spent in the allocator's
``free``/``free_segment`` (a thin wrapper counts it, for both caches).

Hit rate = matched prompt tokens / prompt tokens, counted by this driver for both caches.

Memory: a separate pass inserts the requests' sequences into an empty cache (no allocator,
no eviction) under ``tracemalloc`` until it holds ``--pool`` tokens; each key is built just
before its insert, inside the traced region, and dropped after, so what stays traced is
what the tree keeps. Bytes per cached token = (traced growth + the torch storage the tree's
nodes hold) / cached tokens.

Part ``mamba`` (SGLang 0.5.9: 0.5.23 has no MambaRadixCache, its hybrid caches moved into
UnifiedRadixCache). ``bench_mamba.py --part latency``'s workload and state shape (same
requests, page size 1, 2M-token pool, 4 KDA layers of 2 heads x 16 x 16 fp32 state, conv
kernel 4, 12,800 bytes a slot, ``--slots`` 512), both caches alternating per repetition;
``match_prefix+state`` is per request the match INCLUDING the state copy (for SGLang,
``match_prefix(cow_mamba=True)`` does the copy itself; see ``_mamba_cycle``).

Importing SGLang on a CPU machine: ``pip install --no-deps --target DIR sglang==0.5.23``
plus the small packages its import path needs (``orjson psutil pybase64 requests urllib3
idna certifi charset-normalizer starlette anyio sniffio``; for 0.5.9 also ``tqdm
safetensors``), then ``--sglang-path DIR`` (appended to ``sys.path``, so this environment's
packages win). Modules on the import path that the timed code never runs are shimmed
(fake modules put in ``sys.modules`` before the import; ``PROFILES`` lists them, the JSON
reports them under ``sglang.shimmed_modules`` with every name read from them):

* ``sglang`` (the top package): its ``__init__`` (frontend language API, Hugging Face
  patches) is not run; the package is a bare namespace over ``DIR/sglang``.
* radix: ``sglang.srt.mem_cache.memory_pool`` (``base_prefix_cache`` imports
  ``ReqToTokenPool`` from it for a type annotation only; the real module pulls the
  model-config and quantization layers: transformers, torchvision, ...) and
  ``sglang.srt.observability.metrics_collector`` (only used with ``enable_metrics=True``).
* mamba: the real ``memory_pool`` (``MambaPool`` runs), with ``sglang.srt.configs``'s
  ``__init__`` skipped (every model config, transformers) and placeholders for the NSA /
  quantization / attention layers, the OpenAI protocol, the HF helpers and ``sglang.utils``
  that ``memory_pool`` / ``server_args`` import, and the host (HiCache) pool.
  ``get_global_server_args()`` (read in ``match_prefix``) returns a ``ServerArgs`` made
  without ``__post_init__`` holding ``page_size=1``; its real ``mamba_cache_chunk_size``
  property runs on it.

Every name read from a shim is a placeholder that raises when called, so nothing timed can
run shimmed code. Without SGLang (not importable, no ``--sglang-path``) the script prints
how to install it and a JSON document saying ``skipped``, and exits 0.

Prints a table, then one JSON document (``--json``: JSON only). Never asserts on speed.

    python benchmarks/bench_vs_sglang.py [--sglang-path DIR] [--requests 2000] [--reps 4]
                                         [--page-sizes 1 16]
    python benchmarks/bench_vs_sglang.py --part mamba --sglang-path DIR059 [--slots 512]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tracemalloc
from array import array
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_radix import FreeTimer, _stats, cycle, make_workload  # noqa: E402
from sglang_loader import (  # noqa: E402
    INSTALL_HINT,
    INSTALL_HINT_MAMBA,
    SGLang,
    forget_sglang,
    load_sglang,
    sglang_modules,
)
from vs_sglang_mamba import compare_mamba, print_mamba_table  # noqa: E402

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from radixkv.cache import RadixCache, RadixKey  # noqa: E402

OPS = ("match_prefix", "prefix_indices", "lock", "evict", "insert", "unlock")


# ----------------------------------------------------------------------------- the two drivers
class Driver(NamedTuple):
    """One cache behind the cycle of ``bench_radix.cycle`` (built by ``radixkv_driver`` /
    ``sglang_driver``): ``split(match(key)) -> (prefix_len, node, rows or None)``, and
    ``indices(node, n)`` -> the prefix's KV rows when ``match`` does not return them."""

    name: str
    cache: Any
    alloc: Any
    timer: FreeTimer
    match: Callable
    split: Callable
    indices: Callable | None
    lock: Callable
    unlock: Callable
    evict: Callable
    insert: Callable


def radixkv_driver(pool: int, page_size: int) -> Driver:
    alloc = (TokenToKVPoolAllocator(pool, device="cpu") if page_size == 1
             else PagedTokenToKVPoolAllocator(pool, page_size, device="cpu"))
    timer = FreeTimer(alloc)
    cache = RadixCache(None, timer, page_size=page_size)
    return Driver("radixkv", cache, alloc, timer, cache.match_prefix,
                  lambda m: (m.prefix_len, m.last_node, m.device_indices), None,
                  cache.inc_lock_ref, cache.dec_lock_ref, cache.evict, cache.insert)


def sglang_driver(sg: SGLang | None, pool: int, page_size: int) -> Driver:
    m = sglang_modules(sg)
    if page_size == 1:
        alloc = m.alloc.TokenToKVPoolAllocator(pool, torch.float16, "cpu", None, False)
    else:
        alloc = m.alloc.PagedTokenToKVPoolAllocator(pool, page_size, torch.float16, "cpu", None, False)
    timer = FreeTimer(alloc)
    cache = m.radix_cache.RadixCache(m.params.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=timer, page_size=page_size))
    mp, ip, ep = m.base.MatchPrefixParams, m.base.InsertParams, m.base.EvictParams

    def indices(node, n):
        return cache.path_device_indices(node)[:n]

    return Driver("sglang", cache, alloc, timer, lambda key: cache.match_prefix(mp(key=key)),
                  lambda r: (r.device_prefix_len, r.last_device_node, None), indices,
                  cache.inc_lock_ref, cache.dec_lock_ref,
                  lambda n: cache.evict(ep(num_tokens=n)).num_tokens_evicted,
                  lambda k, v: cache.insert(ip(key=k, value=v)).prefix_len)


def build_keys(work, page_size: int, impl: str, sg: SGLang | None = None) -> list:
    """(prompt key, page-aligned full key, prompt tokens, full tokens) per request."""
    keys = []
    for prompt, full in work:
        aligned = full.size - full.size % page_size
        if impl == "radixkv":
            keys.append((RadixKey(prompt), RadixKey(full[:aligned]), prompt.size, full.size))
        else:
            rk = sglang_modules(sg).radix_cache.RadixKey
            keys.append((rk(array("q", prompt.astype(np.int64).tobytes())),
                         rk(array("q", full[:aligned].astype(np.int64).tobytes())),
                         prompt.size, full.size))
    return keys


def run_cycle(drv: Driver, keys, page_size: int) -> dict:
    """Every request through ``bench_radix.cycle``; per-op wall and thread-CPU times, every
    request's hit, the hit rate and eviction counters."""
    return cycle(keys, page_size, drv.alloc, drv.timer, drv.match, drv.split, drv.lock, drv.unlock,
                 drv.evict, drv.insert, indices=drv.indices, ops=OPS)


def summarize(reps: list[dict]) -> dict:
    """Per-op stats pooled over the repetitions (and each repetition's mean, for spread)."""
    ops = {}
    for op in OPS:
        w = [x for r in reps for x in r["wall"][op]]
        if w:
            ops[op] = _stats(w, [x for r in reps for x in r["cpu"][op]])
            ops[op]["rep_means_us"] = [round(float(np.mean(r["wall"][op])) / 1e3, 3) for r in reps]
    both = [np.add(r["wall"]["match_prefix"], r["wall"]["prefix_indices"]) if r["wall"]["prefix_indices"]
            else np.asarray(r["wall"]["match_prefix"]) for r in reps]
    both_cpu = [np.add(r["cpu"]["match_prefix"], r["cpu"]["prefix_indices"]) if r["cpu"]["prefix_indices"]
                else np.asarray(r["cpu"]["match_prefix"]) for r in reps]
    ops["match_prefix+indices"] = _stats(np.concatenate(both).tolist(), np.concatenate(both_cpu).tolist())
    tree_only = [w - f for r in reps for w, f in zip(r["wall"]["evict"], r["free_in_evict"])]
    ops["evict_tree_only"] = _stats(tree_only)
    rates = [r["hit_rate"] for r in reps]
    return {"ops": ops, "hit_rate": round(rates[0], 6), "hit_rate_by_rep": [round(x, 6) for x in rates],
            "evicted_tokens_by_rep": [r["evicted_tokens"] for r in reps]}


# ----------------------------------------------------------------------------- memory
def _tensor_bytes(nodes) -> int:
    seen, total = set(), 0
    for node in nodes:
        value = getattr(node, "value", None)
        if isinstance(value, torch.Tensor):
            st = value.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _sglang_nodes(cache):
    stack, out = [cache.root_node], []
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def measure_memory(work, page_size: int, pool: int, impl: str, sg: SGLang | None = None) -> dict:
    """Traced bytes + tensor storage per cached token of a tree grown to ~``pool`` tokens."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache: Any  # ours or SGLang's: the same calls, no common type
    if impl == "radixkv":
        cache = RadixCache(None, None, page_size=page_size)
    else:
        sgm = sglang_modules(sg)
        cache = sgm.radix_cache.RadixCache.create_simulated(page_size=page_size)
    start = 1
    for _, full in work:
        if cache.total_size() >= pool:
            break
        aligned = full.size - full.size % page_size
        rows = torch.arange(start, start + aligned, dtype=torch.int64)
        start += aligned
        if impl == "radixkv":
            cache.insert(RadixKey(full[:aligned]), rows)
        else:
            key = sgm.radix_cache.RadixKey(array("q", full[:aligned].astype(np.int64).tobytes()))
            cache.insert(sgm.base.InsertParams(key=key, value=rows))
            del key
        del rows
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    storage = _tensor_bytes(cache.iter_nodes() if impl == "radixkv" else _sglang_nodes(cache))
    tokens = cache.total_size()
    return {"cached_tokens": int(tokens), "traced_bytes": int(traced), "tensor_bytes": int(storage),
            "bytes_per_token": round((traced + storage) / tokens, 3)}


# ----------------------------------------------------------------------------- main
def compare(work, page_sizes, reps: int, pool: int, sg: SGLang | None, memory: bool = True) -> dict:
    """Both caches on ``work`` at each page size, alternating per repetition."""
    impls = ["radixkv"] + (["sglang"] if sg is not None else [])
    out = {}
    for ps in page_sizes:
        keys = {impl: build_keys(work, ps, impl, sg) for impl in impls}
        runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
        for rep in range(reps):
            for impl in (impls if rep % 2 == 0 else impls[::-1]):
                drv = radixkv_driver(pool, ps) if impl == "radixkv" else sglang_driver(sg, pool, ps)
                runs[impl].append(run_cycle(drv, keys[impl], ps))
                del drv
        del keys
        doc: dict[str, Any] = {impl: summarize(runs[impl]) for impl in impls}
        if memory:
            for impl in impls:
                doc[impl]["memory"] = measure_memory(work, ps, pool, impl, sg)
        if sg is not None:
            a, b = runs["radixkv"][0]["hits"], runs["sglang"][0]["hits"]
            doc["requests_with_different_hit"] = int(sum(x != y for x, y in zip(a, b)))
            doc["sglang_over_radixkv_mean"] = {
                op: round(doc["sglang"]["ops"][op]["mean_us"] / doc["radixkv"]["ops"][op]["mean_us"], 2)
                for op in ("match_prefix+indices", "insert", "lock", "unlock", "evict")
                if doc["radixkv"]["ops"].get(op, {}).get("n") and doc["sglang"]["ops"].get(op, {}).get("n")}
        out[f"page{ps}"] = doc
    return out


def print_table(runs: dict) -> None:
    print(f"{'page':<8}{'impl':<9}{'op':<22}{'n':>6}{'mean us':>10}{'p50 us':>10}{'p99 us':>10}{'cpu mean':>10}")
    for page, doc in runs.items():
        for impl in ("radixkv", "sglang"):
            if impl not in doc:
                continue
            for op, s in doc[impl]["ops"].items():
                if s["n"]:
                    c = f"{s['cpu_mean_us']:>10.2f}" if "cpu_mean_us" in s else ""
                    print(f"{page:<8}{impl:<9}{op:<22}{s['n']:>6}{s['mean_us']:>10.2f}{s['p50_us']:>10.2f}"
                          f"{s['p99_us']:>10.2f}{c}")
            mem = doc[impl].get("memory")
            mem_s = f", memory {mem['bytes_per_token']} B/token over {mem['cached_tokens']} tokens" if mem else ""
            print(f"{page:<8}{impl:<9}hit rate {doc[impl]['hit_rate']:.4f}{mem_s}")
        if "sglang_over_radixkv_mean" in doc:
            print(f"{page:<8}sglang/radixkv mean: {doc['sglang_over_radixkv_mean']}; requests whose "
                  f"hit differs: {doc['requests_with_different_hit']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sglang-path", default=None, help="a 'pip install --target' directory holding sglang")
    ap.add_argument("--part", choices=["radix", "mamba"], default="radix",
                    help="radix: RadixCache vs SGLang 0.5.23's; mamba: MambaRadixCache vs SGLang 0.5.9's")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=4, help="repetitions per implementation (alternating)")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16], help="radix part only")
    ap.add_argument("--pool", type=int, default=2_000_000)
    ap.add_argument("--slots", type=int, default=512, help="mamba part: state slots")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true", help="radix part: skip the memory pass")
    ap.add_argument("--json", action="store_true", help="print only the JSON document")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = {"benchmark": f"{args.part}_vs_sglang", "seed": args.seed, "requests": args.requests,
              "reps": args.reps, "pool_tokens": args.pool, "python": platform.python_version(),
              "torch": torch.__version__, "machine": platform.machine(), "timings": "provisional",
              "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    hint = INSTALL_HINT if args.part == "radix" else INSTALL_HINT_MAMBA
    try:
        sg = load_sglang(args.sglang_path, args.part)
    except Exception as exc:  # e.g. a package its import path needs is missing from DIR
        forget_sglang()
        sg, hint = None, f"{hint} (importing it failed: {exc!r})"
    if sg is None:
        result["sglang"] = {"status": "skipped", "reason": hint}
        if not args.json:
            print(hint)
        print(json.dumps(result, indent=None if args.json else 1))
        return 0
    result["sglang"] = {"status": "ok", "version": sg.version, "location": sg.location,
                        "shimmed_modules": sg.shims}
    work = make_workload(args.requests, args.seed)
    if args.part == "radix":
        result["runs"] = compare(work, args.page_sizes, args.reps, args.pool, sg, memory=not args.no_memory)
    else:
        result["mamba"] = compare_mamba(work, args.reps, args.pool, args.slots, sg)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if not args.json:
        print_table(result["runs"]) if args.part == "radix" else print_mamba_table(result["mamba"])
    print(json.dumps(result, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
