"""Hybrid (KV + Mamba state) hit-rate replay through the real ``MambaRadixCache``.

A hybrid model skips a prefix only where both its KV and the state at its end are cached, so
two budgets matter: KV tokens and state slots. Each prompt runs as a chunked prefill: match
``prompt[:-1]``, lock, take a working slot, insert KV at each chunk end (first at
``kv_prefix_len`` with ``checkpoint``) and admit a state where the policy agrees, hand the
slot over at the end. Above page size 1 states sit at page ends (tracked with ``track``).
:func:`replay_tree` drives the tree's API (fast); :func:`replay_flow` the real scheduler flow
and pools (exact, the cross-check); ``admission=None`` replays a KV-only ``RadixCache``.
``working_slot=True``: ``slots`` counts only the states the cache may keep. Results
(:class:`HybridReplayResult`): token hit, KV match, state hits, FLOPs saved, evictions.
Cost: O(prompt tokens) numpy work per request plus the tree's. The algorithm in full:
``docs/hitrate.md``, "The hybrid replay".
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache import RadixCache
from radixkv.cache.hybrid.mamba_policies import FlopModel, FlopStateOrder, StateEvictionOrder
from radixkv.cache.hybrid.mamba_radix_cache import MambaMatchResult, MambaRadixCache
from radixkv.cache.radix_cache import MatchResult
from radixkv.errors import InvalidArgumentError
from radixkv.memory import HybridReqToTokenPool, KimiLinearStateShape, MambaPool, ReqToTokenPool
from radixkv.memory.host_state_pool import HostStatePool
from radixkv.scheduler.batch import Batch
from radixkv.scheduler.flow import alloc_for_extend, release_kv_cache
from radixkv.scheduler.req import Req

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.progress import ProgressBar

__all__ = ["KIMI", "KDA_LAYERS", "mamba_pool", "chunk_ends", "kv_budget", "HybridReplayResult",
           "replay_tree", "replay_flow", "parse_state_policy", "state_policy_label"]

#: the Kimi-Linear-shaped state of the benchmarks (2 heads x 16 x 16, conv kernel 4), 4 KDA layers
KIMI = KimiLinearStateShape.create(num_heads=2, head_dim=16, conv_kernel_size=4)
KDA_LAYERS = 4

StatePolicy = str | StateEvictionOrder


def mamba_pool(slots: int) -> MambaPool:
    """A fp32 CPU ``MambaPool`` of ``slots`` Kimi-shaped slots (``KDA_LAYERS`` layers)."""
    return MambaPool.from_state_shape(slots, KIMI, KDA_LAYERS, torch.float32)


def parse_state_policy(text: str) -> StatePolicy:
    """``lru`` / ``flop`` (a name), or ``flop:ALPHA`` (a :class:`FlopStateOrder` with that
    alpha). Raises InvalidArgumentError for anything else."""
    name, _, alpha = text.strip().lower().partition(":")
    if name not in ("lru", "flop") or (alpha and name != "flop"):
        raise InvalidArgumentError(f"unknown state eviction policy {text!r}; known: lru, flop, flop:ALPHA")
    if not alpha:
        return name
    try:
        return FlopStateOrder(alpha=float(alpha))
    except ValueError:
        raise InvalidArgumentError(f"bad alpha in {text!r}") from None


def state_policy_label(policy: StatePolicy) -> str:
    """``lru``, ``flop`` or ``flop(alpha=A)`` (alpha 1.0 is plain ``flop``)."""
    if isinstance(policy, FlopStateOrder):
        return "flop" if policy.alpha == 1.0 else f"flop(alpha={policy.alpha:g})"
    return policy if isinstance(policy, str) else policy.name


def kv_budget(unique_tokens: int, frac: float, max_prompt: int) -> int:
    """KV tokens for a capacity fraction: ``int(frac * unique_tokens)``, raised to
    ``max_prompt + 1`` so that the longest prompt fits (the replay runs one at a time)."""
    return max(int(unique_tokens * frac), int(max_prompt) + 1)


def chunk_ends(m: MatchResult | MambaMatchResult, size: int, chunk: int, checkpoint: bool) -> list[int]:
    """Where the prefill of a ``size``-token prompt stops: the checkpoint at ``kv_prefix_len``
    (when the KV match passes the deepest state), then every ``chunk`` tokens from there."""
    kv_len = getattr(m, "kv_prefix_len", m.prefix_len)
    ends = [kv_len] if checkpoint and m.prefix_len < kv_len else []
    start = ends[-1] if ends else m.prefix_len
    while start + chunk < size:
        start += chunk
        ends.append(start)
    return ends + [size]


class HybridReplayResult(NamedTuple):
    """Totals of one replay (tokens unless named). ``hit_tokens``: skipped prefill (a state
    hit's ``prefix_len``); ``kv_hit_tokens``: the KV match (``kv_prefix_len``; for the KV-only
    tree the hit itself); ``state_hits``: requests that skipped anything."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    kv_hit_tokens: int
    state_hits: int
    flops_saved: float
    flops_total: float
    evicted_tokens: int
    evicted_states: int
    kv_tokens_end: int
    states_end: int | None
    seconds: float

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def lost_tokens(self) -> int:
        """KV-matched tokens that could not be skipped for lack of a state."""
        return self.kv_hit_tokens - self.hit_tokens

    def as_bench_dict(self) -> dict[str, float | int]:
        """``bench_mamba.py``'s per-run JSON (rounded; FLOP fields only with states)."""
        out: dict[str, float | int] = {"hit_rate": round(self.token_hit_rate, 4), "seconds": round(self.seconds, 1)}
        if self.states_end is not None:
            out["flop_saved"] = round(self.flops_saved / self.flops_total, 4) if self.flops_total else 0.0
            out["states_in_tree_end"] = self.states_end
        out["kv_tokens_in_tree_end"] = self.kv_tokens_end
        return out


