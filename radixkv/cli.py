"""The ``radixkv`` command line.

* ``radixkv demo``: the main job (a cache manager + worker processes running the reference
  hybrid model over the bundled Mooncake trace; ``--embedded``: one process;
  ``--walkthrough``: the pools' state through one extend -> decode -> release cycle);
* ``radixkv bench hitrate | cluster ...``: the benchmarks that ship with the package
  (:mod:`radixkv.bench.cli`; the others are ``benchmarks/`` scripts of a source checkout);
* ``radixkv serve ...``: the cache-manager gRPC service (``radixkv.service.server.cli``).

``bench`` and ``serve`` take over the rest of the command line and are imported only when
used; ``radixkv demo --embedded`` / ``--walkthrough`` never start a server.
"""
from __future__ import annotations

import argparse
import sys

#: The demo's defaults (radixkv.demo.job.run_demo's), here so that the parser loads no torch.
DEMO_DEFAULTS = {"requests": 96, "tokens_per_block": 16, "page_size": 16}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (``bench`` / ``serve`` are listed; their options are parsed
    by their own modules)."""
    from radixkv import __version__

    parser = argparse.ArgumentParser(
        prog="radixkv", description="radixkv: a prefix (KV) cache manager for LLM serving.",
        epilog="'radixkv COMMAND --help' shows the options of COMMAND.")
    parser.add_argument("--version", action="version", version=f"radixkv {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{demo,bench,serve}")
    p_demo = sub.add_parser("demo", help="the main job: a cache manager and worker processes running a hybrid "
                                         "model over a multi-turn conversation trace (--embedded: one process)",
                            description="A cache manager and worker processes run a tiny hybrid model over "
                                        "multi-turn conversations of the bundled Mooncake trace; the table "
                                        "shows the prefix hit rate beside its bound, the prefill computation "
                                        "saved, and how many requests' logits equal a from-scratch run.",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p_demo.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p_demo.add_argument("--embedded", action="store_true", help="run the same job in one process (CacheEngine)")
    p_demo.add_argument("--requests", type=int, default=DEMO_DEFAULTS["requests"],
                        help="requests of the chosen conversations")
    p_demo.add_argument("--workers", type=int, default=2, help="worker processes")
    p_demo.add_argument("--decode-tokens", type=int, default=4, help="greedy decode tokens per request")
    p_demo.add_argument("--tokens-per-block", type=int, default=DEMO_DEFAULTS["tokens_per_block"],
                        help="pseudo-tokens per 512-token trace block")
    p_demo.add_argument("--page-size", type=int, default=DEMO_DEFAULTS["page_size"],
                        help="tokens per KV page of the cache")
    p_demo.add_argument("--verify-every", type=int, default=1,
                        help="check every N-th request of a worker against a from-scratch forward; 0: none")
    p_demo.add_argument("--walkthrough", action="store_true",
                        help="the embedded extend -> decode -> release walk-through instead")
    sub.add_parser("bench", add_help=False,
                   help="the packaged benchmarks: hitrate | cluster ('radixkv bench --help')")
    sub.add_parser("serve", add_help=False, help="run the cache-manager gRPC service ('radixkv serve --help')")
    return parser


def run_serve(argv: list[str]) -> int:
    """``radixkv serve``: the service's own flags (``add_serve_arguments``) and runner."""
    from radixkv.service.server.cli import add_serve_arguments
    from radixkv.service.server.cli import run_serve as _run

    parser = argparse.ArgumentParser(
        prog="radixkv serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the cache-manager gRPC service: worker processes attach to it (radixkv.connect)\n"
                    "and share one prefix cache, mapping its KV pool zero-copy. The engine comes from\n"
                    "--config and the engine flags; the token from --token-file, --token or $RADIXKV_TOKEN\n"
                    "(at least 8 characters).")
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
        from radixkv.demo.job import run_demo, run_walkthrough
        from radixkv.errors import InvalidArgumentError

        if args.walkthrough:
            return run_walkthrough(args.device)
        try:
            return run_demo(embedded=args.embedded, requests=args.requests, device=args.device,
                            decode_tokens=args.decode_tokens, tokens_per_block=args.tokens_per_block,
                            page_size=args.page_size,
                            workers=args.workers, verify_every=args.verify_every)
        except InvalidArgumentError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
