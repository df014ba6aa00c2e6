"""The ``radixkv`` command line.

* ``radixkv demo``: the main job (a cache manager + worker processes running the reference
  hybrid model over the bundled Mooncake trace; ``--embedded``: one process;
  ``--walkthrough``: the pools' state through one extend -> decode -> release cycle);
* ``radixkv bench NAME ...``: every benchmark (:mod:`radixkv.bench.cli`: ``hitrate``,
  ``radix``, ``allocator``, ``service``, ``mamba``);
* ``radixkv serve ...``: the cache-manager gRPC service (``radixkv.service.server.cli``).

``bench`` and ``serve`` take over the rest of the command line and are imported only when
used; ``radixkv demo --embedded`` / ``--walkthrough`` never start a server.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (``bench`` / ``serve`` are listed; their options are parsed
    by their own modules)."""
    parser = argparse.ArgumentParser(prog="radixkv", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_demo = sub.add_parser("demo", help="the main job: a cache manager and worker processes running a hybrid "
                                         "model over the Mooncake trace (--embedded: one process)")
    p_demo.add_argument("--device", default="cpu")
    p_demo.add_argument("--embedded", action="store_true", help="run the same job in one process (CacheEngine)")
    p_demo.add_argument("--requests", type=int, default=120, help="first N trace requests (default %(default)s)")
    p_demo.add_argument("--workers", type=int, default=2, help="worker processes (default %(default)s)")
    p_demo.add_argument("--decode-tokens", type=int, default=4,
                        help="greedy decode tokens per request (default %(default)s)")
    p_demo.add_argument("--tokens-per-block", type=int, default=16,
                        help="pseudo-tokens per 512-token trace block (default %(default)s)")
    p_demo.add_argument("--verify-every", type=int, default=1,
                        help="check every N-th request of a worker against forward_reference; 0: none "
                             "(default %(default)s)")
    p_demo.add_argument("--walkthrough", action="store_true",
                        help="the embedded extend -> decode -> release walk-through instead")
    sub.add_parser("bench", add_help=False,
                   help="benchmarks: hitrate | radix | allocator | service | mamba ('radixkv bench -h')")
    sub.add_parser("serve", add_help=False, help="run the cache-manager gRPC service ('radixkv serve -h')")
    return parser


def run_serve(argv: list[str]) -> int:
    """``radixkv serve``: the service's own flags (``add_serve_arguments``) and runner."""
    from radixkv.service.server.cli import add_serve_arguments
    from radixkv.service.server.cli import run_serve as _run

    parser = argparse.ArgumentParser(prog="radixkv serve", description="run the cache-manager gRPC service")
    add_serve_arguments(parser)
    return int(_run(parser.parse_args(argv)) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from radixkv.bench.cli import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "serve":
        return run_serve(argv[1:])
    args = build_parser().parse_args(argv)
    if args.cmd == "demo":
        from radixkv.demo import run_demo, run_walkthrough
        from radixkv.errors import InvalidArgumentError

        if args.walkthrough:
            return run_walkthrough(args.device)
        try:
            return run_demo(embedded=args.embedded, requests=args.requests, device=args.device,
                            decode_tokens=args.decode_tokens, tokens_per_block=args.tokens_per_block,
                            workers=args.workers, verify_every=args.verify_every)
        except InvalidArgumentError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
