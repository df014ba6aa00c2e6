"""``radixkv bench cluster``: N radixkv managers behind a KV-aware router fed by their own
events, against round robin, on a Mooncake trace.

Managers hold a fixed token capacity, in-process ``RadixCache`` objects (``--managers-mode
inproc``) or real ``radixkv serve`` processes (``process``, :mod:`radixkv.bench.cluster_procs`),
with the same per-request hits. Per request: the router picks a manager (``kv``: largest
index overlap of ``prompt[:L - 1]``, least loaded on a tie; ``kv_bounded``: the same within
``(1 + slack)`` x the mean load; ``round_robin``); the manager serves it as the service's
``alloc_extend`` -> ``cache_finished``; its events go through a
:class:`~radixkv.events.dynamo.DynamoEventAdapter` into the index (Dynamo's ``RadixTree`` or
:class:`PyRadixIndex`). Reported: token hit rate, per-manager load, and how often the
predicted overlap equalled the real hit (always without tiers). ``--mocker`` adds Dynamo's
mocker; ``--storage URL`` replays again on processes sharing one storage tier, beside one
cache holding everything. Numbers are measured, never asserted. See ``docs/cluster.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

from radixkv.bench.progress import Progress, ProgressBar
from radixkv.bench.router_index import DynamoIndex, PyRadixIndex, make_index
from radixkv.cache.hybrid.state_events import CacheEvent
from radixkv.cache.kv_events import KVEvent
from radixkv.cache.radix_cache import RadixCache
from radixkv.errors import AlignmentError, InvalidArgumentError, InvariantError, RadixKVError
from radixkv.events.dynamo import DynamoEventAdapter, compute_block_hash_for_seq

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Unpack

    from radixkv.bench.cluster_procs import ProcessOptions
    from radixkv.bench.hitrate import Source

__all__ = ["PyRadixIndex", "DynamoIndex", "make_index", "ClusterResult", "InprocManager", "served_len",
           "replay_on", "replay_cluster", "add_arguments", "run"]

ROUTERS = ("kv", "kv_bounded", "round_robin")
MODES = ("inproc", "process")


class ClusterResult(NamedTuple):
    """One router's replay: totals, per-manager rows, the prediction check, wall seconds,
    and per request (trace order) the manager that served it (``routes``) and its hit
    (``hits``), int64 arrays (left out of the JSON document)."""

    router: str
    index: str  # type: ignore[assignment]  # shadows tuple.index (the field's public name)
    mode: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    host_hit_tokens: int
    storage_hit_tokens: int
    managers: list[dict[str, Any]]
    predicted_exact: float | None
    seconds: float
    requests_per_s: float
    routes: np.ndarray
    hits: np.ndarray


class ClusterManager(Protocol):
    """One manager as :func:`replay_on` drives it (:class:`InprocManager`, or
    :class:`~radixkv.bench.cluster_procs.RemoteManager`)."""

    mode: str
    #: Hit tokens so far that came from the host tier (storage included) and from storage.
    host_tokens: int
    storage_tokens: int

    def serve(self, toks: np.ndarray) -> int:
        """Serve ``toks`` (int32); returns the hit in tokens."""
    def take_events(self) -> Sequence[CacheEvent | dict[str, object]]:
        """The KV events since the last take (objects or their ``to_dict()`` dicts)."""
    def cached_tokens(self) -> int: ...


def served_len(size: int, capacity: int) -> int:
    """Tokens of a ``size``-token prompt a manager of ``capacity`` tokens serves: all of
    them, or its first ``capacity`` (a longer prompt never fits in the pool at once)."""
    return min(int(size), int(capacity))


class InprocManager:
    """One in-process manager: a ``RadixCache`` of ``capacity`` tokens (pages of
    ``page_size``) with KV events, driven as the service drives its tree (module doc,
    step 2), so that its hits equal a ``radixkv serve`` manager's of the same capacity.
    Single-threaded; O(tokens) per request."""

    mode = "inproc"
    host_tokens = storage_tokens = 0  # one tier

    def __init__(self, capacity: int, page_size: int):
        self.cache = RadixCache(page_size=page_size, enable_kv_events=True)
        self.capacity = capacity
        self.page = page_size
        self._rows = np.arange(0, 1 << 16, dtype=np.int64)

    def serve(self, toks: np.ndarray) -> int:
        """Serve ``toks`` (int32, at most ``capacity`` tokens); returns the hit in tokens."""
        c, p, n = self.cache, self.page, int(toks.size)
        if n > self._rows.size:
            self._rows = np.arange(n, dtype=np.int64)
        m = c.match_prefix(toks[:n - 1])
        hit = m.prefix_len
        c.inc_lock_ref(m.last_node)
        try:
            need = -(-(n - hit) // p) * p
            short = need - (self.capacity - c.total_size())
            if short > 0:
                c.evict(short)
            if self.capacity - c.total_size() < need:
                raise InvariantError(f"manager of {self.capacity} tokens: {need} slots for a {n}-token "
                                     f"prompt do not fit after eviction ({c.total_size()} cached)")
            keep = n - n % p
            if keep:
                c.insert(toks[:keep], self._rows[:keep])
        finally:
            c.dec_lock_ref(m.last_node)
        return hit

    def take_events(self) -> list[KVEvent]:
        return self.cache.take_events()

    def cached_tokens(self) -> int:
        return int(self.cache.total_size())


def _check_sizes(n_managers: int, capacity: int, page_size: int) -> None:
    for name, v in (("n_managers", n_managers), ("capacity", capacity), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
    if capacity % page_size:
        raise AlignmentError(f"capacity {capacity} is not a multiple of page_size {page_size}")


def replay_on(managers: Sequence[ClusterManager], requests: Iterable[np.ndarray], capacity: int, page_size: int,
              router: str = "kv", index: str = "auto", slack: float = 0.25,
              progress: ProgressBar | None = None) -> ClusterResult:
    """Replay ``requests`` (int32 token arrays) on ``managers`` (each with ``serve(toks) ->
    hit``, ``take_events()``, ``cached_tokens()`` and ``mode``; empty caches of
    ``capacity`` tokens), routed by ``router`` (``kv`` / ``kv_bounded`` / ``round_robin``;
    ``slack`` for ``kv_bounded``); ``progress.update(1)`` after each request when given.
    See the module doc.

    Raises InvalidArgumentError for bad sizes or router; the managers' errors pass through.
    O(tokens) per request plus the managers' own cost."""
    n_managers = len(managers)
    _check_sizes(n_managers, capacity, page_size)
    if router not in ROUTERS:
        raise InvalidArgumentError(f"router must be one of {ROUTERS}, got {router!r}")
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or slack < 0:
        raise InvalidArgumentError(f"slack must be a number >= 0, got {slack!r}")
    idx = make_index(index) if router != "round_robin" else None
    adapters = [DynamoEventAdapter(page_size) for _ in managers]
    stats = np.zeros((n_managers, 6), dtype=np.int64)  # requests, prompt, hit, computed, host, storage
    routes: list[int] = []
    hits: list[int] = []
    exact = routed = 0
    t0 = time.perf_counter()
    for i, toks in enumerate(requests):
        served = toks[:served_len(toks.size, capacity)]
        if idx is not None:
            sc = idx.scores(compute_block_hash_for_seq(served[:served.size - 1], page_size))
            cand: Sequence[int] = range(n_managers)
            if router == "kv_bounded":
                load = stats[:, 3]
                bound = (1 + slack) * (int(load.sum()) + toks.size) / n_managers
                cand = [k for k in cand if load[k] + toks.size <= bound] or cand
            w = max(cand, key=lambda k: (sc.get(k, 0), -stats[k, 3], -k))
        else:
            w = i % n_managers
        m = managers[w]
        tiers = m.host_tokens, m.storage_tokens
        hit = m.serve(served)
        stats[w] += (1, toks.size, hit, toks.size - hit, m.host_tokens - tiers[0], m.storage_tokens - tiers[1])
        routes.append(w)
        hits.append(hit)
        if progress is not None:
            progress.update(1)
        if idx is not None:
            exact += sc.get(w, 0) * page_size == hit
            routed += 1
            for ev in managers[w].take_events():  # a tier move is invisible to the adapter
                raw = adapters[w].encode(ev)
                if raw is not None:
                    idx.apply_event(w, raw)
    secs = time.perf_counter() - t0
    tot = stats.sum(axis=0)
    rows_out = [{"manager": k, "requests": int(s[0]), "prompt_tokens": int(s[1]), "hit_tokens": int(s[2]),
                 "computed_tokens": int(s[3]), "hit_rate": float(s[2] / s[1]) if s[1] else 0.0,
                 "host_hit_tokens": int(s[4]), "storage_hit_tokens": int(s[5]),
                 "cached_tokens": managers[k].cached_tokens()} for k, s in enumerate(stats)]
    return ClusterResult(router, idx.name if idx is not None else "-", managers[0].mode, int(tot[0]),
                         int(tot[1]), int(tot[2]), float(tot[2] / tot[1]) if tot[1] else 0.0, int(tot[4]),
                         int(tot[5]), rows_out,
                         exact / routed if routed else None, secs, int(tot[0]) / secs if secs > 0 else 0.0,
                         np.asarray(routes, dtype=np.int64), np.asarray(hits, dtype=np.int64))


