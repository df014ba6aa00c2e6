"""``radixkv bench``: the benchmarks that ship with the package.

* ``radixkv bench hitrate ...``: the hit-rate replay (:mod:`radixkv.bench.hitrate`, exactly
  its flags), with the RadixCache engine registered (``--engine radix``) and
  ``--policy default`` naming the RadixCache's default policy; torch runs single-threaded
  (the engine's per-request tensors are small, extra threads only contend);
* ``radixkv bench cluster ...``: N managers behind a KV-aware router (:mod:`radixkv.bench.cluster`).

The other benchmarks (latency, allocator, service, Mamba, SGLang and vLLM comparisons,
policy research) are scripts of a source checkout: ``python benchmarks/bench_NAME.py``. Run
from a checkout (or an editable install of one), ``radixkv bench NAME`` runs them too and the
help lists them; an installed wheel neither lists nor offers them.

Exit code: the benchmark's (2 for a usage error here).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.block_policy import BlockPolicy

__all__ = ["SCRIPTS", "SUBCOMMANDS", "checkout_benchmarks", "resolve_policies", "run_hitrate", "main"]

SUBCOMMANDS = ("hitrate", "cluster")
#: checkout-only verb -> (script in ``benchmarks/``, what it measures)
SCRIPTS: dict[str, tuple[str, str]] = {
    "radix": ("bench_radix.py", "RadixCache per-op latency, hit rate and memory"),
    "allocator": ("bench_allocator.py", "KV allocator alloc/free cost"),
    "service": ("bench_service.py", "the gRPC cache manager vs the embedded engine"),
    "mamba": ("bench_mamba.py", "MambaRadixCache latency and state-hit rates"),
    "vs-sglang": ("bench_vs_sglang.py", "SGLang's caches beside radixkv's in one run"),
    "policies": ("bench_policies.py", "the block-level research policies on the simulator"),
    "vllm": ("bench_vllm.py", "vLLM instances: own prefix caching vs the radixkv connector"),
}


def checkout_benchmarks() -> str | None:
    """``benchmarks/`` beside the package when it runs from a source checkout, else None."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(here, "benchmarks")
    return path if os.path.isfile(os.path.join(path, SCRIPTS["radix"][0])) else None

_HELP = """usage: radixkv bench {hitrate,cluster} [options]

  hitrate    prefix hit rate of eviction policies on traces / workloads
             (--engine blocksim | radix; --hybrid: the MambaRadixCache)
  cluster    N managers behind a KV-aware router (Dynamo's RadixTree) vs round robin on a
             Mooncake trace

'radixkv bench NAME --help' shows the options of NAME. The other benchmarks (per-op
latency, allocator, service, Mamba, SGLang and vLLM side by side, policy research) are
scripts of a source checkout: python benchmarks/bench_NAME.py --help.
"""


def resolve_policies(text: str) -> str:
    """``--policy`` with ``default`` replaced by the RadixCache's default policy name."""
    from radixkv.bench.radix_engine import default_policy_name

    names = [p.strip() for p in text.split(",") if p.strip()]
    return ",".join(default_policy_name() if p.lower() == "default" else p for p in names)


def run_hitrate(argv: list[str], make_block_policy: Callable[[str], BlockPolicy] | None = None,
                prog: str = "radixkv bench hitrate") -> int:
    """``radixkv bench hitrate``: parse :func:`radixkv.bench.hitrate.add_arguments`'s flags
    and run it. Policies of ``--engine radix`` are checked before any work.
    ``make_block_policy``: the simulator's policy by name (default: the RadixCache's;
    ``benchmarks/bench_policies.py`` passes the research registry's)."""
    from radixkv.bench import hitrate, radix_engine
    from radixkv.errors import RadixKVError

    parser = argparse.ArgumentParser(prog=prog, description=hitrate.DESCRIPTION)
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


def _help(bench_dir: str | None) -> str:
    if bench_dir is None:
        return _HELP
    rows = "".join(f"  {name:<10} {what} (benchmarks/{script})\n" for name, (script, what) in SCRIPTS.items())
    return _HELP + "\nFrom this source checkout also:\n" + rows


def main(argv: list[str] | None = None) -> int:
    """``radixkv bench NAME [options]``; see the module docstring."""
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_dir = checkout_benchmarks()
    if not argv or argv[0] in ("-h", "--help"):
        print(_help(bench_dir), end="")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "hitrate":
        return run_hitrate(rest)
    if name == "cluster":
        from radixkv.bench import cluster

        return cluster.main(rest)
    if name in SCRIPTS and bench_dir is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        return subprocess.call([sys.executable, os.path.join(bench_dir, SCRIPTS[name][0]), *rest])
    offered = SUBCOMMANDS + (tuple(SCRIPTS) if bench_dir is not None else ())
    print(f"radixkv bench: unknown benchmark {name!r}; choose from {', '.join(offered)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
