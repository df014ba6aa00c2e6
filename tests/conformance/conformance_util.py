"""Helpers of the conformance scenarios (protocol only: ``stats()``, ``check_invariants()``
and the worker buffers are the only windows into an engine)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from radixkv.engine.protocol import EngineStats

PROTOCOL_CALLS = frozenset({
    "attach", "heartbeat", "detach", "match", "alloc_extend", "alloc_decode", "cache_unfinished",
    "cache_finished", "release", "evict", "stats", "flush", "take_events",
})


class FakeClock:
    """An injectable clock: ``clock()`` returns seconds; ``advance(s)`` moves it."""

    def __init__(self, start: float = 1000.0):
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += float(seconds)


def toks(values) -> np.ndarray:
    """Token ids as the protocol wants them: a 1-D int32 numpy array."""
    return np.asarray(values, dtype=np.int32).reshape(-1)


def rand_tokens(rng: np.random.Generator, n: int, vocab: int = 50) -> np.ndarray:
    return rng.integers(0, vocab, size=n).astype(np.int32)


def assert_law(s: EngineStats) -> None:
    """The conservation law of the stats (KV and states), and idle means nothing held."""
    assert s.kv_available + s.kv_evictable + s.kv_protected + s.kv_held == s.kv_capacity, s
    assert s.state_available + s.state_evictable + s.state_protected + s.state_held == s.state_capacity, s
    assert 0 <= s.rows_available <= s.rows_capacity, s
    assert s.rows_capacity - s.rows_available == s.requests, s
    if s.requests == 0:
        assert s.kv_held == 0 and s.kv_protected == 0 and s.state_held == 0 and s.state_protected == 0, s


class Checked:
    """Wraps an engine: after every protocol call (returning or raising) it runs
    ``check_invariants()`` and checks the conservation law of ``stats()``."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if name not in PROTOCOL_CALLS:
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.calls += 1
                self.engine.check_invariants()
                assert_law(self.engine.stats())

        return call


#: Stats the storage tier's writer thread moves on its own, whatever the calls do.
ASYNC_STATS = ("storage_written_pages", "storage_write_failed", "storage_pending", "storage_errors")


def settled(s: EngineStats) -> EngineStats:
    """``s`` without the counters that move on their own (:data:`ASYNC_STATS`)."""
    return s._replace(**dict.fromkeys(ASYNC_STATS, 0))


def fingerprint(engine: Any, buffers: Any = None) -> tuple:
    """What must not change when a call raises: the stats (but :data:`ASYNC_STATS`), and
    (given the worker buffers) the whole request-to-token table."""
    table = None if buffers is None else buffers.req_to_token.clone()
    return settled(engine.stats()), table


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and (a[1] is None or torch.equal(a[1], b[1]))


def expect_unchanged(engine: Any, exc: type[BaseException], fn: Callable[[], Any],
                     buffers: Any = None, match: str | None = None) -> BaseException:
    """``fn()`` raises ``exc`` and the engine (stats, req_to_token) is as before."""
    before = fingerprint(engine, buffers)
    with pytest.raises(exc, match=match) as info:
        fn()
    after = fingerprint(engine, buffers)
    assert same(before, after), f"state changed by a call that raised {exc.__name__}: {before[0]} -> {after[0]}"
    engine.check_invariants()
    return info.value


def write_token_kv(buffers: Any, loc: np.ndarray, token_ids: np.ndarray) -> None:
    """Play the model: write, in every full layer, K = token id and V = -token id into
    slots ``loc`` (so a row can later be checked to hold the right tokens)."""
    if len(loc) == 0:
        return
    k0, _ = buffers.get_kv_buffer(_first_full_layer(buffers))
    n = len(loc)
    t = torch.as_tensor(np.asarray(token_ids, dtype=np.float32)).to(k0.device)
    k = t.view(n, 1, 1).expand(n, k0.shape[1], k0.shape[2]).contiguous().to(k0.dtype)
    loc_t = torch.as_tensor(np.asarray(loc, dtype=np.int64)).to(k0.device)
    for lid in _full_layers(buffers):
        buffers.set_kv_buffer(lid, loc_t, k, -k)


def read_token_kv(buffers: Any, req_pool_idx: int, n: int) -> np.ndarray:
    """The token ids the KV of ``req_to_token[req_pool_idx, :n]`` holds (layer checks K == -V
    and all full layers agree)."""
    rows = buffers.req_to_token[req_pool_idx, :n].to(torch.int64)
    out = None
    for lid in _full_layers(buffers):
        k, v = buffers.get_kv_buffer(lid)
        kk, vv = k[rows, 0, 0].float().cpu(), v[rows, 0, 0].float().cpu()
        assert torch.equal(kk, -vv), f"layer {lid}: K and V of the rows disagree"
        if out is None:
            out = kk
        assert torch.equal(out, kk), f"layer {lid} holds other tokens than layer 0"
    return out.numpy().astype(np.int64)


def _full_layers(buffers: Any):
    return [i for i, c in enumerate(buffers.config.layer_types) if c == "F"]


def _first_full_layer(buffers: Any) -> int:
    return _full_layers(buffers)[0]