class _Tally:
    """Running totals of a replay, and the counting wrapper around ``tree.evict``."""

    def __init__(self, tree: RadixCache, model: FlopModel | None):
        self.tree, self.model = tree, model
        self.n = self.prompt = self.hit = self.kv = self.state_hits = 0
        self.flops = [0.0, 0.0]
        self.ev_tok = self.ev_st = 0
        self.t0 = time.perf_counter()
        evict = tree.evict

        def counted(num_tokens: int, num_states: int | None = None) -> object:
            r = evict(num_tokens) if num_states is None else evict(num_tokens, num_states)  # type: ignore[call-arg]
            if isinstance(r, tuple):
                self.ev_tok += int(r[0])
                self.ev_st += int(r[1])
            else:
                self.ev_tok += int(r)
            return r

        setattr(tree, "evict", counted)  # noqa: B010 - an instance attribute: the flow's evictions count too

    def add(self, pre: int, kv: int, size: int) -> None:
        self.n += 1
        self.prompt += size
        self.hit += pre
        self.kv += kv
        self.state_hits += pre > 0
        if self.model is not None:
            self.flops[0] += float(self.model.prefix_flops(np.asarray(pre)))
            self.flops[1] += float(self.model.prefix_flops(np.asarray(size)))

    def result(self, mamba: MambaPool | None) -> HybridReplayResult:
        tree: Any = self.tree  # a MambaRadixCache when mamba is set
        tree.check_invariants()
        return HybridReplayResult(self.n, self.prompt, self.hit, self.kv, self.state_hits, self.flops[0],
                                  self.flops[1], self.ev_tok, self.ev_st, int(tree.total_size()),
                                  None if mamba is None else int(tree.mamba_total_size()),
                                  time.perf_counter() - self.t0)


def _pool_size(slots: int, working_slot: bool, track_slots: int = 0) -> int:
    """The Mamba pool for ``slots`` (plus the working slot, plus a tracking request's
    ``track_slots``)."""
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or slots < (0 if working_slot else 2):
        raise InvalidArgumentError(f"state slots must be an int >= {0 if working_slot else 2}, got {slots!r}")
    return int(slots) + (1 if working_slot else 0) + track_slots


def _check_page(page_size: int) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise InvalidArgumentError(f"page_size must be an int >= 1, got {page_size!r}")
    return int(page_size)


def _trim(tree: MambaRadixCache, slots: int) -> None:
    """Keep at most ``slots`` states between requests (``working_slot`` mode)."""
    excess = tree.mamba_total_size() - slots
    if excess > 0:
        tree.evict(0, excess)


class _BudgetRows:
    """The replay's allocator for loads back from the host KV tier: fresh virtual row ids
    (above any the replay hands out itself) while the tree's device tokens stay within
    ``kv_tokens``; frees are no-ops (the ids are never reused). O(1) a call."""

    page_size = 1

    def __init__(self, kv_tokens: int) -> None:
        self.kv_tokens = kv_tokens
        self.tree: Any = None
        self.next = 1 << 30

    def available_size(self) -> int:
        return max(self.kv_tokens - int(self.tree.total_size()), 0)

    def alloc(self, need: int) -> torch.Tensor | None:
        if need > self.available_size():
            return None
        self.next += need
        return torch.arange(self.next - need, self.next, dtype=torch.int64)

    def free(self, rows: object) -> None:
        return None


