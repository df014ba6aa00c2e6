"""The multi-turn workload of ``benchmarks/bench_vllm.py``: Mooncake conversation sessions cut down
to what a small CPU machine runs, as vLLM token-id prompts, plus the offline hit bounds.

* **Sessions.** The Mooncake trace has no session ids; its ``hash_ids`` are chained (one id
  names a whole prefix), so a request continues an earlier one when it contains that request's
  last *full* block (``hash_ids[-2]``): its whole earlier prompt minus the partial tail. The
  predecessor is the latest such request sharing at least ``min_shared`` blocks (the trace's
  common root block alone does not make a conversation). One dict probe per block.
* **Scaling.** Each 512-token Mooncake block becomes ``tokens_per_block`` tokens (the tail
  scaled proportionally, at least 1): :class:`radixkv.bench.traces.MooncakeTrace` with that
  block size derives the pseudo-tokens (block ``b`` -> ``b*S .. b*S+S-1``) exactly as every
  other radixkv benchmark does; :func:`to_vocab` then hashes them into the model's vocabulary
  (a 64-bit mix, vectorized), which keeps equal prefixes equal and makes distinct blocks differ.
* **Order and routing.** Round ``t`` holds turn ``t`` of every chosen session (session order).
  ``routing="alternate"`` (the default) sends turn ``t`` of session ``s`` to instance
  ``(s + t) % N``: every session moves to the next instance at each turn (and a round is spread
  evenly over the instances); ``"round-robin"`` sends the ``p``-th request of that order to
  instance ``p % N`` (with an odd number of sessions and ``N = 2`` that alternates too).
* **Bounds** (vLLM semantics: only full blocks are cached, a hit covers at most
  ``(len - 1) // block`` blocks so one token is always computed): the hit tokens of one
  unbounded cache shared by every request (:func:`hit_bound` with one group) and of one
  unbounded cache per instance (grouped by instance). Whole-array numpy.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixkv.bench.traces import (
    MOONCAKE_BLOCK_SIZE,
    BlockTrace,
    MooncakeTrace,
    find_sessions,
    load_mooncake,
)
from radixkv.errors import InvalidArgumentError

__all__ = ["ROUTINGS", "Workload", "alternation", "build_workload", "find_sessions", "hit_bound", "to_vocab"]


#: How the router picks an instance (see the module doc).
ROUTINGS = ("alternate", "round-robin")


@dataclass(frozen=True)
class Workload:
    """The replayed requests, in dispatch order.

    Attributes:
        prompts: int32 token ids per request (within ``[0, vocab)``).
        session: session index per request (0 .. ``n_sessions - 1``).
        turn: turn index within its session per request.
        instance: the router's choice per request.
        trace_index: the request's line in the Mooncake trace.
        n_instances: instances behind the router.
    """

    prompts: list[np.ndarray]
    session: np.ndarray
    turn: np.ndarray
    instance: np.ndarray
    trace_index: np.ndarray
    n_instances: int

    @property
    def n_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return int(sum(len(p) for p in self.prompts))

    def rounds(self) -> list[np.ndarray]:
        """Request indices of each round (turn ``t`` of every session), in dispatch order."""
        return [np.flatnonzero(self.turn == t) for t in range(int(self.turn.max()) + 1)]


def to_vocab(tokens: np.ndarray, vocab: int, salt: int = 0) -> np.ndarray:
    """Pseudo-tokens -> int32 ids in ``[0, vocab)`` by a splitmix64 finalizer (vectorized):
    equal inputs give equal ids; a whole block of distinct inputs colliding is negligible."""
    if vocab < 2:
        raise InvalidArgumentError(f"vocab must be >= 2, got {vocab}")
    x = tokens.astype(np.uint64) + np.uint64((0x9E3779B97F4A7C15 * (salt + 1)) & 0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab)).astype(np.int32)


def _scaled(trace: MooncakeTrace, rows: Sequence[int], tokens_per_block: int) -> MooncakeTrace:
    """The requests ``rows`` of ``trace`` with ``tokens_per_block``-token blocks."""
    rows_a = np.asarray(rows, dtype=np.int64)
    n_blk = np.diff(trace.hash_offsets)[rows_a]
    off = np.zeros(len(rows_a) + 1, dtype=np.int64)
    np.cumsum(n_blk, out=off[1:])
    ids = np.concatenate([trace.hash_ids[trace.hash_offsets[r]:trace.hash_offsets[r + 1]] for r in rows_a])
    last = trace.input_length[rows_a] - trace.block_size * (n_blk - 1)
    s = int(tokens_per_block)
    new_len = s * (n_blk - 1) + np.maximum(1, -(-last * s // trace.block_size))
    return MooncakeTrace(trace.name, trace.timestamp[rows_a], new_len, trace.output_length[rows_a], off, ids, s)


def build_workload(path: str, *, sessions: int, turns: int, tokens_per_block: int, max_prompt: int,
                   vocab: int, n_instances: int = 2, scan: int | None = 4000,
                   routing: str = "alternate") -> Workload:
    """The first ``sessions`` sessions of the trace's first ``scan`` requests with at least
    ``turns`` turns whose first ``turns`` scaled prompts fit ``max_prompt`` tokens; their first
    ``turns`` turns, round by round, routed over ``n_instances`` by ``routing`` (see the module doc).

    Raises:
        InvalidArgumentError: bad sizes, or fewer qualifying sessions than asked for.
    """
    if routing not in ROUTINGS:
        raise InvalidArgumentError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if sessions < 1 or turns < 1 or tokens_per_block < 1 or max_prompt < 2 or n_instances < 1:
        raise InvalidArgumentError("sessions, turns, tokens_per_block, n_instances must be >= 1, max_prompt >= 2")
    trace = load_mooncake(path, limit=scan, block_size=MOONCAKE_BLOCK_SIZE)
    n_blk = np.diff(trace.hash_offsets)
    last = trace.input_length - trace.block_size * (n_blk - 1)
    scaled_len = tokens_per_block * (n_blk - 1) + np.maximum(1, -(-last * tokens_per_block // trace.block_size))
    chosen = [c[:turns] for c in find_sessions(trace)
              if len(c) >= turns and int(scaled_len[c[:turns]].max()) <= max_prompt][:sessions]
    if len(chosen) < sessions:
        raise InvalidArgumentError(
            f"only {len(chosen)} sessions of >= {turns} turns with prompts <= {max_prompt} tokens "
            f"in the first {scan} requests of {path}; ask for fewer or raise max_prompt")
    order = [(t, s) for t in range(turns) for s in range(sessions)]
    if routing == "alternate":
        instance = np.asarray([(s + t) % n_instances for t, s in order], dtype=np.int64)
    else:
        instance = np.arange(len(order), dtype=np.int64) % n_instances
    rows = [chosen[s][t] for t, s in order]
    small = _scaled(trace, rows, tokens_per_block)
    prompts = [to_vocab(small.tokens(i), vocab) for i in range(len(small))]
    return Workload(prompts=prompts,
                    session=np.asarray([s for _, s in order], dtype=np.int64),
                    turn=np.asarray([t for t, _ in order], dtype=np.int64),
                    instance=instance,
                    trace_index=np.asarray(rows, dtype=np.int64), n_instances=int(n_instances))


def hit_bound(prompts: Sequence[np.ndarray], block_size: int, group: np.ndarray | None = None) -> np.ndarray:
    """Per request, the tokens an unbounded prefix cache would hit, replaying in order: one
    cache per value of ``group`` (``None``: one shared cache). A request stores its full
    blocks; it hits the longest prefix of its first ``(len - 1) // block_size`` blocks stored
    by an earlier request of its group."""
    bt = BlockTrace.from_token_requests(list(prompts), block_size)
    n = bt.n_requests
    sizes = np.diff(bt.offsets)
    req = np.repeat(np.arange(n), sizes)
    pos = np.arange(len(bt.blocks)) - bt.offsets[req]
    plen = bt.prompt_len[req]
    stored = pos < plen // block_size
    hittable = pos < (plen - 1) // block_size
    g = np.zeros(n, dtype=np.int64) if group is None else np.asarray(group, dtype=np.int64)
    key = g[req] * (bt.n_blocks + 1) + bt.blocks          # (group, block)
    uk, inv = np.unique(key, return_inverse=True)
    first_store = np.full(len(uk), np.iinfo(np.int64).max)
    np.minimum.at(first_store, inv[stored], req[stored])
    first = first_store[inv]
    hit = hittable & (first < req)                         # chained ids: hits form a prefix
    return np.bincount(req[hit], minlength=n).astype(np.int64) * block_size


def alternation(w: Workload) -> float:
    """Fraction of follow-up turns routed to a different instance than their previous turn."""
    later = np.flatnonzero(w.turn > 0)
    if not len(later):
        return 0.0
    prev_inst = np.empty(w.n_requests, dtype=np.int64)
    idx = {(int(s), int(t)): i for i, (s, t) in enumerate(zip(w.session, w.turn))}
    for i in later:
        prev_inst[i] = w.instance[idx[(int(w.session[i]), int(w.turn[i]) - 1)]]
    return float(np.mean(w.instance[later] != prev_inst[later]))
