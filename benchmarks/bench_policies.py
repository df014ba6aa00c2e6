"""``benchmarks/bench_policies.py``: ``radixkv bench hitrate`` (exactly its flags) with the block-level
research policies of ``benchmarks/policy_research`` available to the simulator
(``--engine blocksim``, the default): slru (the queue design), 2q, s3fifo, arc, wtinylfu,
lru2, probation, aplru (the block design the RadixCache's aplru was ported from) and odlru.
Other names are the RadixCache's policies (lru, lfu, fifo, ...), run on blocks. With
``--engine radix`` every name is the RadixCache's.

    python benchmarks/bench_policies.py --trace conversation --policy lru,2q,aplru --json c.json
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from policy_research import make_block_policy  # noqa: E402

from radixkv.bench.cli import run_hitrate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return run_hitrate(list(args), make_block_policy=make_block_policy, prog="benchmarks/bench_policies.py")


if __name__ == "__main__":
    sys.exit(main())
