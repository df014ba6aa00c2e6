"""Instructions and simulated cache misses per RadixCache call, counted by valgrind's callgrind.

Why: on a shared VM the wall-clock means of ``bench_radix.py`` drift by 10-20% within an hour,
more than most changes to the tree move them. Callgrind counts what one call executes
(instructions, and misses of a simulated L1 and 2 MiB L2), the same on every run for the same
code and inputs, so two versions of the tree can be compared exactly. It does not measure time:
it models no prefetching, TLB or page faults, and its cache is not the machine's.

How: the child runs ``bench_radix``'s request cycle (same workload, same order) under
``valgrind --tool=callgrind --toggle-collect=_operator_call``, and routes the one counted op
through ``operator.call`` (a C function of CPython's; nothing else in the cycle calls it), so
events are collected inside those calls only. Collection is off everywhere else (workload set-up,
the other ops, the driver's glue), but their effect on the caches is simulated.

    python benchmarks/count_radix.py [--op match_prefix] [--page-size 1] [--requests 2000]
                                     [--out callgrind.out]

Prints one JSON document: events per call (``Ir`` instructions, ``I1mr`` / ``D1mr`` first-level
misses, ``DLmr`` / ``DLmw`` misses of the simulated 2 MiB last level), the call count, and the
functions with the most self instructions, per call, when ``callgrind_annotate`` is on the PATH.
Needs valgrind and a CPython whose libpython keeps its static symbols.
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import shutil
import subprocess
import sys
import tempfile

OPS = ("match_prefix", "insert", "lock", "unlock", "evict")
CACHE_ARGS = ["--cache-sim=yes", "--I1=65536,16,64", "--D1=49152,12,64", "--LL=2097152,16,64"]


def parse_callgrind(text: str) -> dict[str, int]:
    """The ``events:`` names and ``totals:`` (or ``summary:``) counts of a callgrind out file."""
    names: list[str] = []
    totals: list[int] = []
    for line in text.splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("totals:", "summary:")) and not totals:
            totals = [int(x) for x in line.split()[1:]]
    if not names or not totals or len(totals) > len(names):
        raise ValueError("not a callgrind out file (no events / totals line)")
    totals += [0] * (len(names) - len(totals))
    return dict(zip(names, totals))


def per_call(totals: dict[str, int], calls: int) -> dict[str, float]:
    """Each event divided by ``calls`` (one decimal)."""
    if calls <= 0:
        raise ValueError("no counted calls")
    return {k: round(v / calls, 1) for k, v in totals.items()}


def top_functions(out_file: str, calls: int, limit: int = 12) -> list[dict[str, object]]:
    """The functions with the most self instructions, their events per counted call (needs
    ``callgrind_annotate``; ``[]`` without it)."""
    exe = shutil.which("callgrind_annotate")
    if exe is None:
        return []
    text = subprocess.run([exe, "--show=Ir,I1mr,DLmr", "--threshold=100", out_file],
                          capture_output=True, text=True, check=False).stdout
    rows: list[dict[str, object]] = []
    started = False
    for line in text.splitlines():
        if "file:function" in line:
            started = True
            continue
        if not started or not line.strip() or line.startswith("-"):
            if started and rows and not line.strip():
                break
            continue
        parts = line.split()
        nums = [p for p in parts if p.replace(",", "").isdigit()]
        if len(nums) < 3:
            continue
        func = parts[-1] if "[" not in parts[-1] else parts[-2]
        ir, i1, dl = (int(x.replace(",", "")) / calls for x in nums[:3])
        rows.append({"function": func.split(":")[-1], "Ir": round(ir, 1), "I1mr": round(i1, 1),
                     "DLmr": round(dl, 1)})
        if len(rows) >= limit:
            break
    return rows


def counting_timer(op: str, calls: list[int]):
    """An ``op_timer`` stand-in for ``bench_radix.cycle``: the counted op runs inside
    ``operator.call`` (collection on), every other op is called plainly; nothing is timed."""
    call = getattr(operator, "call", None)  # Python 3.11+
    if call is None:
        raise RuntimeError("count_radix.py needs Python 3.11 or later (it counts inside operator.call)")

    def factory(ops):
        wall: dict[str, list[int]] = {o: [] for o in ops}
        cpu: dict[str, list[int]] = {o: [] for o in ops}

        def timed(name, fn, *args):
            if name == op:
                calls[0] += 1
                return call(fn, *args)
            return fn(*args)
        return wall, cpu, timed
    return factory


def run_child(op: str, page_size: int, requests: int, pool: int, seed: int) -> int:
    """Run the cycle once with ``op`` routed through ``operator.call``; returns its call count."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import bench_radix as br
    import torch

    from radixkv.cache import RadixCache

    torch.set_num_threads(1)
    work = br.make_workload(requests, seed)
    alloc = br._allocator(pool, page_size)
    timer = br.FreeTimer(alloc)
    cache = RadixCache(None, timer, page_size=page_size)
    keys = br.build_keys(work, page_size, False)
    calls = [0]
    br.cycle(keys, page_size, timer, timer, cache.match_prefix, br._split_radixkv, cache.inc_lock_ref,
             cache.dec_lock_ref, cache.evict, cache.insert, timing=counting_timer(op, calls))
    return calls[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", choices=OPS, default="match_prefix")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--pool", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also keep callgrind's out file here (for callgrind_annotate)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps({"calls": run_child(args.op, args.page_size, args.requests, args.pool, args.seed)}))
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print(json.dumps({"status": "skipped", "reason": "valgrind is not on the PATH"}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = [valgrind, "--tool=callgrind", *CACHE_ARGS, "--toggle-collect=_operator_call",
               f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__), "--child",
               "--op", args.op, "--page-size", str(args.page_size), "--requests", str(args.requests),
               "--pool", str(args.pool), "--seed", str(args.seed)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            return proc.returncode
        calls = json.loads(proc.stdout.strip().splitlines()[-1])["calls"]
        with open(out) as f:
            totals = parse_callgrind(f.read())
        if args.out:
            shutil.copyfile(out, args.out)
        if totals.get("Ir", 0) == 0:
            print(json.dumps({"status": "failed", "reason": "nothing collected: does libpython keep "
                              "the _operator_call symbol?"}))
            return 1
        print(json.dumps({"benchmark": "radix_cache_counts", "op": args.op, "page_size": args.page_size,
                          "requests": args.requests, "seed": args.seed, "calls": calls,
                          "caches": CACHE_ARGS[1:], "per_call": per_call(totals, calls),
                          "top_functions": top_functions(out, calls)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
