"""Prefix hit-rate replay: a driver over any cache, bounds, and the ``radixkv bench hitrate`` CLI.

:func:`replay` drives a :class:`ReplayCache` per request: ``match_prefix`` (hit tokens,
protects the prefix), ``evict`` the shortfall, ``insert`` (caches what fits, releases).
:data:`ENGINES` names the engines (``blocksim`` through :class:`BlockSimAdapter`, ``radix``
through :mod:`radixkv.bench.radix_engine`); :func:`register_engine` adds others; the CLI's
``blocksim`` fast path is tested equal to the driver. Capacity is a fraction of the
stream's unique prompt tokens; hit rate = matched / all prompt tokens. Bounds: infinite
capacity and Belady. ``--hybrid`` replays through the MambaRadixCache
(:mod:`radixkv.bench.hybrid_report`). The protocol: ``docs/hitrate.md``, "The replay driver".
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol, cast

import numpy as np

from radixkv.bench.belady import belady
from radixkv.bench.block_policy import BlockPolicy
from radixkv.bench.blocksim import BlockSim, make_policy, simulate
from radixkv.bench.progress import Progress, ProgressBar
from radixkv.bench.radix_engine import RadixReplayEngine, default_policy_name
from radixkv.bench.traces import MOONCAKE_BLOCK_SIZE, BlockTrace, load_mooncake
from radixkv.bench.workloads import WORKLOADS, make_workload
from radixkv.errors import InvalidArgumentError, RadixKVError

#: What ``radixkv bench hitrate --help`` says it does.
DESCRIPTION = ("Prefix hit rate (matched prompt tokens / all prompt tokens) of eviction policies, replayed "
               "over a Mooncake trace or a generated workload at capacities given as fractions of the "
               "stream's unique prompt tokens, beside the infinite-capacity and Belady bounds.")

__all__ = ["DESCRIPTION", "ReplayCache", "ReplayResult", "BlockSimAdapter", "replay", "register_engine",
           "ENGINES", "Source", "load_source", "measure", "add_arguments", "run", "main"]


class ReplayCache(Protocol):
    """What :func:`replay` needs from a cache (token counts throughout)."""

    capacity: int

    @property
    def used_tokens(self) -> int: ...

    def match_prefix(self, tokens: np.ndarray) -> int: ...

    def evict(self, n_tokens: int) -> int: ...

    def insert(self, tokens: np.ndarray) -> int: ...


class ReplayResult(NamedTuple):
    requests: int
    prompt_tokens: int
    hit_tokens: int
    evicted_tokens: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay(requests: Iterable[np.ndarray], cache: ReplayCache, progress: ProgressBar | None = None) -> ReplayResult:
    """Drive ``cache`` with each prompt in order (see the module docstring)."""
    n = prompt = hit = evicted = 0
    for toks in requests:
        h = int(cache.match_prefix(toks))
        short = (len(toks) - h) - (cache.capacity - cache.used_tokens)
        if short > 0:
            evicted += int(cache.evict(short))
        cache.insert(toks)
        n += 1
        prompt += len(toks)
        hit += h
        if progress is not None:
            progress.update(1)
    return ReplayResult(n, prompt, hit, evicted)


class BlockSimAdapter:
    """:class:`ReplayCache` over :class:`~radixkv.bench.blocksim.BlockSim`: prompts are cut
    into ``page_size`` blocks with chained ids (a dict keyed by (parent id, block bytes):
    one probe per block), new ids are registered with the simulator.

    Raises (``insert``): InvalidArgumentError when called without a matching
    ``match_prefix`` of the same tokens.
    """

    def __init__(self, capacity_tokens: int, policy: str | BlockPolicy = "lru", page_size: int = 16):
        if int(page_size) < 1:
            raise InvalidArgumentError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        pol = make_policy(policy) if isinstance(policy, str) else policy
        self.sim = BlockSim(np.zeros(0, np.int64), np.zeros(0, np.int32), capacity_tokens, pol)
        self.capacity = self.sim.capacity
        self._table: dict[tuple[int, bytes], int] = {}  # (parent id, block bytes) -> id
        self._pending: tuple[np.ndarray, np.ndarray, int] | None = None

    @property
    def used_tokens(self) -> int:
        return self.sim.used

    def block_ids(self, tokens: np.ndarray) -> np.ndarray:
        """Chained block ids of ``tokens`` (registering unseen blocks)."""
        if not isinstance(tokens, np.ndarray) or tokens.dtype != np.int32 or tokens.ndim != 1:
            raise InvalidArgumentError("tokens must be a 1-D int32 numpy array")
        p, raw, table = self.page_size, tokens.tobytes(), self._table
        ids: list[int] = []
        new_len: list[int] = []
        new_par: list[int] = []
        prev = -1
        nxt = self.sim.n_valid
        for s in range(0, len(tokens), p):
            key = (prev, raw[4 * s: 4 * (s + p)])
            b = table.get(key)
            if b is None:
                b = table[key] = nxt + len(new_len)
                new_len.append(min(p, len(tokens) - s))
                new_par.append(prev)
            ids.append(b)
            prev = b
        if new_len:
            self.sim.add_blocks(new_len, new_par)
        return np.asarray(ids, dtype=np.int64)

    def match_prefix(self, tokens: np.ndarray) -> int:
        if self._pending is not None:
            raise InvalidArgumentError("match_prefix called twice without insert")
        ids = self.block_ids(tokens)
        k = self.sim.begin(ids)
        self._pending = (tokens, ids, k)
        return int(self.sim.block_len[ids[:k]].sum())

    def evict(self, n_tokens: int) -> int:
        return self.sim.evict(int(n_tokens))

    def insert(self, tokens: np.ndarray) -> int:
        if self._pending is None or self._pending[0] is not tokens:
            raise InvalidArgumentError("insert must follow match_prefix of the same tokens")
        _, ids, k = self._pending
        self._pending = None
        return self.sim.finish(ids, k)

    def check_invariants(self) -> None:
        self.sim.check_invariants()


EngineFactory = Callable[[int, str, int], ReplayCache]
BlockPolicyFactory = Callable[[str], BlockPolicy]
#: ``--engine`` name -> ``factory(capacity_tokens, policy, page_size)``.
ENGINES: dict[str, EngineFactory] = {
    "blocksim": lambda cap, policy, page: BlockSimAdapter(cap, policy, page),
    "radix": lambda cap, policy, page: RadixReplayEngine(cap, policy, page),
}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Make ``--engine name`` available (e.g. the RadixCache adapter)."""
    ENGINES[name] = factory


