"""The MambaRadixCache half of ``bench_vs_sglang.py``: radixkv's hybrid tree and SGLang
0.5.9's, on the RadixCache workload with ``bench_mamba.py``'s state shape, alternating per
repetition (see ``bench_vs_sglang.py``'s docstring for the cycle and the shims)."""
from __future__ import annotations

import gc
import types
from typing import Any

import numpy as np
import torch
from bench_radix import _stats
from op_timer import op_timer
from sglang_loader import SGLang, sglang_modules

from radixkv.allocator import TokenToKVPoolAllocator
from radixkv.cache import RadixKey
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.memory import KimiLinearStateShape, MambaPool

__all__ = ["compare_mamba", "summarize_mamba", "print_mamba_table"]


KDA_LAYERS = 4  # bench_mamba.py's state: 4 KDA layers of 2 heads x 16 x 16, conv kernel 4, fp32
M_OPS = ("match_prefix", "evict_states", "state_alloc", "fork_state", "lock", "evict", "insert", "unlock")
M_STATE = ("match_prefix", "evict_states", "state_alloc", "fork_state")  # "match_prefix+state"


class _Req:
    """The request fields both caches' state calls read."""

    __slots__ = ("mamba_pool_idx", "rid")

    def __init__(self):
        self.mamba_pool_idx: Any = None  # radixkv: an int slot; SGLang: a one-element tensor
        self.rid = "bench"


