"""``radixkv demo``: the main job, end to end.

:func:`run_demo` starts the cache manager (``radixkv serve``) on a Unix socket in a fresh
0700 temp directory and spawns worker processes (``spawn``: gRPC does not survive fork) that
run the reference hybrid model over multi-turn conversations of the bundled Mooncake trace
(:func:`conversation_prompts`; one conversation per worker, one shared cache), check every
logit against a from-scratch forward, and report a table (hit rate beside its bound,
computation saved, requests/s, RPC p50/p99, pool usage). The manager's invariants are
checked and it is shut down cleanly. ``embedded=True`` runs the same requests in one process
against ``CacheEngine``; the return value is non-zero when any check fails. The trace is
scaled to ``tokens_per_block`` pseudo-tokens per block. :func:`run_walkthrough` prints the
pools through one extend -> decode -> release -> reuse cycle. Details: ``docs/demo.md``.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TextIO

import numpy as np
import numpy.typing as npt
import torch

from radixkv.demo.workers import (
    TOLERANCE,
    HybridWorker,
    TimedEngine,
    demo_model_config,
    engine_config_for,
    worker_main,
)
from radixkv.errors import InvalidArgumentError, InvariantError, RadixKVError

if TYPE_CHECKING:  # pragma: no cover
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from tqdm import tqdm

    from radixkv.engine.config import EngineConfig
    from radixkv.reference.config import HybridConfig
    from radixkv.service.client.remote import RemoteCacheEngine

__all__ = ["run_demo", "run_walkthrough", "conversation_prompts", "token_hash"]

BLOCK = 512  # tokens per Mooncake hash block

#: One request of a worker: ``(rid, int32 prompt, decode steps)``.
Job = tuple[str, np.ndarray, int]


def token_hash(pseudo: np.ndarray, vocab: int) -> npt.NDArray[np.int32]:
    """Map pseudo-token ids into ``0..vocab-1`` by a fixed hash (splitmix64), vectorized:
    equal ids give equal tokens. Returns int32."""
    # declared: numpy's stubs type uint64 array-by-uint64-scalar arithmetic as Any for Python 3.10
    x: npt.NDArray[np.uint64] = pseudo.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    h: npt.NDArray[np.uint64] = x % np.uint64(vocab)
    return h.astype(np.int32)


class Conversations(NamedTuple):
    """The demo's requests in trace order: int32 prompts, ``output_length`` and conversation
    index of each, and how many conversations."""

    prompts: list[np.ndarray]
    outputs: np.ndarray
    session: np.ndarray
    n_sessions: int


def conversation_prompts(n: int, tokens_per_block: int, vocab: int, *, min_turns: int = 3,
                         max_blocks: int = 48, scan: int = 3000, trace: str = "conversation") -> Conversations:
    """The first ``n`` requests (trace order) of the conversations of at least ``min_turns``
    turns whose prompts stay within ``max_blocks`` blocks, among the first ``scan`` requests
    of a bundled Mooncake trace (:func:`radixkv.bench.traces.find_sessions`), as int32
    prompts (see the module docstring). Raises ``InvalidArgumentError`` when there are fewer."""
    from radixkv.bench.traces import find_sessions, load_mooncake
    from radixkv.data import mooncake_trace

    t = load_mooncake(str(mooncake_trace(trace)), limit=scan)
    k = int(tokens_per_block)
    off = t.hash_offsets
    n_blk = np.diff(off)
    chains = [c for c in find_sessions(t) if len(c) >= min_turns and int(n_blk[c].max()) <= max_blocks]
    session = np.full(len(t), -1, dtype=np.int64)
    taken = 0
    for s, c in enumerate(chains):
        if taken >= n:
            break
        session[c] = s
        taken += len(c)
    rows = np.flatnonzero(session >= 0)[:n]
    if rows.size < n:
        raise InvalidArgumentError(f"only {rows.size} requests in conversations of >= {min_turns} turns "
                                   f"within the first {scan} of the trace; ask for fewer")
    last = t.input_length - t.block_size * (n_blk - 1)
    lens = (n_blk - 1) * k + np.maximum(1, -(-last * k // t.block_size))
    prompts = []
    for r in rows.tolist():
        pseudo = (t.hash_ids[off[r]:off[r + 1], None] * k + np.arange(k)).reshape(-1)[:lens[r]]
        prompts.append(token_hash(pseudo, vocab))
    sess = np.unique(session[rows], return_inverse=True)[1]
    return Conversations(prompts, t.output_length[rows], sess, int(sess.max()) + 1)


# ----------------------------------------------------------------------------- the main job
def run_demo(embedded: bool = False, requests: int = 96, device: str = "cpu", *, decode_tokens: int = 4,
             tokens_per_block: int = 16, workers: int = 2, verify_every: int = 1, page_size: int = 16,
             kv_tokens: int = 32768, state_slots: int = 96, timeout_s: float = 600.0,
             out: TextIO | None = None) -> int:
    """Run the demo (see the module docstring) and print its table to ``out`` (stdout).

    ``requests``: how many requests of :func:`conversation_prompts`; conversation ``s`` runs
    on worker ``s % workers``, in trace order; each decodes
    ``min(decode_tokens, output_length)`` tokens; every ``verify_every``-th request of a
    worker is checked against ``forward_reference`` (1: all). Returns 0 when every check
    passed, 1 otherwise (a mismatch, a worker error, broken invariants, an unclean stop)."""
    out = out or sys.stdout
    if requests < 1 or workers < 1 or decode_tokens < 0 or verify_every < 0:
        raise InvalidArgumentError("requests and workers must be >= 1, decode_tokens and verify_every >= 0")
    model = demo_model_config()
    conv = conversation_prompts(requests, tokens_per_block, model.vocab)
    prompts = conv.prompts
    steps = np.minimum(conv.outputs, decode_tokens).tolist()
    width = -(-(max(p.size for p in prompts) + decode_tokens + 1) // 64) * 64
    cfg = engine_config_for(model, device=device, kv_tokens=max(kv_tokens, 4 * width), page_size=page_size,
                            state_slots=state_slots, request_rows=max(8, 2 * workers), max_context_len=width,
                            lease_ttl_s=60.0)
    jobs = [[(f"req-{i:04d}", prompts[i], int(steps[i])) for i in range(len(prompts)) if conv.session[i] % workers == w]
            for w in range(workers)]
    mode = "embedded (one process)" if embedded else f"service: manager + {workers} worker processes"
    print(f"radixkv demo [{mode}] on {device}: {len(prompts)} requests of {conv.n_sessions} multi-turn "
          f"conversations of the Mooncake conversation trace\n"
          f"  (each turn resends the earlier ones; a conversation stays on one worker, the workers share one cache, "
          f"page size {page_size});\n"
          f"  each 512-token block -> {tokens_per_block} pseudo-tokens, mapped into the model's {model.vocab}-token "
          f"vocab by a fixed per-token hash (equal prefixes stay equal);\n"
          f"  model {model.layer_pattern} (KDA + full attention) fp64, hidden {model.hidden}; "
          f"up to {decode_tokens} greedy decode tokens each", file=out)
    t0 = time.perf_counter()
    run = _run_embedded if embedded else _run_service
    res = run(cfg, model, jobs, verify_every, tokens_per_block, timeout_s)
    res["wall_s"] = time.perf_counter() - t0
    res["expected"], res["verify_every"], res["embedded"] = len(prompts), verify_every, embedded
    res["tol"] = TOLERANCE[model.dtype]
    from radixkv.bench.traces import BlockTrace

    # the order both runs take (the workers' k-th requests side by side), at the cache's page size
    order = [jobs[w][k][1] for k in range(max(map(len, jobs))) for w in range(workers) if k < len(jobs[w])]
    res["bound"] = BlockTrace.from_token_requests(order, page_size).infinite_hit_tokens()
    return _report(res, out)


def _progress(total: int) -> tqdm:
    from radixkv.bench.progress import Progress

    return Progress(total, "requests")


def _run_embedded(cfg: EngineConfig, model_cfg: HybridConfig, jobs: list[list[Job]], verify_every: int, block: int,
                  timeout_s: float) -> dict[str, Any]:
    from radixkv.engine.embedded import CacheEngine
    from radixkv.reference import HybridModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: more threads only spin against each other (as in the workers)
    engine = CacheEngine(cfg)
    model = HybridModel(model_cfg, cfg.device)
    res: dict[str, Any] = {"reports": [], "latencies": [], "errors": [], "peak": (0, 0)}
    timed = [TimedEngine(engine) for _ in jobs]
    runners = []
    for w, t in enumerate(timed):
        info = t.attach(f"worker-{w}")
        runners.append((t, info.session, HybridWorker(t, info.session, engine.worker_buffers(), model, block=block,
                                                      name=f"worker-{w}")))
    order = sorted((k * len(jobs) + w, w, k) for w, js in enumerate(jobs) for k in range(len(js)))
    res["window"] = [time.time(), None]
    try:
        with _progress(len(order)) as bar:
            for _, w, k in order:
                rid, prompt, steps = jobs[w][k]
                rep = runners[w][2].run_request(rid, prompt, steps, verify=verify_every > 0 and k % verify_every == 0)
                res["reports"].append(rep._asdict())
                res["peak"] = _peak(res["peak"], engine.stats())
                bar.update(1)
        res["window"][1] = time.time()
        engine.check_invariants()
        res["stats"] = engine.stats()
        for t, s, _ in runners:
            t.detach(s)
        res["invariants"] = True
    except RadixKVError as e:
        res["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        res["latencies"] = [x for t in timed for x in t.latencies]
        engine.close()
        torch.set_num_threads(threads)
    res["shutdown"] = "in-process engine closed"
    return res


def _peak(peak: tuple[int, int], st: Any) -> tuple[int, int]:
    return (max(peak[0], st.kv_capacity - st.kv_available), max(peak[1], st.state_capacity - st.state_available))


def _run_service(cfg: EngineConfig, model_cfg: HybridConfig, jobs: list[list[Job]], verify_every: int, block: int,
                 timeout_s: float) -> dict[str, Any]:
    from radixkv.service.client import connect
    from radixkv.service.server.cli import main as serve_main

    ctx = mp.get_context("spawn")
    res: dict[str, Any] = {"reports": [], "latencies": [], "errors": [], "peak": (0, 0)}
    tmp = tempfile.mkdtemp(prefix="radixkv-demo-")  # 0700
    token, operator = secrets.token_urlsafe(24), secrets.token_urlsafe(24)  # the workers', the monitor's
    token_file, operator_file, cfg_file, shm = (os.path.join(tmp, n) for n in ("token", "operator", "engine.json",
                                                                                 "shm"))
    os.mkdir(shm, 0o700)
    for path, secret in ((token_file, token), (operator_file, operator)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, secret.encode())
        os.close(fd)
    with open(cfg_file, "w", encoding="utf-8") as f:
        json.dump(cfg.to_dict(), f)
    address = f"unix://{tmp}/manager.sock"
    argv = ["serve", "--address", address, "--token-file", token_file, "--operator-token-file", operator_file,
            "--config", cfg_file, "--shm-dir", shm, "--log-level", "WARNING", "--grace-s", "2",
            "--sweep-interval-s", "0.5"]
    server = ctx.Process(target=serve_main, args=(argv,), name="radixkv-manager", daemon=True)
    procs: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        server.start()
        with connect(address, token=operator, wait_s=120, timeout_s=60) as mon:  # CheckInvariants needs it
            q = ctx.Queue()
            for w, js in enumerate(jobs):
                p = ctx.Process(target=worker_main, args=(address, token, f"worker-{w}", model_cfg, js, verify_every,
                                                          block, q), name=f"radixkv-worker-{w}", daemon=True)
                p.start()
                procs.append(p)
            _collect(q, mon, procs, sum(len(j) for j in jobs), res, deadline)
            if not res["errors"]:
                mon.check_invariants()
                res["stats"] = mon.stats()
                res["invariants"] = True
    except RadixKVError as e:
        res["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        for p in procs:
            p.join(max(1.0, min(30.0, deadline - time.monotonic())))
            if p.is_alive():
                p.kill()
                p.join(10)
        res["shutdown"] = _stop_server(server, shm)
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def _collect(q: Queue[tuple[str, Any]], mon: RemoteCacheEngine, procs: Sequence[BaseProcess], total: int,
             res: dict[str, Any], deadline: float) -> None:
    """Drain worker reports until every worker is done (or failed, or the deadline)."""
    import queue

    done = 0
    with _progress(total) as bar:
        while done < len(procs):
            if time.monotonic() > deadline:
                res["errors"].append("timed out waiting for the workers")
                return
            try:
                kind, payload = q.get(timeout=0.5)
            except queue.Empty:
                res["peak"] = _peak(res["peak"], mon.stats())
                if not any(p.is_alive() for p in procs) and q.empty():
                    res["errors"].append("a worker exited without reporting")
                    return
                continue
            if kind == "request":
                res["reports"].append(payload)
                bar.update(1)
                if len(res["reports"]) % 8 == 0:
                    res["peak"] = _peak(res["peak"], mon.stats())
            elif kind == "done":
                res["latencies"].extend(payload["latencies"])
                w0, w1 = res.get("window") or (payload["t_start"], payload["t_end"])
                res["window"] = [min(w0, payload["t_start"]), max(w1, payload["t_end"])]
                done += 1
            else:
                res["errors"].append(payload)
                return


def _stop_server(server: BaseProcess, shm: str) -> str:
    """SIGTERM the manager (graceful: drains, detaches, removes its shared memory); SIGKILL
    if it hangs. Returns a one-line verdict that starts with ``clean`` only on success."""
    if server.pid is None:
        return "not started"
    if server.is_alive():
        os.kill(server.pid, signal.SIGTERM)
        server.join(30)
    if server.is_alive():
        server.kill()
        server.join(10)
        return "KILLED: the manager did not stop on SIGTERM"
    left = os.listdir(shm) if os.path.isdir(shm) else []
    if server.exitcode != 0 or left:
        return f"UNCLEAN: exit code {server.exitcode}, shared-memory files left: {left}"
    return "clean (SIGTERM, exit code 0, shared memory removed)"


def _report(res: dict[str, Any], out: TextIO) -> int:
    reps = res["reports"]
    n = len(reps)
    prompt = sum(r["prompt_len"] for r in reps)
    hit = sum(r["prefix_len"] for r in reps)
    kv_hit = sum(r["kv_prefix_len"] for r in reps)
    checked = [r for r in reps if r["verified"]]
    bad = [r["rid"] for r in checked if not r["ok"]]
    worst = max((r["max_abs_diff"] for r in checked), default=float("nan"))
    lat = np.asarray(res["latencies"], dtype=np.float64) * 1e3
    p50, p99 = (np.percentile(lat, 50), np.percentile(lat, 99)) if lat.size else (float("nan"),) * 2
    st = res.get("stats")
    win = res.get("window") or (None, None)
    serving = (win[1] - win[0]) if win[1] is not None else 0.0
    decoded = sum(r["decoded"] for r in reps)
    prefill = sum(r["computed"] for r in reps) - decoded
    rows = [
        ("requests", f"{n} ({decoded} tokens decoded)"),
        ("token hit rate", f"{hit / prompt:.1%} of prompt tokens reused (state + KV; KV alone cached "
                           f"{kv_hit / prompt:.1%}); bound (an unbounded cache, same order): "
                           f"{res['bound'] / prompt:.1%}" if prompt else "-"),
        ("prefill computed", f"{prefill} of {prompt} prompt tokens: {1 - prefill / prompt:.1%} of the prefill "
                             f"computation saved" if prompt else "-"),
        ("state checkpoints", f"{sum(r['checkpoints'] for r in reps)} chunk ends cached with their state"),
        ("requests/s", (f"{n / serving:.1f} ({serving:.1f} s serving" + ("" if res["embedded"] else
                        f"; {res['wall_s']:.1f} s in all, with process start-up") + ")") if serving else "-"),
        ("call latency" if res["embedded"] else "RPC latency",
         f"p50 {p50:.2f} ms, p99 {p99:.2f} ms over {lat.size} calls" + (" (in-process)" if res["embedded"] else "")),
    ]
    if st is not None:
        rows += [("KV pool", f"{st.kv_capacity - st.kv_available}/{st.kv_capacity} tokens in use at the end "
                             f"(peak {res['peak'][0]}), {st.evicted_tokens} evicted"),
                 ("state pool", f"{st.state_capacity - st.state_available}/{st.state_capacity} slots in use at the "
                                f"end (peak {res['peak'][1]})")]
    rows += [("logits checked", f"{len(checked) - len(bad)}/{len(checked)} requests equal to forward_reference "
                                f"(max |diff| {worst:.2e}, tol {res['tol']:g})"),
             ("invariants", "hold" if res.get("invariants") else "NOT CHECKED"),
             ("shutdown", res["shutdown"])]
    w = max(len(k) for k, _ in rows)
    print("", file=out)
    for k, v in rows:
        print(f"  {k:<{w}}  {v}", file=out)
    for e in res["errors"]:
        print(f"ERROR: {e}", file=out)
    if bad:
        print(f"MISMATCH: requests {bad[:10]} differ from forward_reference", file=out)
    ok = bool(not res["errors"] and not bad and res.get("invariants") and n == res["expected"]
              and (checked or not res["verify_every"]) and res["shutdown"].startswith(("clean", "in-process")))
    print("demo " + ("passed" if ok else "FAILED"), file=out)
    return 0 if ok else 1


# ----------------------------------------------------------------------------- walk-through
def run_walkthrough(device: str = "cpu") -> int:
    """An embedded walk-through of one scheduler cycle on a KV-only model: two requests
    share a 40-token system prompt; A is prefilled, decodes 6 tokens and is released into
    the tree; B finds the prefix, reuses A's KV rows (checked on the data: K holds each
    token's id) and computes only its own tokens. After every step it prints where every KV
    slot is and checks conservation and every structure's invariants. Returns 0 when B read
    A's tokens back, else 1."""
    from radixkv.allocator import TokenToKVPoolAllocator
    from radixkv.cache import RadixCache
    from radixkv.cache.kv_conservation import check_conservation, conservation
    from radixkv.memory import MHATokenToKVPool, ReqToTokenPool
    from radixkv.scheduler.batch import Batch
    from radixkv.scheduler.flow import alloc_for_decode, alloc_for_extend, release_kv_cache
    from radixkv.scheduler.req import Req

    dev = torch.device(device)
    pool = ReqToTokenPool(4, 128, device=dev)
    kv = MHATokenToKVPool(256, 1, torch.float32, head_num=2, head_dim=8, layer_num=2, device=dev)
    alloc = TokenToKVPoolAllocator(256, device=dev, need_sort=True, kvcache=kv)
    tree = RadixCache(pool, alloc, page_size=1)
    running: list[Any] = []
    rng = np.random.default_rng(0)

    def show(title: str) -> None:
        c = conservation(alloc, tree, running)
        check_conservation(alloc, tree, running)
        alloc.check_invariants()
        pool.check_invariants()
        tree.check_invariants()
        print(f"\n== {title}")
        print(f"   KV slots: {c.available:4d} free | {c.evictable:4d} evictable in tree | {c.protected:4d} protected "
              f"in tree | {c.held_by_requests:4d} held by requests | {c.pool_size} total  (conservation holds)")
        print(f"   request rows free: {pool.available_size()}/{pool.size}")
        for r in running:
            row = pool.req_to_token[r.req_pool_idx, :r.kv_committed_len].tolist()
            print(f"   {r.rid}: row {r.req_pool_idx}, {r.kv_committed_len} tokens with KV, {r.prefix_len} reused "
                  f"from the tree; req_to_token[{r.req_pool_idx}, :8] = {row[:8]}")

    def step(reqs: list[Any], decode: bool) -> Any:
        if decode:
            for r in reqs:
                r.append_output(int(rng.integers(1000, 2000)))
        batch = Batch(reqs, pool, alloc, tree, kv_pool=kv)
        (alloc_for_decode if decode else alloc_for_extend)(batch)
        running.extend(r for r in reqs if r not in running)
        if batch.prefix_lens is None or batch.extend_lens is None or batch.out_cache_loc is None:
            raise InvariantError("the scheduler left the batch without its allocation")
        # stand-in for a forward pass: each new token's K/V is its token id
        new = torch.cat([torch.as_tensor(r.fill_ids[int(p):int(p) + int(e)])
                         for r, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)])
        val = new.to(torch.float32).view(-1, 1, 1).expand(-1, 2, 8).to(dev)
        for layer in range(2):
            kv.set_kv_buffer(layer, batch.out_cache_loc, val, val)
        return batch

    def release(r: Any) -> None:
        release_kv_cache(r, tree, pool)
        running.remove(r)
        show(f"release {r.rid}: its tokens are cached in the tree")

    system = rng.integers(0, 1000, 40).astype(np.int32)
    a = Req("req-A", np.concatenate([system, rng.integers(0, 1000, 12).astype(np.int32)]))
    b = Req("req-B", np.concatenate([system, rng.integers(0, 1000, 20).astype(np.int32)]))
    print(f"radixkv walk-through on {device}: two requests share a {system.size}-token system prompt")
    show("start")
    batch = step([a], decode=False)
    show(f"extend ['req-A']: {batch.extend_num_tokens} new KV slots, prefix lens {batch.prefix_lens.tolist()}")
    for _ in range(6):
        step([a], decode=True)
    show("req-A decoded 6 tokens")
    release(a)
    batch = step([b], decode=False)
    show(f"extend ['req-B']: {batch.extend_num_tokens} new KV slots, prefix lens {batch.prefix_lens.tolist()}")
    reused = kv.get_key_buffer(0)[b.prefix_indices][:, 0, 0].to(torch.int64).cpu().numpy()
    ok = b.prefix_len > 0 and np.array_equal(reused, b.fill_ids[:b.prefix_len])
    print(f"   req-B reads {b.prefix_len} cached K rows written by req-A: "
          f"{'they hold its prompt tokens' if ok else 'MISMATCH'}")
    for _ in range(4):
        step([b], decode=True)
    release(b)
    show(f"evict everything unlocked: {tree.evict(10_000)} slots back to the allocator")
    return 0 if ok else 1
