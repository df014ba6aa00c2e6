"""Where a no-hit request's time goes with ``RadixKVConnector``: three instances (no
connector, a no-op connector, the radixkv connector with its hooks timed) get the same fresh
prompt each round, one after the other (the first rotating); per radixkv request the hooks'
time and vLLM's steps (``build_connector_meta`` calls) inside its wall time. Usage::

    python benchmarks/vllm_miss_timeline.py --rounds 30 [--engine-process] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_vllm as bv  # noqa: E402
from vllm_configs import shared_side  # noqa: E402
from vllm_model import MODELS, make_model  # noqa: E402
from vllm_trace import build_workload  # noqa: E402

NAMES = ("without", "noop", "radixkv")


def _spans(trace: str) -> list[tuple[str, float, float]]:
    out = []
    with open(trace, encoding="ascii") as f:
        for line in f:
            _pid, hook, t0, dt = line.split()
            out.append((hook, float(t0), float(dt)))
    return out


def split_request(spans: list[tuple[str, float, float]]) -> dict[str, Any]:
    """One request's hook spans ``(hook, start, seconds)``, starts relative to its dispatch (the
    instance's later requests included): the spans from its first ``get_num_new_matched_tokens``
    through its ``request_finished`` are its path; those after, up to the next request's match,
    are work it leaves behind. Returns each part's hook milliseconds and steps
    (``build_connector_meta`` calls), and the path's milliseconds per hook."""
    spans = sorted((s for s in spans if s[1] >= 0.0), key=lambda s: s[1])
    first = next((i for i, s in enumerate(spans) if s[0] == "get_num_new_matched_tokens"), len(spans))
    spans = spans[first:]
    end = next((i for i, s in enumerate(spans) if s[0] == "request_finished"), len(spans) - 1) + 1
    nxt = next((i for i, s in enumerate(spans) if i >= end and s[0] == "get_num_new_matched_tokens"), len(spans))
    path, after = spans[:end], spans[end:nxt]
    hooks: dict[str, float] = {}
    for h, _s, dt in path:
        hooks[h] = hooks.get(h, 0.0) + dt * 1e3
    return {"path_ms": sum(s[2] for s in path) * 1e3, "after_ms": sum(s[2] for s in after) * 1e3,
            "path_steps": sum(s[0] == "build_connector_meta" for s in path),
            "after_steps": sum(s[0] == "build_connector_meta" for s in after), "path_hooks_ms": hooks}


def _median(xs: list[float]) -> float | None:
    return round(float(np.median(xs)), 3) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bv.add_arguments(ap)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)
    kind = MODELS[args.model]
    args.block_size = args.block_size or kind.block_size
    w = build_workload(args.trace, sessions=args.sessions, turns=args.turns, tokens_per_block=args.tokens_per_block,
                       max_prompt=args.max_prompt, vocab=kind.vocab_size, n_instances=args.instances,
                       routing=args.routing)
    prompt_len = int(np.median([len(p) for p in w.prompts]))
    load = [round(os.getloadavg()[0], 2)]
    with tempfile.TemporaryDirectory(prefix="miss-timeline-") as d:
        make_model(os.path.join(d, "model"), kind)
        spec = bv.instance_spec(args, kind, os.path.join(d, "model"), w)
        traces = {n: os.path.join(d, f"{n}.trace") for n in NAMES}
        with shared_side("radixkv", spec, manager_args=args.manager_args) as kvt:
            if not isinstance(kvt, dict):
                raise RuntimeError("the radixkv configuration gave no kv_transfer_config")
            timed = dict(kvt, kv_connector="TimedRadixKVConnector", kv_connector_module_path="vllm_hook_timer")
            noop = {"kv_connector": "NoOpConnector", "kv_connector_module_path": "vllm_hook_timer",
                    "kv_role": "kv_both"}
            specs = [dict(spec, kv_transfer_config=k, sys_path=[HERE],
                          env={**spec.get("env", {}), "RADIXKV_HOOK_TRACE": traces[n]})
                     for n, k in zip(NAMES, (None, noop, timed), strict=True)]
            insts = bv._start(specs)
            rng = np.random.default_rng(99)
            walls: dict[str, list[tuple[float, float]]] = {n: [] for n in NAMES}
            try:
                for r in range(args.rounds + 1):      # round 0: warm-up
                    prompt = rng.integers(0, spec["vocab"], prompt_len).astype(np.int32)
                    for k in [(r + j) % len(NAMES) for j in range(len(NAMES))]:
                        time.sleep(args.miss_ab_gap_s)
                        t0 = time.perf_counter()
                        (out,) = bv._dispatch([insts[k]], [[(-1, prompt)]])[0]
                        if r:
                            walls[NAMES[k]].append((t0, out["wall"]))
            finally:
                bv._stop(insts)
        spans = {n: _spans(traces[n]) if os.path.exists(traces[n]) else [] for n in NAMES}
    load.append(round(os.getloadavg()[0], 2))
    doc: dict[str, Any] = {"rounds": args.rounds, "prompt_len": prompt_len, "loadavg_1min": load,
                           "engine_process": bool(args.engine_process), "tp": args.tp}
    base = np.asarray([x[1] for x in walls["without"]])
    for n in NAMES:
        ms = np.asarray([x[1] for x in walls[n]]) * 1e3
        reqs = [split_request([(h, s - t0, dt) for h, s, dt in spans[n]]) for t0, _ in walls[n]]
        doc[n] = {"wall_ms_median": round(float(np.median(ms)), 2), "wall_ms": [round(float(x), 2) for x in ms],
                  "round_ratio_median": round(float(np.median(ms / 1e3 / base)), 3),
                  **({k: _median([r[k] for r in reqs]) for k in ("path_ms", "after_ms", "path_steps", "after_steps")}
                     if n != "without" else {}),
                  "path_hook_ms_median": {h: _median([r["path_hooks_ms"].get(h, 0.0) for r in reqs])
                                          for h in sorted({h for r in reqs for h in r["path_hooks_ms"]})}}
    text = json.dumps(doc, indent=1)
    print(json.dumps({n: {k: v for k, v in doc[n].items() if k != "wall_ms"} for n in NAMES}, indent=1))
    print(f"load {load}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