# ---------------------------------------------------------------------- sources
class Source(NamedTuple):
    """A request stream ready to measure: name, lazy token iterator factory, its block view
    at the cache's page size, token-level totals."""

    name: str
    n_requests: int
    tokens: Callable[[], Iterable[np.ndarray]]
    blocks: BlockTrace
    prompt_tokens: int
    unique_tokens: int
    page_size: int


def load_source(trace: str | None = None, workload: str | None = None, block_size: int = MOONCAKE_BLOCK_SIZE,
                page_size: int | None = None, limit: int | None = None, seed: int = 0) -> Source:
    """A Mooncake trace (a JSONL path, or ``conversation`` / ``synthetic`` for the bundled
    ones; ``page_size`` divides ``block_size``, default ``block_size``) or a generated
    workload (``page_size`` default 16; ``limit`` = number of requests).

    Raises:
        InvalidArgumentError: neither or both of ``trace`` / ``workload``; bad sizes.
    """
    if (trace is None) == (workload is None):
        raise InvalidArgumentError("give exactly one of --trace or --workload")
    if trace is not None:
        if not os.path.isfile(trace) and trace in ("conversation", "synthetic"):
            from radixkv.data import mooncake_trace

            trace = str(mooncake_trace(trace))               # the bundled copy
        tr = load_mooncake(trace, limit=limit, block_size=block_size)
        page = block_size if page_size is None else int(page_size)
        bt = tr.block_trace().rechunk(page)
        return Source(tr.name, len(tr), tr.iter_tokens, bt, tr.prompt_tokens, tr.unique_tokens, page)
    wl = make_workload(cast(str, workload), n_requests=limit, seed=seed)  # exactly one was given
    page = 16 if page_size is None else int(page_size)
    bt = BlockTrace.from_token_requests(wl.requests, page)
    return Source(f"{wl.name}(seed={seed})", len(wl.requests), lambda: iter(wl.requests), bt,
                  wl.prompt_tokens, wl.unique_tokens, page)


def _frac_key(f: float) -> str:
    return f"{f:g}"


