"""``radixkv bench vllm``: vLLM instances behind a round-robin router, with and without radixkv.

A multi-turn trace (the bundled Mooncake conversation trace, cut down to what a small CPU
runs: the first ``--requests`` requests of its multi-turn conversations among its first 1,000
requests, at most ``--max-blocks`` blocks each, one Mooncake
block -> ``--block-tokens`` token ids drawn from a generator seeded by the block's hash id, so
shared hash prefixes are shared token prefixes) is sent, one request at a time, to
``--instances`` vLLM engines in turn (request ``i`` -> engine ``i % N``: consecutive turns of a
conversation land on different engines). A tiny random Llama (fp32, made here) serves it.

Modes (all engines started at once; each request then goes to every mode in turn, in
alternating order, so that background load hits the modes alike):

* ``local``: vLLM's own prefix caching only (each engine caches what it computed);
* ``radixkv``: the same plus ``RadixKVConnector`` and one manager shared by the engines;
* ``bound``: not run: the hit tokens of one shared cache of unlimited size (each request
  reuses the longest whole-block prefix any earlier request had, at most ``n - 1`` tokens).

Reported per mode: prefill tokens computed (prompt tokens minus vLLM's
``num_cached_tokens``), hit tokens, time to first token (each request is generated with
``max_tokens=1``, so its wall time is its TTFT) p50 / p99, requests/s (sequential), and the
mean TTFT of requests no cache could serve (the connector's overhead on a miss).
Run with the vLLM venv: ``.venv-vllm/bin/radixkv bench vllm`` (``make setup-vllm``).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time

import numpy as np

VOCAB = 512


def build_trace(n: int, max_blocks: int, block_tokens: int, scan: int = 1000):
    """(prompts as int lists, their block-id chains): the first ``n`` requests, among the
    trace's first ``scan``, of multi-turn conversations (two requests or more sharing their
    first two blocks), in trace order."""
    from collections import Counter

    import radixkv
    from radixkv.bench.traces import load_mooncake

    path = os.path.join(os.path.dirname(radixkv.__file__), "data", "mooncake", "conversation_trace.jsonl")
    tr = load_mooncake(path, limit=scan)
    all_chains = [tuple(int(h) for h in tr.hash_ids[tr.hash_offsets[i]:tr.hash_offsets[i + 1]])
                  for i in range(len(tr))]
    heads = Counter(ch[:2] for ch in all_chains if len(ch) >= 2)
    keep = [i for i, ch in enumerate(all_chains) if len(ch) >= 2 and heads[ch[:2]] >= 2][:n]
    prompts, chains = [], []
    for i in keep:
        ids = all_chains[i][:max_blocks]
        blocks = [np.random.default_rng(h).integers(3, VOCAB, block_tokens) for h in ids]
        tail = np.random.default_rng(10**9 + i).integers(3, VOCAB, 7)  # the turn's own last tokens
        prompts.append(np.concatenate(blocks + [tail]).astype(int).tolist())
        chains.append(ids)
    return prompts, chains


def build_sessions(sessions: int, turns: int, block_tokens: int, turn_blocks: int = 2):
    """A synthetic multi-turn trace: ``sessions`` conversations of ``turns`` turns, each turn
    its conversation so far plus ``turn_blocks`` new blocks (one shared system block first),
    sent turn-major (turn 0 of every session, then turn 1, ...). With an odd number of
    sessions and round robin over 2 engines, each turn lands on the other engine than the
    turn before it."""
    prompts, chains = [], []
    for t in range(turns):
        for s in range(sessions):
            ids = (0,) + tuple(1 + s * 100_000 + i for i in range((t + 1) * turn_blocks))
            blocks = [np.random.default_rng(h).integers(3, VOCAB, block_tokens) for h in ids]
            tail = np.random.default_rng(10**9 + t * sessions + s).integers(3, VOCAB, 7)
            prompts.append(np.concatenate(blocks + [tail]).astype(int).tolist())
            chains.append(ids)
    return prompts, chains


def miss_probes(n: int, length: int):
    """``n`` prompts that share nothing with any trace prompt or each other."""
    return [np.random.default_rng(2 * 10**9 + i).integers(3, VOCAB, length).astype(int).tolist() for i in range(n)]


def shared_bound(prompts, chains, block_tokens: int, vllm_block: int):
    """Hit tokens per request of one unlimited shared cache (whole vLLM blocks, n - 1 cap)."""
    seen = set()
    hits = []
    for p, ch in zip(prompts, chains, strict=True):
        k = 0
        while k < len(ch) and ch[:k + 1] in seen:
            k += 1
        hit = min(k * block_tokens, (len(p) - 1) // vllm_block * vllm_block)
        hits.append(hit // vllm_block * vllm_block)
        seen.update(ch[:j] for j in range(1, len(ch) + 1))
    return hits


def start_mode(mode: str, model: str, args, root: str):
    """(engines, manager or None) of ``mode``; the engines are starting (``wait_ready``)."""
    from radixkv.integrations.vllm.harness import EngineProcess, ManagerProcess

    common = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                  block_size=args.vllm_block, max_model_len=2048, kv_cache_memory_bytes=64 << 20,
                  enable_prefix_caching=True, distributed_executor_backend="uni", seed=0)
    manager = None
    if mode == "radixkv":
        token_file = os.path.join(root, "token")
        with open(token_file, "w") as f:
            f.write(secrets.token_urlsafe(24))
        sock = tempfile.mkdtemp(dir=root)
        address = f"unix://{sock}/s.sock"
        manager = ManagerProcess(address, token_file, tempfile.mkdtemp(dir=root),
                                 ["--model-config", model, "--page-size", str(args.vllm_block),
                                  "--kv-tokens", str(args.kv_tokens), "--max-context-len", "2048"])
        manager.start()
        common["kv_transfer_config"] = dict(
            kv_connector="RadixKVConnector", kv_connector_module_path="radixkv.integrations.vllm", kv_role="kv_both",
            kv_connector_extra_config={"address": address, "token_file": token_file})
    return [EngineProcess(f"{mode}-{i}", common) for i in range(args.instances)], manager


def run_modes(modes, model: str, prompts, args, root: str):
    """Every mode's engines at once; each request goes to every mode in turn (the order
    alternates), so background load hits the modes alike. Returns ``{mode: [(prompt
    tokens, cached tokens, seconds)]}`` and the start-up seconds."""
    t0 = time.perf_counter()
    started = {m: start_mode(m, model, args, root) for m in modes}
    results = {m: [] for m in modes}
    try:
        for engines, _ in started.values():
            for e in engines:
                e.wait_ready()
        start_s = time.perf_counter() - t0
        warm = 0
        for engines, _ in started.values():  # one-time costs (the first mapping) off the clock
            for e in engines:
                warm += 1
                e.generate([np.random.default_rng(3 * 10**9 + warm).integers(3, VOCAB, 64).tolist()], max_tokens=1)
        for i, p in enumerate(prompts):
            for m in (modes if i % 2 == 0 else modes[::-1]):
                engines = started[m][0]
                [(_, cached, dt)] = engines[i % len(engines)].generate([p], max_tokens=1, timed=True)
                results[m].append((len(p), cached, dt))
    finally:
        for engines, manager in started.values():
            for e in engines:
                e.stop()
            if manager is not None:
                manager.stop()
    return results, start_s


def summarize(results, probes):
    lens = np.array([r[0] for r in results])
    cached = np.array([r[1] for r in results])
    ttft = np.array([r[2] for r in results])
    miss = np.array([r[2] for r in probes if r[1] == 0] or [np.nan])
    return {"requests": len(results), "prompt_tokens": int(lens.sum()), "hit_tokens": int(cached.sum()),
            "prefill_tokens": int((lens - cached).sum()),
            "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3), "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
            "requests_per_s": float(len(results) / ttft.sum()), "misses": int(np.isfinite(miss).sum()),
            "miss_ttft_p50_ms": float(np.nanmedian(miss) * 1e3), "miss_ttft_mean_ms": float(np.nanmean(miss) * 1e3),
            "per_request": [list(r) for r in results], "miss_probes": [list(r) for r in probes]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", choices=["mooncake", "sessions"], default="mooncake",
                    help="the Mooncake conversation cut or synthetic sessions (default %(default)s)")
    ap.add_argument("--requests", type=int, default=120, help="mooncake: requests (default %(default)s)")
    ap.add_argument("--sessions", type=int, default=5, help="sessions: conversations (default %(default)s)")
    ap.add_argument("--turns", type=int, default=8, help="sessions: turns each (default %(default)s)")
    ap.add_argument("--miss-probes", type=int, default=20,
                    help="prompts sharing nothing, sent after the trace: the cost of a miss (default %(default)s)")
    ap.add_argument("--instances", type=int, default=2, help="vLLM engines (default %(default)s)")
    ap.add_argument("--max-blocks", type=int, default=16, help="Mooncake blocks kept per request (default %(default)s)")
    ap.add_argument("--block-tokens", type=int, default=32, help="tokens per Mooncake block (default %(default)s)")
    ap.add_argument("--vllm-block", type=int, default=32, help="vLLM block size = manager page size")
    ap.add_argument("--kv-tokens", type=int, default=65536, help="the manager's pool (default %(default)s)")
    ap.add_argument("--modes", default="local,radixkv", help="comma list of local, radixkv")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="radixkv-bench-vllm-")
    model = os.path.join(root, "model")
    from radixkv.integrations.vllm.harness import make_tiny_llama

    make_tiny_llama(model, vocab=VOCAB)
    if args.trace == "mooncake":
        prompts, chains = build_trace(args.requests, args.max_blocks, args.block_tokens)
    else:
        prompts, chains = build_sessions(args.sessions, args.turns, args.block_tokens)
    bound = shared_bound(prompts, chains, args.block_tokens, args.vllm_block)
    probes = miss_probes(args.miss_probes, 16 * args.block_tokens + 7)
    report = {"args": vars(args), "bound": {"hit_tokens": int(sum(bound)),
                                            "prefill_tokens": int(sum(len(p) for p in prompts) - sum(bound))}}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    runs, start_s = run_modes(modes, model, prompts + probes, args, root)
    report["engine_start_s"] = round(start_s, 1)
    n = len(prompts)
    for mode, results in runs.items():
        report[mode] = summarize(results[:n], results[n:])
    print(f"{'mode':10} {'prefill tok':>11} {'hit tok':>8} {'TTFT p50 ms':>11} {'p99 ms':>8} {'req/s':>7} "
          f"{'miss p50 ms':>11}")
    for mode in runs:
        r = report[mode]
        print(f"{mode:10} {r['prefill_tokens']:11d} {r['hit_tokens']:8d} {r['ttft_p50_ms']:11.1f} "
              f"{r['ttft_p99_ms']:8.1f} {r['requests_per_s']:7.1f} {r['miss_ttft_p50_ms']:11.1f}")
    b = report["bound"]
    print(f"{'bound':10} {b['prefill_tokens']:11d} {b['hit_tokens']:8d}")
    if "local" in runs and "radixkv" in runs:
        loc, rad = report["local"], report["radixkv"]
        print(f"radixkv / local prefill tokens: {rad['prefill_tokens'] / max(1, loc['prefill_tokens']):.2f}; "
              f"radixkv / bound hit tokens: {rad['hit_tokens'] / max(1, b['hit_tokens']):.2f}; "
              f"miss TTFT p50 radixkv / local: {rad['miss_ttft_p50_ms'] / loc['miss_ttft_p50_ms']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
