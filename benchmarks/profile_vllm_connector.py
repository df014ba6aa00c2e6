"""The vLLM connector's own time per request and per loaded block, without vLLM.

Two fake engines (``benchmarks/tooling/vllm_fake.Engine``: the connector's ``SchedulerSide`` +
``WorkerSide`` over a paged KV cache in vLLM's CPU layout) share one ``radixkv serve`` manager
(a process, as in ``radixkv bench vllm``). Each round: engine A matches a fresh prompt (a miss),
saves it and commits; engine B matches it (a hit of every whole block but the last token's),
loads it, saves its tail. Every phase is timed with ``perf_counter``; round 0 apart (what the
first request pays that later ones do not), then medians. ``--cprofile N``: the N functions
with the most own time over all rounds. Usage::

    python benchmarks/profile_vllm_connector.py --rounds 40 --prompt 512 --cprofile 15
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from typing import Any

import torch
from tooling.vllm_fake import Engine
from vllm_configs import shared_side

from radixkv.integrations.vllm.config import ConnectorConfig
from radixkv.integrations.vllm.layout import KVShape
from radixkv.integrations.vllm.scheduler_side import ScheduledReq

PHASES = ("a_match_miss", "a_save_step", "a_finish", "b_match_hit", "b_load_step", "b_finish")


def _round(a: Engine, b: Engine, r: int, n: int, bs: int) -> dict[str, float]:
    prompt = [(r * 7919 + i * 31) % 30000 + 3 for i in range(n)]
    blocks = list(range(-(-n // bs)))
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    assert a.sched.num_new_matched_tokens(f"a{r}", prompt, 0, "vllm|profile") == 0
    t1 = time.perf_counter()
    a.step([ScheduledReq(f"a{r}", 0, n)], {f"a{r}": blocks})
    t2 = time.perf_counter()
    a.sched.finished(f"a{r}")
    t3 = time.perf_counter()
    a.sched.flush()  # A's commit is sent (off the step) before B asks: not timed
    t4 = time.perf_counter()
    hit = b.sched.num_new_matched_tokens(f"b{r}", prompt, 0, "vllm|profile")
    t5 = time.perf_counter()
    assert hit == (n - 1) // bs * bs, hit
    b.sched.after_alloc(f"b{r}", hit)
    b.step([ScheduledReq(f"b{r}", hit, n - hit)], {f"b{r}": blocks})
    t6 = time.perf_counter()
    b.sched.finished(f"b{r}")
    t7 = time.perf_counter()
    b.sched.flush()
    for name, d in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t6 - t5, t7 - t6), strict=True):
        t[name] = d * 1e3
    t["loaded_blocks"] = hit // bs
    return t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4, help="default: the bench's tiny Llama (4 x 2 KV heads x 64)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--copy-threads", type=int, default=1,
                    help="the workers' copy_threads (0: torch's own thread count, as before it existed)")
    ap.add_argument("--cprofile", type=int, default=0, help="print the N functions with the most own time")
    ap.add_argument("--json", default=None, help="write the per-round figures here")
    args = ap.parse_args(argv)
    bs, n = args.block_size, args.prompt
    shape = KVShape(args.layers, args.kv_heads, args.head_dim, "float32", bs)
    with tempfile.TemporaryDirectory(prefix="profile-connector-") as d:
        with open(os.path.join(d, "config.json"), "w", encoding="utf-8") as f:
            json.dump({"num_hidden_layers": args.layers, "num_attention_heads": args.kv_heads,
                       "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "float32"}, f)
        max_len = -(-(n + bs) // bs) * bs
        spec = {"model": d, "block_size": bs, "max_model_len": max_len, "manager_kv_tokens": 8 * max_len}
        with shared_side("radixkv", spec) as ktc:
            assert isinstance(ktc, dict)
            cfg = ConnectorConfig.from_extra(ktc["kv_connector_extra_config"])
            blocks = -(-n // bs) + 1
            a, b = Engine(cfg, blocks=blocks, shape=shape), Engine(cfg, blocks=blocks, seed=1, shape=shape)
            for w in (a.worker, b.worker):
                w.copy_threads = args.copy_threads
            prof = cProfile.Profile() if args.cprofile else None
            rounds: list[dict[str, Any]] = []
            try:
                for r in range(args.rounds):
                    if prof is not None and r > 0:
                        prof.enable()
                    rounds.append(_round(a, b, r, n, bs))
                    if prof is not None:
                        prof.disable()
            finally:
                a.close()
                b.close()
    first, rest = rounds[0], rounds[1:]
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds of {n}-token prompts, block {bs}, "
          f"{args.layers} layers x {args.kv_heads} KV heads x {args.head_dim}; copy_threads {args.copy_threads} "
          f"(torch threads {torch.get_num_threads()})")
    print(f"{'phase':<14} {'round 0 ms':>10} {'median ms':>10} {'p90 ms':>8}")
    for p in PHASES:
        xs = sorted(x[p] for x in rest)
        print(f"{p:<14} {first[p]:>10.2f} {statistics.median(xs):>10.2f} {xs[int(0.9 * (len(xs) - 1))]:>8.2f}")
    per_block = [x["b_load_step"] / x["loaded_blocks"] for x in rest]
    per_req = [sum(x[p] for p in PHASES[3:]) for x in rest]
    print(f"B (hit) per request: median {statistics.median(per_req):.2f} ms; per loaded block (load step / "
          f"blocks): median {statistics.median(per_block):.3f} ms")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rounds, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
