"""The ``radixkv`` command line: ``radixkv demo`` (more sub-commands join as they land)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_demo = sub.add_parser("demo", help="an embedded extend -> decode -> release walk-through")
    p_demo.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from radixkv.demo import run_demo

        return run_demo(device=args.device)
    return 2


if __name__ == "__main__":
    sys.exit(main())
