"""``radixkv bench``: one front door to every benchmark.

* ``radixkv bench hitrate ...``: the hit-rate replay (:mod:`radixkv.bench.hitrate`, exactly
  its flags), with the RadixCache engine registered (``--engine radix``) and
  ``--policy default`` naming the RadixCache's default policy; torch runs single-threaded
  (the engine's per-request tensors are small, extra threads only contend);
* ``radixkv bench radix | allocator | service | mamba | vs-sglang | policies | vllm [...]``: the scripts
  ``benchmarks/bench_<name>.py`` of a source checkout, run as they are (their own
  ``main``, flags, tables and JSON output), in a child interpreter: the service
  benchmark spawns worker processes that must be able to import the script's functions.

Exit code: the benchmark's (2 for a usage error here).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable

__all__ = ["SCRIPTS", "SUBCOMMANDS", "benchmarks_dir", "resolve_policies", "run_hitrate", "run_script", "main"]

#: sub-command -> script in ``benchmarks/``
SCRIPTS: dict[str, str] = {
    "radix": "bench_radix.py",
    "allocator": "bench_allocator.py",
    "service": "bench_service.py",
    "mamba": "bench_mamba.py",
    "vs-sglang": "bench_vs_sglang.py",
    "policies": "bench_policies.py",
    "vllm": "bench_vllm.py",
}
SUBCOMMANDS = ("hitrate", "cluster") + tuple(SCRIPTS)

_HELP = """usage: radixkv bench {hitrate,cluster,radix,allocator,service,mamba,vs-sglang,policies,vllm} [options]

  hitrate    prefix hit rate of eviction policies on traces / workloads (radixkv.bench.hitrate;
             --engine blocksim | radix)
  cluster    N managers behind a KV-aware router (Dynamo's RadixTree) vs round robin on a
             Mooncake trace (radixkv.bench.cluster)
  radix      RadixCache per-op latency, hit rate and memory (benchmarks/bench_radix.py)
  allocator  KV allocator alloc/free cost (benchmarks/bench_allocator.py)
  service    gRPC cache-manager service vs the embedded engine (benchmarks/bench_service.py)
  mamba      MambaRadixCache latency and state-hit rates (benchmarks/bench_mamba.py)
  vs-sglang  SGLang's own RadixCache / MambaRadixCache beside radixkv's in one run
             (benchmarks/bench_vs_sglang.py; --sglang-path DIR, see `make bench-sglang`)
  policies   hitrate's flags, plus the block-level research policies (2q, s3fifo, arc,
             wtinylfu, lru2, probation, odlru; slru / aplru: their block designs) on the
             simulator (benchmarks/bench_policies.py)
  vllm       2 vLLM instances behind a round-robin router on a multi-turn trace: vLLM's own
             prefix caching vs the radixkv connector (one shared manager) vs LMCache, against
             the single-shared-cache bound (benchmarks/bench_vllm.py; run with .venv-vllm, see `make setup-vllm`)

'radixkv bench NAME --help' shows the options of NAME.
"""


def benchmarks_dir() -> str:
    """``benchmarks/`` beside the package (a source checkout or an editable install)."""
    import radixkv

    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(radixkv.__file__))), "benchmarks")


def resolve_policies(text: str) -> str:
    """``--policy`` with ``default`` replaced by the RadixCache's default policy name."""
    from radixkv.bench.radix_engine import default_policy_name

    names = [p.strip() for p in text.split(",") if p.strip()]
    return ",".join(default_policy_name() if p.lower() == "default" else p for p in names)


def run_hitrate(argv: list[str], make_block_policy: Callable | None = None,
                prog: str = "radixkv bench hitrate") -> int:
    """``radixkv bench hitrate``: parse :func:`radixkv.bench.hitrate.add_arguments`'s flags
    and run it. Policies of ``--engine radix`` are checked before any work.
    ``make_block_policy``: the simulator's policy by name (default: the RadixCache's;
    ``benchmarks/bench_policies.py`` passes the research registry's)."""
    from radixkv.bench import hitrate, radix_engine
    from radixkv.errors import RadixKVError

    parser = argparse.ArgumentParser(prog=prog, description=hitrate.__doc__.split("\n")[0])
    hitrate.add_arguments(parser)
    args = parser.parse_args(argv)
    args.policy = resolve_policies(args.policy)
    import torch

    torch.set_num_threads(1)   # per-request tensors are small: threads only contend
    if args.engine == "radix":
        try:
            for p in args.policy.split(","):
                radix_engine.make_radix_policy(p, 1)
        except RadixKVError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if make_block_policy is None:
        return int(hitrate.run(args) or 0)
    return int(hitrate.run(args, make_block_policy) or 0)


def run_script(name: str, argv: list[str]) -> int:
    """Run ``benchmarks/bench_<name>.py`` with ``argv`` in a child interpreter (stdout and
    stderr are the caller's); returns its exit code, 2 when the script is missing."""
    path = os.path.join(benchmarks_dir(), SCRIPTS[name])
    if not os.path.isfile(path):
        print(f"radixkv bench {name}: {path} not found (the benchmarks ship with the source "
              f"checkout, not the wheel)", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    return subprocess.call([sys.executable, path, *argv])


def main(argv: list[str] | None = None) -> int:
    """``radixkv bench NAME [options]``; see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_HELP, end="")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "hitrate":
        return run_hitrate(rest)
    if name == "cluster":
        from radixkv.bench import cluster

        return cluster.main(rest)
    if name in SCRIPTS:
        return run_script(name, rest)
    print(f"radixkv bench: unknown benchmark {name!r}; choose from {', '.join(SUBCOMMANDS)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
