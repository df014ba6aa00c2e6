"""The host state tier's copies: ``HostStatePool.store`` (device -> host, a demotion) and
``load`` (host -> device, a load back) of Mamba states, beside a plain ``torch`` copy of the
same bytes between two contiguous tensors, in the same run (median of ``--repeat`` runs).

    .venv/bin/python benchmarks/bench_host_states.py [--device cpu|cuda] [--batch 1,16]

One state is ``--layers`` KDA layers of ``--heads`` x ``--head-dim`` x ``--head-dim``
temporal state plus the conv window (kernel 4), fp32. Prints one markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixkv.memory import KimiLinearStateShape, MambaPool
from radixkv.memory.host_state_pool import HostStatePool


def _median_s(fn, repeat: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    n = max(batches)
    shape = KimiLinearStateShape.create(num_heads=args.heads, head_dim=args.head_dim, conv_kernel_size=4)
    pool = MambaPool.from_state_shape(n, shape, args.layers, torch.float32, args.device)
    host = HostStatePool(pool, n)
    mib = host.slot_bytes / 2**20
    print(f"state: {args.layers} layers x {args.heads} heads x {args.head_dim}^2 + conv = {mib:.2f} MiB, "
          f"device {args.device}, pinned host memory: {host.pinned}")
    print("| states | store ms | load ms | torch copy ms (same bytes) | store / copy | load / copy |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        slots = list(range(1, b + 1))
        src = torch.zeros(b * host.slot_bytes // 4, dtype=torch.float32, device=args.device)
        dst = torch.empty(src.shape, dtype=torch.float32, pin_memory=host.pinned)
        store = _median_s(lambda s=slots: host.store(s, s), args.repeat)
        load = _median_s(lambda s=slots: host.load(s, s), args.repeat)
        copy = _median_s(lambda a=dst, b=src: a.copy_(b), args.repeat)
        print(f"| {b} | {store * 1e3:.3f} | {load * 1e3:.3f} | {copy * 1e3:.3f} | {store / copy:.2f} | "
              f"{load / copy:.2f} |")


if __name__ == "__main__":
    main()
