"""MambaRadixCache benchmark: per-op latency on bench_radix's workload, and state-hit rates of
admission/eviction policies on the Mooncake traces.

Latency (``--part latency``): the RadixCache workload of ``bench_radix.py`` (its generator,
imported), page size 1, a 2M-token KV pool and a Kimi-Linear-shaped ``MambaPool`` (2 heads x
16 x 16 delta-rule state, conv kernel 4, 4 KDA layers, fp32) of 512 slots. Per request, as
the scheduler runs it:

    match_prefix -> inc_lock_ref -> evict states (pool full) -> alloc the request's slot
    -> fork_state (copy the hit's state, or zeros) -> evict KV (pool short) -> alloc rows
    -> insert_with_state (the request's slot handed to the tree) -> free dup rows -> dec_lock_ref

Timed with ``perf_counter_ns`` (wall; mean/p50/p99) and the thread's CPU time; keys are
built before timing. ``match_prefix+fork`` is, per request, match plus the state copy;
``match_prefix+state`` is, per request, what SGLang 0.5.9's ``match_prefix(cow_mamba=True)``
does: match, ``evict_states`` (``evict(0, 1)``, only when the Mamba pool has no free slot),
``state_alloc`` (the request's slot) and ``fork_state`` -- the row to hold against SGLang's
356 us (its match_prefix evicts a state when its pool is full). Run
twice: ``checks_on`` (the default cache, every handed-in slot looked up in the pool's free
mask) and ``checks_off`` (``MambaRadixCache(checks=False)``: type/range/ownership only);
``--state-policy flop`` times the FLOP-aware state order instead of ``lru`` (the default).

Hit rate (``--part hitrate``): each Mooncake trace (``../shared/traces/mooncake``, relative
to the repo root; block ids expanded to pseudo-tokens), prompts only (a request ends at its
prompt), a fixed KV-token budget (``--kv-frac`` of the unique prompt tokens) and fixed state
slots (``--hit-slots``, Kimi shape). Prefill starts at the matched state prefix and is
chunked every ``--chunk`` tokens; with ``ckpt`` the first chunk ends at ``kv_prefix_len``
when the tree holds KV past the deepest state (Marconi's speculative checkpoint at the
branch-off point). ``--replay tree`` (default) drives the tree API with the request-level
semantics of ``cache_unfinished_req`` / ``cache_finished_req`` (virtual KV rows, capacity in
tokens); ``--replay flow`` runs the real scheduler flow (``alloc_for_extend`` /
``cache_unfinished_req`` / ``release_kv_cache`` on a ``HybridReqToTokenPool`` and a
``TokenToKVPoolAllocator``): exact, slower, the cross-check (both agree on 1,000 requests).
Hit = tokens skipped (``prefix_len``, a state hit) / prompt tokens; ``flop_saved`` weighs
them by the FlopModel's prefill FLOPs. A KV-only RadixCache with the same budget is the
state-free reference.

Prints a table, then one JSON document (``--json``: JSON only). Never asserts on speed.

    python benchmarks/bench_mamba.py [--part latency hitrate] [--requests 2000] [--limit N]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_radix import _stats, make_workload  # noqa: E402
from op_timer import op_timer  # noqa: E402

from radixkv.allocator import TokenToKVPoolAllocator  # noqa: E402
from radixkv.bench import hybrid_hitrate  # noqa: E402
from radixkv.bench.hybrid_hitrate import KDA_LAYERS, KIMI, chunk_ends, mamba_pool  # noqa: E402,F401
from radixkv.bench.traces import load_mooncake  # noqa: E402
from radixkv.cache import RadixKey  # noqa: E402
from radixkv.cache.hybrid.mamba_policies import FlopStateOrder  # noqa: E402
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache  # noqa: E402

OPS = ("match_prefix", "fork_state", "insert", "lock", "unlock", "evict", "evict_states", "state_alloc")
STATE_OPS = ("match_prefix", "evict_states", "state_alloc", "fork_state")  # match_prefix+state
SGLANG_QUOTED_US = {"match_prefix": 356.0, "insert": 131.0}  # SGLang 0.5.9, quoted by the issue
TRACE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "traces", "mooncake")
CONFIGS = [  # name, admission, state eviction, speculative checkpoint
    ("every+lru (SGLang)", "every", "lru", False),
    ("every+lru+ckpt", "every", "lru", True),
    ("every+flop+ckpt", "every", "flop", True),
    ("branch+lru+ckpt", "branch", "lru", True),
    ("branch+flop+ckpt (Marconi)", "branch", "flop", True),
]


class _Slot:
    """The one field ``fork_state`` reads from a request."""

    __slots__ = ("mamba_pool_idx", "rid")

    def __init__(self):
        self.mamba_pool_idx, self.rid = None, "bench"


# ----------------------------------------------------------------------------- latency
def run_latency(n_requests: int, pool_tokens: int, slots: int, seed: int, checks: bool = True,
                state_policy: str = "lru") -> dict:
    work = make_workload(n_requests, seed)
    keys = [(RadixKey(p), RadixKey(f), p.size, f.size) for p, f in work]
    alloc = TokenToKVPoolAllocator(pool_tokens, device="cpu")
    mamba = mamba_pool(slots)
    cache = MambaRadixCache(None, alloc, mamba_pool=mamba, checks=checks, state_eviction_policy=state_policy)
    req = _Slot()
    wall, cpu, timed = op_timer(OPS)
    hit = queried = kept = 0

    state_wall, state_cpu = [], []
    gc.collect()
    gc.freeze()
    for pkey, fkey, plen, flen in keys:
        marks = [len(wall[op]) for op in STATE_OPS]
        m = timed("match_prefix", cache.match_prefix, pkey)
        timed("lock", cache.inc_lock_ref, m.last_node)
        if mamba.available_size() == 0:
            timed("evict_states", cache.evict, 0, 1)
        req.mamba_pool_idx = int(timed("state_alloc", mamba.alloc, 1)[0])
        timed("fork_state", cache.fork_state, m.last_node, req)
        state_wall.append(sum(sum(wall[op][i:]) for op, i in zip(STATE_OPS, marks)))
        state_cpu.append(sum(sum(cpu[op][i:]) for op, i in zip(STATE_OPS, marks)))
        pre = m.prefix_len
        hit, queried = hit + pre, queried + plen
        need = flen - pre
        if alloc.available_size() < need:
            timed("evict", cache.evict, need - alloc.available_size())
        rows = alloc.alloc(need)
        if rows is None:
            raise RuntimeError(f"the KV pool is {need} tokens short after evicting")
        value = torch.cat([m.device_indices, rows])
        res = timed("insert", cache.insert_with_state, fkey, value, req.mamba_pool_idx)
        kept += res.state_kept
        if res.prefix_len > pre:
            alloc.free(value[pre:res.prefix_len])
        timed("unlock", cache.dec_lock_ref, m.last_node)
    gc.unfreeze()
    ops = {op: _stats(wall[op], cpu[op]) for op in OPS}
    both = np.asarray(wall["match_prefix"]) + np.asarray(wall["fork_state"])
    both_cpu = np.asarray(cpu["match_prefix"]) + np.asarray(cpu["fork_state"])
    ops["match_prefix+fork"] = _stats(both.tolist(), both_cpu.tolist())
    ops["match_prefix+state"] = _stats(state_wall, state_cpu)
    cache.check_invariants()
    speedup = {op: round(SGLANG_QUOTED_US[op] / ops[key]["mean_us"], 2)
               for op, key in (("match_prefix", "match_prefix+fork"), ("insert", "insert"))}
    speedup["match_prefix+state"] = round(SGLANG_QUOTED_US["match_prefix"] / ops["match_prefix+state"]["mean_us"], 2)
    return {"checks": checks, "state_eviction_policy": state_policy, "requests": n_requests,
            "pool_tokens": pool_tokens, "state_slots": slots,
            "state_bytes_per_slot": int(sum(mamba.slot_bytes) * KDA_LAYERS), "ops": ops,
            "state_hit_rate": round(hit / queried, 4), "states_kept": int(kept),
            "sglang_quoted_us": SGLANG_QUOTED_US, "speedup_vs_quoted_mean": speedup}


# ----------------------------------------------------------------------------- hit rate
# The replay lives in radixkv.bench.hybrid_hitrate (also behind `radixkv bench hitrate
# --hybrid`); these wrappers keep this script's call shape and JSON.
def replay_tree(trace, n: int, kv_tokens: int, slots: int, chunk: int, admission=None, policy=None,
                checkpoint=False) -> dict:
    """:func:`radixkv.bench.hybrid_hitrate.replay_tree` on the first ``n`` requests of
    ``trace``; ``slots`` is the pool size (the running request's slot included)."""
    return hybrid_hitrate.replay_tree((trace.tokens(i) for i in range(n)), kv_tokens, slots, chunk, admission,
                                      policy or "lru", checkpoint).as_bench_dict()


def replay_flow(trace, n: int, kv_tokens: int, slots: int, chunk: int, admission=None, policy=None,
                checkpoint=False) -> dict:
    """:func:`radixkv.bench.hybrid_hitrate.replay_flow` (the full scheduler flow), same shape."""
    return hybrid_hitrate.replay_flow((trace.tokens(i) for i in range(n)), int(trace.input_length[:n].max()),
                                      kv_tokens, slots, chunk, admission, policy or "lru",
                                      checkpoint).as_bench_dict()


def _trace_path(name: str) -> str:
    """The shared copy beside the repo, else the bundled one (radixkv.data)."""
    path = os.path.join(TRACE_DIR, f"{name}_trace.jsonl")
    if not os.path.isfile(path):
        from radixkv.data import mooncake_trace

        path = str(mooncake_trace(name))
    return path


def run_hitrate(trace_names, limit, kv_frac, slot_counts, chunk, mode, alphas) -> dict:
    replay = replay_tree if mode == "tree" else replay_flow
    configs = list(CONFIGS) + [(f"{adm}+flop(alpha={a:g})+ckpt", adm, FlopStateOrder(alpha=a), True)
                               for a in alphas for adm in ("every", "branch")]
    out = {}
    for name in trace_names:
        trace = load_mooncake(_trace_path(name), limit=limit)
        n = len(trace)
        budget = max(int(trace.unique_tokens * kv_frac), int(trace.input_length.max()) + 1)
        doc = {"replay": mode, "requests": n, "prompt_tokens": int(trace.input_length.sum()),
               "unique_tokens": trace.unique_tokens, "kv_budget_tokens": budget,
               "kv_budget_frac_of_unique": kv_frac, "chunk": chunk,
               "kv_only": replay(trace, n, budget, 1, chunk), "by_state_slots": {}}
        for slots in slot_counts:
            doc["by_state_slots"][str(slots)] = {cname: replay(trace, n, budget, slots, chunk, adm, pol, ck)
                                                 for cname, adm, pol, ck in configs}
        out[name] = doc
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", nargs="+", default=["latency", "hitrate"], choices=["latency", "hitrate"])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--pool", type=int, default=2_000_000)
    ap.add_argument("--slots", type=int, default=512, help="state slots of the latency run")
    ap.add_argument("--state-policy", default="lru", choices=["lru", "flop"],
                    help="state eviction order of the latency run")
    ap.add_argument("--hit-slots", type=int, nargs="+", default=[512, 128], help="state slots of the hit-rate runs")
    ap.add_argument("--alphas", type=float, nargs="*", default=[0.3, 3.0],
                    help="extra FLOP-aware runs with these alphas (the 'flop' policy uses 1.0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traces", nargs="+", default=["conversation", "synthetic"])
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--kv-frac", type=float, default=0.1, help="KV budget, fraction of unique tokens")
    ap.add_argument("--chunk", type=int, default=8192, help="chunked-prefill size (tokens)")
    ap.add_argument("--replay", choices=["tree", "flow"], default="tree",
                    help="hit-rate replay: the tree API (fast) or the full scheduler flow (exact, slow)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {"benchmark": "mamba_radix_cache", "python": platform.python_version(),
              "torch": torch.__version__, "machine": platform.machine(), "timings": "provisional"}
    if "latency" in args.part:
        result["latency"] = {f"checks_{'on' if c else 'off'}": run_latency(args.requests, args.pool, args.slots,
                                                                          args.seed, c, args.state_policy)
                             for c in (True, False)}
    if "hitrate" in args.part:
        result["hitrate"] = run_hitrate(args.traces, args.limit, args.kv_frac, args.hit_slots, args.chunk,
                                        args.replay, args.alphas)
    if not args.json:
        for mode, lat in result.get("latency", {}).items():
            print(f"{mode:<11}{'op':<20}{'n':>6}{'mean us':>10}{'p50 us':>10}{'p99 us':>10}{'cpu mean':>10}")
            for op, s in lat["ops"].items():
                if s["n"]:
                    print(f"{'':<11}{op:<20}{s['n']:>6}{s['mean_us']:>10.2f}{s['p50_us']:>10.2f}"
                          f"{s['p99_us']:>10.2f}{s['cpu_mean_us']:>10.2f}")
            print(f"{'':<11}state hit rate {lat['state_hit_rate']}, speedup vs quoted SGLang "
                  f"{lat['speedup_vs_quoted_mean']}")
        for name, doc in result.get("hitrate", {}).items():
            print(f"\n{name}: {doc['requests']} requests, KV budget {doc['kv_budget_tokens']} tokens; "
                  f"kv-only radix hit {doc['kv_only']['hit_rate']:.4f}")
            for slots, runs in doc["by_state_slots"].items():
                for cname, run in runs.items():
                    print(f"  {slots:>4} slots  {cname:<34} hit {run['hit_rate']:.4f}  "
                          f"flop_saved {run['flop_saved']:.4f}  ({run['seconds']} s)")
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
