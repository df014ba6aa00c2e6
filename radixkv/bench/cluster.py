"""``radixkv bench cluster``: N radixkv managers behind a KV-aware router fed by their own
events, against round robin, on a Mooncake trace.

Each manager is an in-process ``RadixCache`` (KV events on) with a fixed capacity in tokens.
Per request, in trace order:

1. the router picks a manager: ``kv`` asks the index for every manager's overlap with the
   request (``tokens_hash`` blocks, :mod:`radixkv.events.dynamo`) and takes the largest,
   the least loaded on a tie (load = prompt tokens the manager had to compute so far, then
   the lowest id); ``kv_bounded`` does the same among the managers whose load is at most
   ``(1 + slack)`` times the mean (bounded loads: a prefix every request shares, like a
   system prompt, would otherwise send everything to one manager); ``round_robin`` takes
   ``i mod N``;
2. the manager serves it: ``match_prefix`` (the hit), lock the match, evict what the new
   pages need, insert the page-aligned prompt (what fits), unlock;
3. its events go through a :class:`~radixkv.events.dynamo.DynamoEventAdapter` into the
   index (Dynamo's Rust ``RadixTree`` when ai-dynamo-runtime is installed, else
   :class:`PyRadixIndex`, the same semantics in Python).

Reported: cluster-wide token hit rate (hit tokens / prompt tokens), per-manager requests,
prompt tokens, hit tokens and computed tokens, and for the ``kv`` router how often the
index's predicted overlap equalled the manager's real hit (it must be always). With
``--mocker`` it also runs Dynamo's own mocker replay (``run_mocker_trace_replay``, offline,
its own engine model) on the same requests with ``kv_router`` and ``round_robin``.
Numbers are measured by the run; nothing is asserted about speed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, Iterable, List, NamedTuple, Optional

import numpy as np

from radixkv.cache.radix_cache import RadixCache
from radixkv.errors import InvalidArgumentError, RadixKVError
from radixkv.events.dynamo import DynamoEventAdapter, compute_block_hash_for_seq

__all__ = ["PyRadixIndex", "make_index", "ClusterResult", "replay_cluster", "add_arguments", "run"]

ROUTERS = ("kv", "kv_bounded", "round_robin")


class PyRadixIndex:
    """Dynamo's radix indexer semantics in Python (the fallback index): nodes keyed by
    ``tokens_hash`` under their parent, a per-worker map of block hash -> node, a worker's
    score = the leading blocks it holds contiguously. Same interface as :class:`DynamoIndex`."""

    name = "python"

    def __init__(self) -> None:
        self._root: Dict[str, Any] = {"kids": {}, "workers": set()}
        self._lookup: Dict[int, Dict[int, dict]] = {}

    def apply_event(self, worker: int, raw: bytes) -> None:
        data = json.loads(raw)["data"]
        table = self._lookup.setdefault(worker, {})
        if data == "cleared":
            for node in table.values():
                node["workers"].discard(worker)
            table.clear()
        elif "stored" in data:
            p = data["stored"]["parent_hash"]
            if p is not None and p not in table:
                raise InvalidArgumentError(f"worker {worker}: parent block {p} is not stored")
            node = self._root if p is None else table[p]
            for b in data["stored"]["blocks"]:
                node = node["kids"].setdefault(b["tokens_hash"], {"kids": {}, "workers": set()})
                node["workers"].add(worker)
                table[b["block_hash"]] = node
        else:
            for h in data["removed"]["block_hashes"]:
                table.pop(h)["workers"].discard(worker)

    def scores(self, hashes: List[int]) -> Dict[int, int]:
        out: Dict[int, int] = {}
        node, alive = self._root, None
        for depth, h in enumerate(hashes, 1):
            node = node["kids"].get(h)
            if node is None:
                break
            alive = set(node["workers"]) if alive is None else alive & node["workers"]
            if not alive:
                break
            for w in alive:
                out[w] = depth
        return out


class DynamoIndex:
    """``dynamo._core.RadixTree`` (ai-dynamo-runtime) behind the same interface."""

    name = "dynamo"

    def __init__(self) -> None:
        os.environ.setdefault("DYN_LOG", "error")
        from dynamo._core import RadixTree

        self._tree = RadixTree()

    def apply_event(self, worker: int, raw: bytes) -> None:
        self._tree.apply_event(worker, raw)

    def scores(self, hashes: List[int]) -> Dict[int, int]:
        return {w: n for (w, _), n in self._tree.find_matches(hashes).scores.items()}


def make_index(kind: str = "auto"):
    """``dynamo``, ``python``, or ``auto`` (Dynamo's when importable)."""
    if kind not in ("auto", "dynamo", "python"):
        raise InvalidArgumentError(f"index must be auto, dynamo or python, got {kind!r}")
    if kind == "python":
        return PyRadixIndex()
    try:
        return DynamoIndex()
    except ImportError:
        if kind == "dynamo":
            raise InvalidArgumentError("the dynamo index needs ai-dynamo-runtime (pip install ai-dynamo-runtime)")
        return PyRadixIndex()


class ClusterResult(NamedTuple):
    """One router's replay: totals, per-manager rows, the prediction check, wall seconds."""

    router: str
    index: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    managers: List[Dict[str, Any]]
    predicted_exact: Optional[float]
    seconds: float


class _Manager:
    """One manager: a RadixCache of ``capacity`` tokens and its event adapter."""

    def __init__(self, capacity: int, page_size: int):
        self.cache = RadixCache(page_size=page_size, enable_kv_events=True)
        self.adapter = DynamoEventAdapter(page_size)
        self.capacity = capacity
        self.page = page_size
        self.stats = np.zeros(4, dtype=np.int64)  # requests, prompt, hit, computed

    def serve(self, toks: np.ndarray, rows: np.ndarray) -> int:
        c = self.cache
        n = toks.size - toks.size % self.page
        m = c.match_prefix(toks[:n])
        hit = m.prefix_len
        c.inc_lock_ref(m.last_node)
        short = (n - hit) - (self.capacity - c.total_size())
        if short > 0:
            c.evict(short)
        room = self.capacity - c.total_size()
        keep = min(n, hit + max(room, 0))
        keep -= keep % self.page
        if keep > hit:
            c.insert(toks[:keep], rows[:keep])
        c.dec_lock_ref(m.last_node)
        self.stats += (1, toks.size, hit, toks.size - hit)
        return hit

    def pump(self, index, worker: int) -> None:
        for ev in self.cache.take_events():
            raw = self.adapter.encode(ev)
            if raw is not None:
                index.apply_event(worker, raw)


def replay_cluster(requests: Iterable[np.ndarray], n_managers: int, capacity: int, page_size: int,
                   router: str = "kv", index: str = "auto", slack: float = 0.25) -> ClusterResult:
    """Replay ``requests`` (int32 token arrays) on ``n_managers`` managers of ``capacity``
    tokens each, routed by ``router`` (``kv`` / ``kv_bounded`` / ``round_robin``; ``slack``
    for ``kv_bounded``). See the module doc.

    Raises InvalidArgumentError for bad sizes or router. O(tokens) per request."""
    for name, v in (("n_managers", n_managers), ("capacity", capacity), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
    if router not in ROUTERS:
        raise InvalidArgumentError(f"router must be one of {ROUTERS}, got {router!r}")
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or slack < 0:
        raise InvalidArgumentError(f"slack must be a number >= 0, got {slack!r}")
    idx = make_index(index) if router != "round_robin" else None
    managers = [_Manager(capacity, page_size) for _ in range(n_managers)]
    rows = np.arange(0, 1 << 16, dtype=np.int64)
    exact = routed = 0
    t0 = time.perf_counter()
    for i, toks in enumerate(requests):
        if toks.size > rows.size:
            rows = np.arange(toks.size, dtype=np.int64)
        if idx is not None:
            n = toks.size - toks.size % page_size
            sc = idx.scores(compute_block_hash_for_seq(toks[:n], page_size))
            cand = range(n_managers)
            if router == "kv_bounded":
                load = [int(m.stats[3]) for m in managers]
                bound = (1 + slack) * (sum(load) + toks.size) / n_managers
                cand = [k for k in cand if load[k] + toks.size <= bound] or cand
            w = max(cand, key=lambda k: (sc.get(k, 0), -managers[k].stats[3], -k))
        else:
            w = i % n_managers
        hit = managers[w].serve(toks, rows)
        if idx is not None:
            exact += sc.get(w, 0) * page_size == hit
            routed += 1
            managers[w].pump(idx, w)
    secs = time.perf_counter() - t0
    tot = sum(m.stats for m in managers)
    rows_out = [{"manager": k, "requests": int(m.stats[0]), "prompt_tokens": int(m.stats[1]),
                 "hit_tokens": int(m.stats[2]), "computed_tokens": int(m.stats[3]),
                 "hit_rate": float(m.stats[2] / m.stats[1]) if m.stats[1] else 0.0,
                 "cached_tokens": int(m.cache.total_size())} for k, m in enumerate(managers)]
    return ClusterResult(router, idx.name if idx is not None else "-", int(tot[0]), int(tot[1]), int(tot[2]),
                         float(tot[2] / tot[1]) if tot[1] else 0.0, rows_out,
                         exact / routed if routed else None, secs)


def _mocker(trace_path: str, limit: Optional[int], n_managers: int, block_size: int) -> Dict[str, Any]:
    """Dynamo's offline mocker replay of the same requests, both router modes."""
    os.environ.setdefault("DYN_LOG", "error")
    from dynamo._core import run_mocker_trace_replay

    keys = ("prefix_cache_reused_ratio", "mean_ttft_ms", "p90_ttft_ms", "duration_ms", "request_throughput_rps",
            "committed_prefill_tokens", "total_input_tokens")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.jsonl")
        with open(trace_path, "r", encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
            for k, line in enumerate(src):
                if limit is not None and k >= limit:
                    break
                dst.write(line)
        out = {}
        for mode in ("kv_router", "round_robin"):
            t0 = time.perf_counter()
            s = run_mocker_trace_replay([path], num_workers=n_managers, router_mode=mode,
                                        trace_block_size=block_size).summary
            out[mode] = {k: s.get(k) for k in keys}
            out[mode]["wall_s"] = time.perf_counter() - t0
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``radixkv bench cluster``."""
    parser.add_argument("--trace", default="conversation",
                        help="Mooncake JSONL path, or 'conversation' / 'synthetic' (bundled); default conversation")
    parser.add_argument("--limit", type=int, default=2000, help="first N requests (default 2000)")
    parser.add_argument("--block-size", type=int, default=512, help="tokens per trace hash block (512)")
    parser.add_argument("--page-size", type=int, default=64, help="manager page size / router block size (64)")
    parser.add_argument("--managers", type=int, default=4, help="number of managers (4)")
    parser.add_argument("--capacity-frac", type=float, default=0.05,
                        help="each manager's capacity as a fraction of the trace's unique prompt tokens (0.05)")
    parser.add_argument("--routers", default="kv,kv_bounded,round_robin",
                        help="comma-separated: kv, kv_bounded, round_robin")
    parser.add_argument("--slack", type=float, default=0.25,
                        help="kv_bounded: a manager takes a request only while its computed tokens stay "
                             "within (1 + slack) x the mean (0.25)")
    parser.add_argument("--index", default="auto", choices=("auto", "dynamo", "python"),
                        help="router index: Dynamo's RadixTree, the Python one, or auto")
    parser.add_argument("--mocker", action="store_true",
                        help="also run Dynamo's run_mocker_trace_replay (needs ai-dynamo-runtime)")
    parser.add_argument("--json", dest="json_out", help="write the JSON document here ('-' for stdout only)")


def run(args: argparse.Namespace) -> int:
    """Run the replay for each router; print the table and the JSON. Returns the exit code."""
    from radixkv.bench.hitrate import load_source

    try:
        src = load_source(args.trace, None, args.block_size, args.page_size, args.limit)
        routers = [r.strip() for r in args.routers.split(",") if r.strip()]
        bad = [r for r in routers if r not in ROUTERS]
        if bad:
            raise InvalidArgumentError(f"unknown routers {bad}; choose from {ROUTERS}")
        if not 0 < args.capacity_frac:
            raise InvalidArgumentError("--capacity-frac must be > 0")
        cap = max(args.page_size, int(src.unique_tokens * args.capacity_frac) // args.page_size * args.page_size)
        results = [replay_cluster(src.tokens(), args.managers, cap, args.page_size, r, args.index, args.slack)
                   for r in routers]
        doc: Dict[str, Any] = {
            "trace": src.name, "requests": src.n_requests, "prompt_tokens": src.prompt_tokens,
            "unique_tokens": src.unique_tokens, "managers": args.managers, "capacity_tokens_each": cap,
            "page_size": args.page_size, "slack": args.slack, "results": [r._asdict() for r in results],
        }
        if args.mocker:
            trace = args.trace
            if not os.path.isfile(trace):
                from radixkv.data import mooncake_trace

                trace = str(mooncake_trace(trace))
            doc["dynamo_mocker"] = _mocker(trace, args.limit, args.managers, args.block_size)
    except (RadixKVError, ImportError) as e:
        print(f"radixkv bench cluster: {e}", file=sys.stderr)
        return 2
    print(f"{src.name}: {src.n_requests} requests, {src.prompt_tokens} prompt tokens, "
          f"{args.managers} managers x {cap} tokens")
    print(f"{'router':<12} {'index':<7} {'hit rate':>8} {'exact':>6} {'s':>7}  per-manager requests / hit rate")
    for r in results:
        per = "  ".join(f"{m['requests']}/{m['hit_rate']:.3f}" for m in r.managers)
        ex = "-" if r.predicted_exact is None else f"{r.predicted_exact:.3f}"
        print(f"{r.router:<12} {r.index:<7} {r.hit_rate:>8.4f} {ex:>6} {r.seconds:>7.2f}  {per}")
    for mode, s in doc.get("dynamo_mocker", {}).items():
        print(f"mocker {mode:<12} reused {s['prefix_cache_reused_ratio']:.4f}  mean TTFT {s['mean_ttft_ms']:.1f} ms"
              f"  p90 TTFT {s['p90_ttft_ms']:.1f} ms")
    text = json.dumps(doc, indent=2)
    if args.json_out and args.json_out != "-":
        with open(args.json_out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="radixkv bench cluster", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