def _mamba_cycle(work, pool: int, slots: int, impl: str, sg: SGLang | None) -> dict:
    """``bench_mamba.py --part latency``'s cycle, page size 1, on one cache. radixkv:
    match -> lock -> evict_states (no free slot) -> state_alloc -> fork_state -> evict KV ->
    alloc -> insert_with_state -> free dups -> unlock. SGLang 0.5.9 (its scheduler's calls):
    match_prefix(cow_mamba=True, req) -- which on a state hit allocates the request's slot
    (evicting a state when none is free) and copies the state into it -- -> lock -> on a
    miss evict_states + state_alloc (``MambaPool.alloc`` zeroes the slot) -> evict KV ->
    alloc -> insert(mamba_value=the slot) -> free dups (and the slot when the tree already
    had a state there) -> unlock. ``match_prefix+state`` sums, per request, the state ops."""
    keys = []
    for prompt, full in work:
        if impl == "radixkv":
            keys.append((RadixKey(prompt), RadixKey(full), prompt.size, full.size))
        else:
            rk = sglang_modules(sg).radix_cache.RadixKey
            keys.append((rk(prompt.tolist()), rk(full.tolist()), prompt.size, full.size))
    req = _Req()
    if impl == "radixkv":
        alloc = TokenToKVPoolAllocator(pool, device="cpu")
        shape = KimiLinearStateShape.create(num_heads=2, head_dim=16, conv_kernel_size=4)
        mamba = MambaPool.from_state_shape(slots, shape, KDA_LAYERS, torch.float32)
        cache: Any = MambaRadixCache(None, alloc, mamba_pool=mamba)  # or SGLang's: no common type
    else:
        m = sglang_modules(sg)
        args = m.server_args.ServerArgs.__new__(m.server_args.ServerArgs)  # no __post_init__
        args.page_size = 1  # all that mamba_cache_chunk_size (read in match_prefix) needs
        m.server_args.set_global_server_args_for_scheduler(args)
        mu = m.mamba_utils
        shape = mu.KimiLinearStateShape.create(tp_world_size=1, num_heads=2, head_dim=16, conv_kernel_size=4)
        params = mu.KimiLinearCacheParams(shape=shape, layers=list(range(KDA_LAYERS)),
                                          dtype=mu.Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
        mamba = m.memory_pool.MambaPool(size=slots, spec_state_size=0, cache_params=params, device="cpu")
        alloc = m.alloc.TokenToKVPoolAllocator(pool, torch.float16, "cpu", None, False)
        holder = types.SimpleNamespace(mamba_pool=mamba)  # MambaRadixCache reads .mamba_pool only
        cache = m.mamba_radix_cache.MambaRadixCache(m.params.CacheInitParams(
            disable=False, req_to_token_pool=holder, token_to_kv_pool_allocator=alloc, page_size=1))
        mp, ip, ep = m.base.MatchPrefixParams, m.base.InsertParams, m.base.EvictParams
    wall, cpu, timed = op_timer(M_OPS)
    state = []
    hits: list[int] = []
    queried = kept = 0

    gc.collect()
    gc.freeze()
    for pkey, fkey, plen, flen in keys:
        marks = [len(wall[op]) for op in M_STATE]
        if impl == "radixkv":
            res = timed("match_prefix", cache.match_prefix, pkey)
            node, idx, pre = res.last_node, res.device_indices, res.prefix_len
            timed("lock", cache.inc_lock_ref, node)
            if mamba.available_size() == 0:
                timed("evict_states", cache.evict, 0, 1)
            req.mamba_pool_idx = int(timed("state_alloc", mamba.alloc, 1)[0])
            timed("fork_state", cache.fork_state, node, req)
        else:
            req.mamba_pool_idx = None
            res = timed("match_prefix", lambda k: cache.match_prefix(mp(key=k, req=req, cow_mamba=True)), pkey)
            node, idx = res.last_device_node, res.device_indices
            pre = len(idx)
            timed("lock", cache.inc_lock_ref, node)
            if req.mamba_pool_idx is None:
                if mamba.available_size() == 0:
                    timed("evict_states", lambda: cache.evict(ep(num_tokens=0, mamba_num=1)))
                req.mamba_pool_idx = timed("state_alloc", mamba.alloc, 1)[0]
        state.append((sum(sum(wall[op][i:]) for op, i in zip(M_STATE, marks)),
                      sum(sum(cpu[op][i:]) for op, i in zip(M_STATE, marks))))
        hits.append(pre)
        queried += plen
        need = flen - pre
        if alloc.available_size() < need:
            short = need - alloc.available_size()
            timed("evict", cache.evict if impl == "radixkv" else lambda n: cache.evict(ep(num_tokens=n)), short)
        rows = alloc.alloc(need)
        if rows is None:
            raise RuntimeError(f"the KV pool is {need} tokens short after evicting")
        value = torch.cat([idx, rows])
        if impl == "radixkv":
            ins = timed("insert", cache.insert_with_state, fkey, value, req.mamba_pool_idx)
            done, keep = ins.prefix_len, ins.state_kept
        else:
            slot = req.mamba_pool_idx.unsqueeze(-1).clone()
            ins = timed("insert", lambda k, v: cache.insert(ip(key=k, value=v, mamba_value=slot)), fkey, value)  # noqa: B023
            done, keep = ins.prefix_len, not ins.mamba_exist
            if not keep:
                mamba.free(req.mamba_pool_idx.unsqueeze(0))
        kept += keep
        if done > pre:
            alloc.free(value[pre:done])
        timed("unlock", cache.dec_lock_ref, node)
    gc.unfreeze()
    return {"wall": wall, "cpu": cpu, "state": state, "hits": hits, "hit_rate": sum(hits) / queried,
            "states_kept": int(kept), "cache": cache, "alloc": alloc, "mamba": mamba}


def summarize_mamba(reps: list[dict]) -> dict:
    ops = {}
    for op in M_OPS:
        w = [x for r in reps for x in r["wall"][op]]
        if w:
            ops[op] = _stats(w, [x for r in reps for x in r["cpu"][op]])
            ops[op]["rep_means_us"] = [round(float(np.mean(r["wall"][op])) / 1e3, 3) for r in reps]
    ops["match_prefix+state"] = _stats([w for r in reps for w, _ in r["state"]],
                                       [c for r in reps for _, c in r["state"]])
    return {"ops": ops, "state_hit_rate": round(reps[0]["hit_rate"], 6),
            "state_hit_rate_by_rep": [round(r["hit_rate"], 6) for r in reps],
            "states_kept_by_rep": [r["states_kept"] for r in reps]}


def compare_mamba(work, reps: int, pool: int, slots: int, sg: SGLang | None) -> dict:
    """Both MambaRadixCaches on ``work``, alternating per repetition."""
    impls = ["radixkv"] + (["sglang"] if sg is not None else [])
    runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
    for rep in range(reps):
        for impl in (impls if rep % 2 == 0 else impls[::-1]):
            run = _mamba_cycle(work, pool, slots, impl, sg)
            for k in ("cache", "alloc", "mamba"):
                del run[k]
            runs[impl].append(run)
    doc: dict[str, Any] = {impl: summarize_mamba(runs[impl]) for impl in impls}
    doc["state_shape"] = {"kda_layers": KDA_LAYERS, "heads": 2, "head_dim": 16, "conv_kernel": 4,
                          "dtype": "float32", "slots": slots, "page_size": 1}
    if sg is not None:
        a, b = runs["radixkv"][0]["hits"], runs["sglang"][0]["hits"]
        doc["requests_with_different_hit"] = int(sum(x != y for x, y in zip(a, b)))
        doc["sglang_over_radixkv_mean"] = {
            op: round(doc["sglang"]["ops"][op]["mean_us"] / doc["radixkv"]["ops"][op]["mean_us"], 2)
            for op in ("match_prefix+state", "insert", "lock", "unlock")}
    return doc


def print_mamba_table(doc: dict) -> None:
    print(f"{'impl':<9}{'op':<22}{'n':>6}{'mean us':>10}{'p50 us':>10}{'p99 us':>10}{'cpu mean':>10}")
    for impl in ("radixkv", "sglang"):
        if impl in doc:
            for op, st in doc[impl]["ops"].items():
                if st["n"]:
                    print(f"{impl:<9}{op:<22}{st['n']:>6}{st['mean_us']:>10.2f}{st['p50_us']:>10.2f}"
                          f"{st['p99_us']:>10.2f}{st['cpu_mean_us']:>10.2f}")
            print(f"{impl:<9}state hit rate {doc[impl]['state_hit_rate']:.4f}, states kept "
                  f"{doc[impl]['states_kept_by_rep']}")
    if "sglang_over_radixkv_mean" in doc:
        print(f"sglang/radixkv mean: {doc['sglang_over_radixkv_mean']}; requests whose hit differs: "
              f"{doc['requests_with_different_hit']}")