def measure(src: Source, fracs: list[float], policies: list[str], engine: str = "blocksim",
            show_progress: bool | None = None, make_block_policy: BlockPolicyFactory = make_policy,
            host_frac: float | None = None, storage_frac: float | None = None,
            write_policy: str = "write_back") -> dict[str, Any]:
    """Bounds and every (policy, capacity) result as the CLI's JSON document.
    ``make_block_policy(name)``: the ``blocksim`` engine's policy for a name (default: the
    RadixCache's policy of that name, :func:`radixkv.bench.blocksim.make_policy`).
    ``host_frac`` (engine ``radix``): a host tier of that fraction of the unique tokens
    behind the device (:mod:`radixkv.bench.tier_engine`); ``storage_frac`` a storage tier
    behind it (``math.inf``: unbounded); ``write_policy`` the host tier's. Each row gives
    ``tier_hit_rates``."""
    check_tier_write_policy(write_policy, host_frac)
    if host_frac is None and storage_frac is not None:
        raise InvalidArgumentError("--storage-capacity-frac needs --host-capacity-frac (storage sits behind the host)")
    if host_frac is not None and engine != "radix":
        raise InvalidArgumentError("--host-capacity-frac replays through the tiered RadixCache: use --engine radix")
    bt = src.blocks
    doc: dict[str, Any] = {
        "trace": src.name,
        "engine": engine,
        "page_size": src.page_size,
        "requests": src.n_requests,
        "prompt_tokens": src.prompt_tokens,
        "unique_tokens": src.unique_tokens,
        "bounds": {
            "infinite_capacity": bt.infinite_hit_tokens() / src.prompt_tokens,
            "belady": {_frac_key(f): belady(bt, int(f * src.unique_tokens)).token_hit_rate for f in fracs},
        },
        "results": [],
    }
    if engine not in ENGINES:
        raise InvalidArgumentError(f"engine {engine!r} is not available; known: {', '.join(sorted(ENGINES))}")
    for pol in policies:
        for f in fracs:
            cap = int(f * src.unique_tokens)
            with Progress(src.n_requests, f"{pol} @ {f:g}", enabled=show_progress) as bar:
                tiers: dict[str, int] | None = None
                if engine == "blocksim":
                    r = simulate(bt, cap, make_block_policy(pol), progress=bar)
                    hit, ev = r.hit_tokens, r.evicted_tokens
                elif host_frac is not None:
                    from radixkv.bench.tier_engine import TieredReplayEngine

                    sto = None if storage_frac is None else (
                        -1 if math.isinf(storage_frac) else int(storage_frac * src.unique_tokens))
                    te = TieredReplayEngine(cap, int(host_frac * src.unique_tokens), sto, pol, src.page_size,
                                            write_policy)
                    try:
                        rr = replay(src.tokens(), te, progress=bar)
                    finally:
                        te.close()
                    hit, ev, tiers = rr.hit_tokens, rr.evicted_tokens, te.tier_hits
                else:
                    rr = replay(src.tokens(), ENGINES[engine](cap, pol, src.page_size), progress=bar)
                    hit, ev = rr.hit_tokens, rr.evicted_tokens
                bar.update(bar.total - bar.n)                # the simulator reports in batches
            tiers = tiers or {"device": int(hit), "host": 0, "storage": 0}
            doc["results"].append({
                "policy": pol, "capacity_frac": f, "capacity_tokens": cap, "page_size": src.page_size,
                "hit_tokens": int(hit), "token_hit_rate": hit / src.prompt_tokens, "evicted_tokens": int(ev),
                "host_capacity_frac": host_frac,
                "write_policy": None if host_frac is None else write_policy,
                "storage_capacity_frac": None if storage_frac is None else (
                    "inf" if math.isinf(storage_frac) else storage_frac),
                "tier_hit_rates": {k: v / src.prompt_tokens for k, v in tiers.items()},
            })
    return doc


def describe(doc: dict[str, Any]) -> str:
    """One line naming what was replayed: trace, engine, page size, requests."""
    engine = doc.get("engine")
    return (f"{doc['trace']}, {doc['requests']} requests" + (f", engine {engine}" if engine else "")
            + (f", page size {doc['page_size']}" if doc.get("page_size") else ""))


