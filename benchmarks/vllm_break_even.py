"""The break-even prompt length of ``RadixKVConnector``: above it, loading a prefix from the
manager is cheaper than computing it.

Two vLLM engines (``--model``, one OpenMP thread each, engine core in process) with the
connector share one ``radixkv serve`` manager. Per prompt length ``L`` and round: engine A
computes a fresh random prompt ``p`` (a miss; it saves ``p``'s whole blocks); then engine B
serves ``p`` (a hit: every whole block but the last token's is loaded, the rest computed) and a
fresh prompt ``q`` of the same length (a miss: all ``L`` computed, with the connector's miss
cost), the two in alternating order. Reported per ``L``: the medians of B's wall times, the
per-round ratio hit / miss and the loaded tokens; the break-even is the first ``L`` from which
the median ratio stays below 1. Lengths ``k * block + 8`` leave 8 tokens to compute on a hit.
Timing on a shared machine: the load average is printed beside the figures. Usage::

    python benchmarks/vllm_break_even.py --model llama-8b-ratio --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_configs import shared_side
from vllm_harness import EngineProcess
from vllm_instance import engine_kwargs
from vllm_model import MODELS, make_model

_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _lengths(text: str, block: int) -> list[int]:
    return [int(x) * block + 8 for x in text.split(",") if x.strip()]


def _length(a: EngineProcess, b: EngineProcess, n: int, rounds: int, rng: np.random.Generator,
            vocab: int) -> dict[str, Any]:
    """``rounds`` rounds at prompt length ``n``: A computes ``p``; B serves ``p`` (hit) and a fresh
    ``q`` (miss), the order alternating."""
    hit_ms: list[float] = []
    miss_ms: list[float] = []
    loaded: list[int] = []
    for r in range(rounds):
        p, q = (rng.integers(0, vocab, n).tolist() for _ in range(2))
        a.generate([p], max_tokens=1)
        order = [("hit", p), ("miss", q)] if r % 2 == 0 else [("miss", q), ("hit", p)]
        for what, prompt in order:
            ((_tok, cached, secs),) = b.generate([prompt], max_tokens=1, timed=True)
            (hit_ms if what == "hit" else miss_ms).append(secs * 1e3)
            if what == "hit":
                loaded.append(cached)
    ratio = [h / m for h, m in zip(hit_ms, miss_ms, strict=True)]
    row = {"prompt": n, "loaded_median": int(statistics.median(loaded)),
           "hit_ms": round(statistics.median(hit_ms), 2), "miss_ms": round(statistics.median(miss_ms), 2),
           "ratio_median": round(statistics.median(ratio), 3),
           "hit_ms_all": [round(x, 2) for x in hit_ms], "miss_ms_all": [round(x, 2) for x in miss_ms]}
    print(f"[break-even] {row}", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="llama")
    ap.add_argument("--blocks", default="1,2,4,8,16,32", help="prompt lengths in whole blocks (+ 8 tokens)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    kind = MODELS[args.model]
    if kind.hybrid:
        print(f"{kind.name} is hybrid: the connector refuses it (bench_vllm.refusal)", file=sys.stderr)
        return 2
    bs, lengths = args.block_size, _lengths(args.blocks, args.block_size)
    max_len = -(-(max(lengths) + 2 * bs) // bs) * bs
    rng = np.random.default_rng(2024)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="break-even-") as d:
        make_model(os.path.join(d, "model"), kind)
        spec = {"model": os.path.join(d, "model"), "block_size": bs, "max_model_len": max_len,
                "kv_cache_bytes": 64 << 20, "dtype": kind.dtype, "manager_kv_tokens": 4 * max_len * args.rounds}
        with shared_side("radixkv", spec) as kvt:
            kw = dict(engine_kwargs(spec), kv_transfer_config=kvt)
            engines = [EngineProcess(n, kw, env=_ENV) for n in ("A", "B")]
            try:
                for e in engines:
                    e.wait_ready()
                a, b = engines
                warm = rng.integers(0, kind.vocab_size, max(lengths)).tolist()
                a.generate([warm], max_tokens=1)
                b.generate([warm], max_tokens=1)               # first-request set-up kept out
                rows = [_length(a, b, n, args.rounds, rng, kind.vocab_size) for n in lengths]
            finally:
                for e in engines:
                    e.stop()
    below = [r["ratio_median"] < 1 for r in rows]
    first = next((rows[i]["prompt"] for i in range(len(rows)) if all(below[i:])), None)
    miss_fit = np.polyfit([r["prompt"] for r in rows], [r["miss_ms"] for r in rows], 1)
    doc = {"model": kind.name, "block_size": bs, "rounds": args.rounds, "rows": rows, "break_even_prompt": first,
           "miss_ms_per_token": round(float(miss_fit[0]), 4),
           "loadavg": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    print(f"{kind.name}: block {bs}, {args.rounds} rounds per length, load average {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; a miss costs {miss_fit[0]:.3f} ms per prompt token (fit)")
    print(f"{'prompt':>7}{'loaded':>8}{'hit ms':>9}{'miss ms':>9}{'hit/miss':>9}")
    for r in rows:
        print(f"{r['prompt']:>7}{r['loaded_median']:>8}{r['hit_ms']:>9.1f}{r['miss_ms']:>9.1f}{r['ratio_median']:>9.3f}")
    print(f"break-even: {'from ' + str(first) + ' tokens' if first else 'not reached'} (median hit/miss < 1 "
          "from that length on)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
