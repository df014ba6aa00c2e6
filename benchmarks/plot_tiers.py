"""Hit rate against device capacity with and without the host and storage tiers (docs/tiers.md).

For each device capacity C (a fraction of the trace's unique prompt tokens) three replays through
the real tiered RadixCache (``radixkv bench hitrate --engine radix``): device only at C; device C
plus a host tier of ``--host-ratio`` x C (write-back); and the same plus an unbounded storage
tier. Writes one JSON document (``--json``) and a PNG plot (``--plot``). Deterministic: the
figures depend on the trace and capacities only, never on timing.

    python benchmarks/plot_tiers.py --json build/tiers_curve.json --plot docs/tiers_conversation.png
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CONFIGS = ("device", "device+host", "device+host+storage")


def replay(trace: str, device: float, host: float | None, storage: str | None) -> dict[str, Any]:
    """One ``bench hitrate`` replay; returns its single result row (with the bounds beside it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "radixkv", "bench", "hitrate", "--trace", trace, "--engine", "radix",
               "--capacity-frac", str(device), "--no-progress", "--json", str(out), "--plot", str(Path(tmp) / "p.png")]
        if host is not None:
            cmd += ["--host-capacity-frac", str(host)]
        if storage is not None:
            cmd += ["--storage-capacity-frac", storage]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        doc = json.loads(out.read_text())
    row: dict[str, Any] = doc["results"][0]
    row["bounds"] = doc["bounds"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="conversation")
    ap.add_argument("--device-fracs", default="0.01,0.02,0.05,0.1")
    ap.add_argument("--host-ratio", type=float, default=4.0, help="host tier = this x device capacity")
    ap.add_argument("--json", dest="json_out", required=True)
    ap.add_argument("--plot", required=True)
    args = ap.parse_args(argv)
    fracs = [float(f) for f in args.device_fracs.split(",")]
    curves: dict[str, list[float]] = {c: [] for c in CONFIGS}
    bounds: dict[str, Any] = {}
    for c in fracs:
        host = min(1.0, args.host_ratio * c)
        for name, h, s in (("device", None, None), ("device+host", host, None),
                           ("device+host+storage", host, "inf")):
            row = replay(args.trace, c, h, s)
            curves[name].append(row["token_hit_rate"])
            bounds = row["bounds"]
            print(f"device {c:g} {name}: {100 * row['token_hit_rate']:.2f}% "
                  f"(tiers {row.get('tier_hit_rates')})", file=sys.stderr)
    doc = {"trace": args.trace, "host_ratio": args.host_ratio, "device_fracs": fracs, "hit_rates": curves,
           "bounds": bounds}
    Path(args.json_out).write_text(json.dumps(doc, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in CONFIGS:
        ax.plot([100 * f for f in fracs], [100 * r for r in curves[name]], marker="o", label=name)
    inf = bounds.get("infinite_capacity")
    if isinstance(inf, (int, float)):
        ax.axhline(100 * inf, color="grey", linestyle="--", label="infinite capacity")
    ax.set_xscale("log")
    ax.set_xlabel(f"device capacity, % of unique prompt tokens (host = {args.host_ratio:g}x device)")
    ax.set_ylabel("token hit rate, %")
    ax.set_title(f"{args.trace} trace: hit rate by tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