def markdown_table(doc: dict[str, Any]) -> str:
    """Policies as rows, capacities as columns, hit rates in percent; bounds as last rows."""
    fracs = sorted({r["capacity_frac"] for r in doc["results"]} | {float(k) for k in doc["bounds"]["belady"]})
    head = "| policy | " + " | ".join(f"{100 * f:g}%" for f in fracs) + " |"
    lines = [f"{describe(doc)}: {doc['prompt_tokens']} prompt tokens, {doc['unique_tokens']} unique",
             "token hit rate (% of prompt tokens) by cache capacity (columns: % of the unique prompt tokens)",
             "", head, "| --- |" + " ---: |" * len(fracs)]
    by: dict[str, dict[float, float]] = {}
    for r in doc["results"]:
        label = r["policy"]
        if r.get("host_capacity_frac") is not None:
            label += f" + host {100 * r['host_capacity_frac']:g}%"
            sto = r.get("storage_capacity_frac")
            if sto is not None:
                label += " + storage " + ("inf" if sto == "inf" else f"{100 * sto:g}%")
        by.setdefault(label, {})[r["capacity_frac"]] = r["token_hit_rate"]
    for pol, row in by.items():
        lines.append(f"| {pol} | " + " | ".join(f"{100 * row[f]:.2f}" if f in row else "" for f in fracs) + " |")
    bel = {float(k): v for k, v in doc["bounds"]["belady"].items()}
    lines.append("| belady (offline) | " + " | ".join(f"{100 * bel[f]:.2f}" if f in bel else "" for f in fracs) + " |")
    inf = 100 * doc["bounds"]["infinite_capacity"]
    lines.append("| infinite capacity | " + " | ".join(f"{inf:.2f}" for _ in fracs) + " |")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: str) -> str | None:
    """Hit rate vs capacity per policy with the bounds; returns a note when skipped."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plot skipped"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by: dict[str, list[tuple[float, float]]] = {}
    for r in doc["results"]:
        by.setdefault(r["policy"], []).append((r["capacity_frac"], 100 * r["token_hit_rate"]))
    for i, (pol, pts) in enumerate(by.items()):   # shrinking markers: a policy on another stays visible
        pts.sort()
        ax.plot([100 * p[0] for p in pts], [p[1] for p in pts], marker="osD^v<>ph"[i % 9],
                markersize=max(3, 8 - i), zorder=3, label=pol)
    # The bounds under the policies, thick and pale, so a policy on a bound leaves it visible.
    inf = 100 * doc["bounds"]["infinite_capacity"]
    ax.axhline(inf, color="tab:grey", linewidth=4, alpha=0.4, zorder=1, label="infinite capacity")
    bel = sorted((100 * float(k), 100 * v) for k, v in doc["bounds"]["belady"].items())
    ax.plot([b[0] for b in bel], [b[1] for b in bel], color="black", linestyle="--", marker="s", markersize=4,
            zorder=2, label="belady (offline)")
    ax.set_xscale("log")
    ticks = sorted({100 * r["capacity_frac"] for r in doc["results"]})
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}%"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("cache capacity (% of the unique prompt tokens)")
    ax.set_ylabel("token hit rate (% of prompt tokens)")
    ax.set_ylim(0, max(inf, 1.0) * 1.1)
    ax.set_title(describe(doc), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------- CLI
def _policy_names(blocks: bool) -> str:
    """The RadixCache's policy names, those the block simulator runs (``blocks``) or all."""
    from radixkv.bench.block_policy import runs_on_blocks
    from radixkv.cache.eviction import available_policies
    from radixkv.cache.eviction import make_policy as make_tree_policy

    return ", ".join(n for n in available_policies() if not blocks or runs_on_blocks(make_tree_policy(n)))


def _floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not vals or any(not 0 < v for v in vals):
        raise argparse.ArgumentTypeError("capacity fractions must be > 0")
    return vals


def _frac(text: str) -> float:
    vals = _floats(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"one fraction expected, got {text!r}")
    return vals[0]