def _tiered_tree(mamba: MambaPool, ps: int, kv_tokens: int, host_kv_tokens: int, host_slots: int,
                 kv_policy: str, admission: str, policy: StatePolicy, write_policy: str = "write_back") -> Any:
    """A TieredMambaRadixCache for the replay: host KV of ``host_kv_tokens`` (bookkeeping
    only: :class:`~radixkv.bench.tier_engine.CountingHostPool` moves no bytes) beside a host
    state tier of ``host_slots`` states, loads taking virtual rows (:class:`_BudgetRows`), the
    host KV tier under ``write_policy``."""
    from radixkv.bench.tier_engine import CountingHostPool
    from radixkv.cache.hybrid.tiered_mamba_cache import TieredMambaRadixCache
    from radixkv.memory.kv_pool import MHATokenToKVPool

    if not host_slots:
        raise InvalidArgumentError("a hybrid host KV tier needs --host-state-slots > 0 (KV is kept with a state)")
    rows = _BudgetRows(kv_tokens)
    kv = MHATokenToKVPool(ps, ps, torch.float16, 1, 1, 1)
    tree = TieredMambaRadixCache(None, cast(Any, rows), host_pool=CountingHostPool(kv, max(host_kv_tokens // ps, 1)),
                                 host_state_pool=HostStatePool(mamba, host_slots), page_size=ps,
                                 eviction_policy=kv_policy, admission_policy=admission, mamba_pool=mamba,
                                 state_eviction_policy=policy, checks=False, write_policy=write_policy)
    rows.tree = tree
    return tree


def replay_tree(requests: Iterable[np.ndarray], kv_tokens: int, slots: int, chunk: int,
                admission: str | None = None, policy: StatePolicy = "lru", checkpoint: bool = False,
                kv_policy: str = "lru", working_slot: bool = False, progress: ProgressBar | None = None,
                page_size: int = 1, track: bool = True, host_slots: int = 0,
                host_kv_tokens: int = 0, write_policy: str = "write_back") -> HybridReplayResult:
    """The tree's own API with the flow's request semantics (see the module docstring);
    KV rows are virtual ids (no allocator: the tree plus the running request hold at most
    ``kv_tokens``, which must exceed the longest prompt). ``admission None``: KV-only tree.
    ``page_size`` / ``track``: see the module docstring. ``host_slots``: the host state tier
    (evicted states demoted there, a match reaching one loads it back, as the flow does).
    ``host_kv_tokens`` (with ``host_slots``): the host KV tier too (a ``TieredMambaRadixCache``,
    under ``write_policy``).

    Raises InvalidArgumentError for bad slots / page size / policy names (before any work).
    """
    ps = _check_page(page_size)
    mamba = None if admission is None else mamba_pool(_pool_size(slots, working_slot))
    host = HostStatePool(mamba, host_slots) if host_slots and mamba is not None else None
    # Any: a RadixCache, or a MambaRadixCache when admission is set (the state calls below run only then)
    tree: Any = (RadixCache(None, None, page_size=ps, eviction_policy=kv_policy) if admission is None else
                 MambaRadixCache(None, None, page_size=ps, eviction_policy=kv_policy, mamba_pool=mamba,
                                 admission_policy=admission, state_eviction_policy=policy, checks=False,
                                 host_state_pool=host))
    if host_kv_tokens and admission is not None and mamba is not None:
        tree = _tiered_tree(mamba, ps, kv_tokens, host_kv_tokens, host_slots, kv_policy, admission, policy,
                            write_policy)
    tally = _Tally(tree, None if mamba is None else tree.flop_model)
    next_row = 1
    for toks in requests:
        size = toks.size
        if progress is not None:
            progress.update(1)
        if size < 2:
            continue
        m = tree.match_prefix(toks[:size - 1])
        if getattr(m, "host_len", 0):
            m = tree.load_back(m)
        locked, held = m.last_node, m.prefix_len
        tree.inc_lock_ref(locked)
        slot = None
        if mamba is not None:
            if mamba.available_size() == 0:
                tree.evict(0, 1)
            slot = int(cast(torch.Tensor, mamba.alloc(1))[0])  # never None: the request pins one node at most
        rows = np.concatenate([m.device_indices.numpy(), np.arange(next_row, next_row + size, dtype=np.int64)])
        next_row += size
        for end in chunk_ends(m, size, chunk, checkpoint):
            a = end - end % ps  # the page end the tree can hold (= end at page size 1)
            stated = a == end or track  # a state there: the step's own, or the tracked one
            short = tree.total_size() + (end - held) - kv_tokens
            if short > 0:
                tree.evict(short)
            if end == size:
                if slot is None:
                    tree.insert(toks[:a], rows[:a])
                elif a and stated:
                    tree.insert_with_state(toks[:a], rows[:a], slot)  # kept, or freed
                else:
                    tree.insert(toks[:a], rows[:a])
                    cast(MambaPool, mamba).free(slot)
                break
            if mamba is None or a == 0:  # a KV-only tree gains nothing from chunk-end inserts
                continue
            if a == held:  # no new page: nothing new to insert, no state the tree lacks here
                continue
            node = tree.insert_with_state(toks[:a], rows[:a], None).node
            tree.inc_lock_ref(node)
            tree.dec_lock_ref(locked)
            locked, held = node, a
            if stated and tree.state_slot(node) is None and tree.admission.admit(tree, node, False):
                if mamba.available_size() == 0:
                    tree.evict(0, 1)
                if mamba.available_size():
                    tree.insert_with_state(toks[:a], rows[:a], int(cast(torch.Tensor, mamba.alloc(1))[0]))
        tree.dec_lock_ref(locked)
        if working_slot and mamba is not None:
            _trim(tree, slots)
        tally.add(m.prefix_len, getattr(m, "kv_prefix_len", m.prefix_len), size)
    return tally.result(mamba)


def replay_flow(requests: Iterable[np.ndarray], max_prompt: int, kv_tokens: int, slots: int, chunk: int,
                admission: str | None = None, policy: StatePolicy = "lru", checkpoint: bool = False,
                kv_policy: str = "lru", working_slot: bool = False, progress: ProgressBar | None = None,
                page_size: int = 1, track: bool = True, host_slots: int = 0) -> HybridReplayResult:
    """The same through the real scheduler flow and pools (a ``TokenToKVPoolAllocator`` of
    ``kv_tokens`` -- paged above page size 1 --, request rows ``max_prompt + 1`` wide, the
    track buffer above page size 1 with ``track``). Exact but slow at trace scale (the
    allocator's work grows with the pool): a cross-check of :func:`replay_tree`."""
    ps = _check_page(page_size)
    width = int(max_prompt) + 1
    kv_tokens = -(-kv_tokens // ps) * ps
    alloc: TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator = (
        TokenToKVPoolAllocator(kv_tokens, device="cpu") if ps == 1
        else PagedTokenToKVPoolAllocator(kv_tokens, ps, "cpu"))
    mamba = None
    tracking = track and ps > 1
    pool: ReqToTokenPool
    tree: Any  # a RadixCache, or a MambaRadixCache when admission is set (as in replay_tree)
    if admission is None:
        pool = ReqToTokenPool(2, width)
        tree = RadixCache(pool, alloc, page_size=ps, eviction_policy=kv_policy)
    else:
        mamba = mamba_pool(_pool_size(slots, working_slot, 2 if tracking else 0))
        pool = HybridReqToTokenPool(2, width, mamba_pool=mamba, enable_mamba_extra_buffer=tracking)
        tree = MambaRadixCache(pool, alloc, page_size=ps, eviction_policy=kv_policy, admission_policy=admission,
                               state_eviction_policy=policy,
                               host_state_pool=HostStatePool(mamba, host_slots) if host_slots else None)
    tally = _Tally(tree, None if mamba is None else tree.flop_model)
    for i, toks in enumerate(requests):
        if progress is not None:
            progress.update(1)
        if toks.size < 2:
            continue
        r = Req(str(i), toks)
        m = tree.match_prefix(toks[:toks.size - 1])  # what alloc_for_extend will find (host states loaded)
        if getattr(m, "host_len", 0):
            m = m._replace(prefix_len=m.prefix_len + m.host_len, host_len=0)
        pre = m.prefix_len
        for j, end in enumerate(chunk_ends(m, toks.size, chunk, checkpoint)):
            alloc_for_extend(Batch([r], pool, alloc, tree, fill_lens=[end]))
            if j == 0:
                pre = r.prefix_len
            if end < toks.size:
                tree.cache_unfinished_req(r)
        release_kv_cache(r, tree)
        if working_slot and mamba is not None:
            _trim(tree, slots)
        tally.add(pre, getattr(m, "kv_prefix_len", m.prefix_len), toks.size)
    return tally.result(mamba)


def configs_of(admissions: list[str], state_policies: list[StatePolicy],
               checkpoints: list[bool]) -> list[tuple[str, StatePolicy, bool]]:
    """Every (admission, state policy, checkpoint) combination, in that nesting order."""
    return [(a, p, c) for a in admissions for p in state_policies for c in checkpoints]