def replay_cluster(requests: Iterable[np.ndarray], n_managers: int, capacity: int, page_size: int,
                   router: str = "kv", index: str = "auto", slack: float = 0.25,
                   mode: str = "inproc", **process_options: Unpack[ProcessOptions]) -> ClusterResult:
    """Replay ``requests`` on ``n_managers`` fresh managers of ``capacity`` tokens each
    (:func:`replay_on`): in-process (``mode="inproc"``) or ``radixkv serve`` processes
    (``mode="process"``, started and stopped here; ``process_options`` go to
    :class:`~radixkv.bench.cluster_procs.ManagerProcesses`).

    Raises InvalidArgumentError for bad sizes, router or mode."""
    _check_sizes(n_managers, capacity, page_size)
    if mode not in MODES:
        raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "inproc":
        if process_options:
            raise InvalidArgumentError(f"options {sorted(process_options)} are for mode='process'")
        return replay_on([InprocManager(capacity, page_size) for _ in range(n_managers)], requests,
                         capacity, page_size, router, index, slack)
    from radixkv.bench.cluster_procs import ManagerProcesses

    with ManagerProcesses(n_managers, capacity, page_size, **process_options) as procs:
        return replay_on(procs.managers, requests, capacity, page_size, router, index, slack)


def _mocker(trace_path: str, limit: int | None, n_managers: int, block_size: int, page_size: int,
            capacity: int) -> dict[str, Any]:
    """Dynamo's offline mocker replay of the same requests, both router modes, its workers
    given the managers' KV capacity (``num_gpu_blocks`` pages of ``page_size``)."""
    os.environ.setdefault("DYN_LOG", "error")
    from dynamo._core import run_mocker_trace_replay

    keys = ("prefix_cache_reused_ratio", "mean_ttft_ms", "p90_ttft_ms", "duration_ms", "request_throughput_rps",
            "committed_prefill_tokens", "total_input_tokens", "num_requests", "completed_requests",
            "kv_eviction_policy")
    engine = {"engine": {"block_size": page_size, "num_gpu_blocks": capacity // page_size}}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.jsonl")
        with open(trace_path, encoding="utf-8") as src, open(path, "w", encoding="utf-8") as dst:
            for k, line in enumerate(src):
                if limit is not None and k >= limit:
                    break
                dst.write(line)
        out: dict[str, Any] = {"extra_engine_args": engine}
        for mode in ("kv_router", "round_robin"):
            t0 = time.perf_counter()
            s = run_mocker_trace_replay([path], extra_engine_args=engine, num_workers=n_managers,
                                        router_mode=mode, trace_block_size=block_size).summary
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
    parser.add_argument("--routers", "--router", dest="routers", default="kv,kv_bounded,round_robin",
                        help="comma-separated: kv, kv_bounded, round_robin")
    parser.add_argument("--managers-mode", default="inproc", choices=MODES,
                        help="inproc: RadixCache objects in this process (default); process: one "
                             "'radixkv serve' process per manager, driven through radixkv.connect")
    parser.add_argument("--start-timeout-s", type=float, default=120.0,
                        help="process mode: how long the managers may take to start (120)")
    parser.add_argument("--slack", type=float, default=0.25,
                        help="kv_bounded: a manager takes a request only while its computed tokens stay "
                             "within (1 + slack) x the mean (0.25)")
    parser.add_argument("--storage", default=None, metavar="URL",
                        help="also replay with this storage tier shared by every manager (file:///DIR or "
                             "mooncake://HOST:PORT?metadata=URL...; needs --managers-mode process); each "
                             "router's replay gets an empty place of its own in it")
    parser.add_argument("--host-capacity-frac", type=float, default=None,
                        help="each manager's host tier, as --capacity-frac (default: 0, or --capacity-frac "
                             "with --storage, which needs a host tier); the same with and without the store")
    parser.add_argument("--storage-timeout-ms", type=float, default=1000.0,
                        help="with --storage: the longest a match waits on the store (1000)")
    parser.add_argument("--index", default="auto", choices=("auto", "dynamo", "python"),
                        help="router index: Dynamo's RadixTree, the Python one, or auto")
    parser.add_argument("--mocker", action="store_true",
                        help="also run Dynamo's run_mocker_trace_replay (needs ai-dynamo-runtime)")
    parser.add_argument("--json", dest="json_out", help="write the JSON document here ('-' for stdout only)")
    parser.add_argument("--no-progress", action="store_true", help="never draw the progress bar (drawn on a terminal)")


def _replay_routers(src: Source, routers: list[str], cap: int, args: argparse.Namespace,
                    doc: dict[str, Any], extra_args: Sequence[str] = ()) -> list[ClusterResult]:
    """Each router on fresh managers: new in-process ones, or the same processes flushed
    (started with ``extra_args``)."""
    show = False if args.no_progress else None
    if args.managers_mode == "inproc":
        out = []
        for r in routers:
            with Progress(src.n_requests, f"{r} router", enabled=show) as bar:
                out.append(replay_on([InprocManager(cap, args.page_size) for _ in range(args.managers)],
                                     src.tokens(), cap, args.page_size, r, args.index, args.slack, bar))
        return out
    from radixkv.bench.cluster_procs import ManagerProcesses, sigterm_raises

    t0 = time.perf_counter()
    with sigterm_raises(), ManagerProcesses(args.managers, cap, args.page_size, start_timeout_s=args.start_timeout_s,
                                            extra_args=extra_args) as procs:
        doc["process_start_s"] = time.perf_counter() - t0
        doc["manager_pids"] = procs.pids
        out = []
        for r in routers:
            procs.reset()
            with Progress(src.n_requests, f"{r} router", enabled=show) as bar:
                out.append(replay_on(procs.managers, src.tokens(), cap, args.page_size, r, args.index,
                                     args.slack, bar))
    return out


def _replay_with_storage(src: Source, routers: list[str], cap: int, args: argparse.Namespace,
                         doc: dict[str, Any], extra_args: Sequence[str]) -> list[ClusterResult]:
    """Each router on fresh manager processes sharing ``args.storage``, narrowed to an empty
    place of the router's own (:func:`~radixkv.bench.cluster_procs.storage_for_run`)."""
    from radixkv.bench.cluster_procs import ManagerProcesses, sigterm_raises, storage_for_run

    show = False if args.no_progress else None
    run_id = f"bench-{os.getpid()}-{time.time_ns()}"
    out, starts = [], []
    for r in routers:
        url = storage_for_run(args.storage, f"{run_id}-{r}")
        more = ["--storage", url, "--storage-timeout-ms", str(args.storage_timeout_ms)]
        t0 = time.perf_counter()
        procs = ManagerProcesses(args.managers, cap, args.page_size, start_timeout_s=args.start_timeout_s,
                                 extra_args=[*extra_args, *more])
        with sigterm_raises(), procs:
            starts.append(time.perf_counter() - t0)
            with Progress(src.n_requests, f"{r} router, shared store", enabled=show) as bar:
                out.append(replay_on(procs.managers, src.tokens(), cap, args.page_size, r, args.index,
                                     args.slack, bar))
    doc["storage_process_start_s"] = starts
    return out


def single_cache_bound(src: Source, page_size: int) -> ClusterResult:
    """One in-process manager large enough never to evict (the trace's prompt tokens): the
    hit rate of one cache holding everything, the bound a shared store can reach."""
    cap = -(-max(src.prompt_tokens, 1) // page_size) * page_size
    return replay_on([InprocManager(cap, page_size)], src.tokens(), cap, page_size, "round_robin")


def _row(r: ClusterResult) -> dict[str, Any]:
    return {k: v for k, v in r._asdict().items() if k not in ("routes", "hits")}


def run(args: argparse.Namespace) -> int:
    """Run the replay for each router; print the table and the JSON. Returns the exit code."""
    from radixkv.bench.hitrate import load_source

    try:
        src = load_source(args.trace, None, args.block_size, args.page_size, args.limit)
        routers = [r.strip() for r in args.routers.split(",") if r.strip()]
        bad = [r for r in routers if r not in ROUTERS]
        if bad or not routers:
            raise InvalidArgumentError(f"unknown routers {bad or args.routers!r}; choose from {ROUTERS}")
        if not 0 < args.capacity_frac:
            raise InvalidArgumentError("--capacity-frac must be > 0")
        cap = max(args.page_size, int(src.unique_tokens * args.capacity_frac) // args.page_size * args.page_size)
        host_frac = args.host_capacity_frac
        if host_frac is None:
            host_frac = args.capacity_frac if args.storage else 0.0
        if args.storage and (args.managers_mode != "process" or not host_frac > 0):
            raise InvalidArgumentError("--storage needs --managers-mode process and a host tier "
                                       "(--host-capacity-frac > 0)")
        if host_frac and args.managers_mode != "process":
            raise InvalidArgumentError("--host-capacity-frac needs --managers-mode process")
        host_cap = int(src.unique_tokens * host_frac) // args.page_size * args.page_size
        tiers = ["--host-kv-tokens", str(host_cap)] if host_cap else []
        doc: dict[str, Any] = {
            "trace": src.name, "requests": src.n_requests, "prompt_tokens": src.prompt_tokens,
            "unique_tokens": src.unique_tokens, "managers": args.managers, "managers_mode": args.managers_mode,
            "capacity_tokens_each": cap, "host_capacity_tokens_each": host_cap, "page_size": args.page_size,
            "slack": args.slack,
        }
        results = _replay_routers(src, routers, cap, args, doc, tiers)
        doc["results"] = [_row(r) for r in results]
        stored: list[ClusterResult] = []
        if args.storage:
            doc["storage"] = args.storage
            doc["storage_timeout_ms"] = args.storage_timeout_ms
            stored = _replay_with_storage(src, routers, cap, args, doc, tiers)
            bound = single_cache_bound(src, args.page_size)
            doc["single_cache_bound"] = {"hit_tokens": bound.hit_tokens, "hit_rate": bound.hit_rate}
            doc["results_with_storage"] = [
                {**_row(r), "storage_share_of_hits": r.storage_hit_tokens / r.hit_tokens if r.hit_tokens else 0.0,
                 "points_below_bound": 100 * (bound.hit_rate - r.hit_rate),
                 "fraction_of_bound": r.hit_rate / bound.hit_rate if bound.hit_rate else 0.0} for r in stored]
        if args.mocker:
            trace = args.trace
            if not os.path.isfile(trace):
                from radixkv.data import mooncake_trace

                trace = str(mooncake_trace(trace))
            doc["dynamo_mocker"] = _mocker(trace, args.limit, args.managers, args.block_size, args.page_size, cap)
    except (RadixKVError, ImportError, OSError) as e:
        print(f"radixkv bench cluster: {e}", file=sys.stderr)
        return 2
    print(f"{src.name}: {src.n_requests} requests, {src.prompt_tokens} prompt tokens, "
          f"{args.managers} managers ({args.managers_mode}) x {cap} tokens")
    print(f"{'router':<12} {'store':<6} {'hit rate':>8} {'from store':>10} {'exact':>6} {'req/s':>8}  "
          f"per manager: requests / hit rate / computed tokens")
    for r, store in [(r, "-") for r in results] + [(r, "shared") for r in stored]:
        per = "  ".join(f"{m['requests']}/{m['hit_rate']:.3f}/{m['computed_tokens']}" for m in r.managers)
        ex = "-" if r.predicted_exact is None else f"{r.predicted_exact:.3f}"
        share = r.storage_hit_tokens / r.hit_tokens if r.hit_tokens else 0.0
        print(f"{r.router:<12} {store:<6} {r.hit_rate:>8.4f} {share:>10.4f} {ex:>6} {r.requests_per_s:>8.1f}  {per}")
    if "single_cache_bound" in doc:
        print(f"single cache holding everything: hit rate {doc['single_cache_bound']['hit_rate']:.4f}")
    for mode, s in doc.get("dynamo_mocker", {}).items():
        if mode == "extra_engine_args":
            continue
        print(f"mocker {mode:<12} reused {s['prefix_cache_reused_ratio']:.4f}  mean TTFT {s['mean_ttft_ms']:.1f} ms"
              f"  p90 TTFT {s['p90_ttft_ms']:.1f} ms")
    text = json.dumps(doc, indent=2)
    if args.json_out and args.json_out != "-":
        with open(args.json_out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="radixkv bench cluster",
        description="N radixkv managers behind a KV-aware router fed by their own events, against round robin, "
                    "on a Mooncake trace (hit rates and load balance).")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