def _storage_frac(text: str) -> float:
    return math.inf if text.strip().lower() == "inf" else _frac(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``radixkv bench hitrate``."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="Mooncake JSONL trace path, or 'conversation' / 'synthetic' (bundled)")
    src.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated workload instead of a trace")
    parser.add_argument("--block-size", type=int, default=MOONCAKE_BLOCK_SIZE,
                        help="tokens per trace hash block (pseudo-token expansion; default %(default)s)")
    parser.add_argument("--page-size", type=int, default=None,
                        help="cache page / simulator block size (default: the block size for traces, 16 for "
                             "workloads)")
    parser.add_argument("--capacity-frac", type=_floats, default="0.01,0.02,0.05,0.1,0.25,0.5",
                        help="capacities as fractions (0, 1] of the unique prompt tokens (at 1 everything "
                             "fits; --hybrid also takes more), comma-separated (default %(default)s)")
    parser.add_argument("--policy", default="lru",
                        help="eviction policies, comma-separated (default %(default)s; 'default': the "
                             f"RadixCache's default, {default_policy_name()}). blocksim: {_policy_names(True)}; "
                             f"radix: {_policy_names(False)}")
    parser.add_argument("--engine", default=None,
                        help="blocksim (default) or radix (the real RadixCache); with --hybrid: tree (default) "
                             "or flow")
    parser.add_argument("--host-capacity-frac", type=_frac, default=None,
                        help="engine radix (or --hybrid): a host-memory tier of this fraction of the unique "
                             "prompt tokens behind the device capacity (default: off)")
    parser.add_argument("--write-policy", default="write_back",
                        help="with --host-capacity-frac: the host tier's write policy, write_back (copy at "
                             "eviction) or write_through (copy at insert) (default %(default)s)")
    parser.add_argument("--storage-capacity-frac", type=_storage_frac, default=None,
                        help="engine radix, with --host-capacity-frac: a storage tier behind the host tier, a "
                             "fraction of the unique prompt tokens or 'inf' (default: off)")
    parser.add_argument("--json", dest="json_out",
                        help="write the JSON document here ('-': stdout, and the tables go to stderr)")
    parser.add_argument("--plot", help="PNG path (default: the --json path with .png)")
    parser.add_argument("--limit", type=int, default=None,
                        help="first N requests of the trace (default: all) / workload size")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="never draw the progress bar")
    from radixkv.bench.hybrid_report import add_hybrid_arguments

    add_hybrid_arguments(parser)


def check_tier_write_policy(write_policy: str, host_frac: float | None) -> None:
    """``--write-policy``: one of the host tier's, and only with ``--host-capacity-frac``.
    Raises InvalidArgumentError."""
    from radixkv.cache.host_tier import check_write_policy

    check_write_policy(write_policy)
    if write_policy != "write_back" and host_frac is None:
        raise InvalidArgumentError("--write-policy is the host tier's: it needs --host-capacity-frac")


def run(args: argparse.Namespace, make_block_policy: BlockPolicyFactory = make_policy) -> int:
    """Run the measurement; prints the table, writes JSON / PNG. Returns the exit code.
    ``make_block_policy``: as in :func:`measure` (the research CLI passes its own)."""
    t0 = time.perf_counter()
    try:
        if not getattr(args, "hybrid", False) and max(args.capacity_frac) > 1:
            raise InvalidArgumentError(f"--capacity-frac {max(args.capacity_frac):g}: capacities are fractions "
                                       f"(0, 1] of the unique prompt tokens (at 1 everything fits)")
        src = load_source(args.trace, args.workload, args.block_size, args.page_size, args.limit, args.seed)
        policies = [default_policy_name() if p.strip().lower() == "default" else p.strip()
                    for p in args.policy.split(",") if p.strip()]
        show = False if args.no_progress else None
        if getattr(args, "hybrid", False):
            from radixkv.bench import hybrid_report

            doc = hybrid_report.measure_hybrid(src, args.capacity_frac, policies,
                                               hybrid_report.hybrid_settings(args), show_progress=show)
        else:
            engine = args.engine or "blocksim"
            if engine == "blocksim":
                for p in policies:
                    make_block_policy(p)                     # fail before any work
            doc = measure(src, args.capacity_frac, policies, engine, show_progress=show,
                          make_block_policy=make_block_policy, host_frac=getattr(args, "host_capacity_frac", None),
                          storage_frac=getattr(args, "storage_capacity_frac", None),
                          write_policy=getattr(args, "write_policy", "write_back"))
    except RadixKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    hybrid = doc.get("mode") == "hybrid"
    if hybrid:
        from radixkv.bench.hybrid_report import hybrid_tables, plot_hybrid
    table_out = sys.stderr if args.json_out == "-" else sys.stdout   # stdout: the JSON alone
    print(hybrid_tables(doc) if hybrid else markdown_table(doc), file=table_out)
    print(f"\n({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.json_out:
        text = json.dumps(doc, indent=2)
        if args.json_out == "-":
            print(text)
        else:
            with open(args.json_out, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
    png = args.plot or (os.path.splitext(args.json_out)[0] + ".png" if args.json_out and args.json_out != "-" else None)
    if png:
        note = (plot_hybrid if hybrid else plot)(doc, png)
        if note:
            print(f"note: {note}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixkv.bench.hitrate", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
