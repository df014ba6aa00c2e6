"""Counters of a RadixCache: queries, hit tokens, inserted and evicted tokens, hit rates.

The hit rate is token-weighted: ``hit_tokens / queried_tokens`` over every query, and over
a rolling window of the last ``window`` queries (one ``match_prefix`` call each). Recording
a query is O(1) (a deque append and a few integer additions).
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from radixkv.errors import InvalidArgumentError

__all__ = ["CacheMetrics", "MetricsSnapshot"]


class MetricsSnapshot(NamedTuple):
    """A consistent copy of the counters at one moment."""

    queries: int
    queried_tokens: int
    hit_tokens: int
    inserts: int
    inserted_tokens: int
    evictions: int
    evicted_tokens: int
    hit_rate: float
    window_queries: int
    window_hit_rate: float


class CacheMetrics:
    """Counters updated by the cache; read them with :meth:`snapshot`.

    Args:
        window: number of most recent queries the rolling hit rate covers (>= 1).
    """

    __slots__ = ("window", "queries", "queried_tokens", "hit_tokens", "inserts",
                 "inserted_tokens", "evictions", "evicted_tokens", "_win", "_win_q", "_win_h")

    def __init__(self, window: int = 1000):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgumentError(f"metrics window must be an int >= 1, got {window!r}")
        self.window = window
        self.reset()

    def reset(self) -> None:
        """Zero every counter and empty the window."""
        self.queries = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.inserts = 0
        self.inserted_tokens = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self._win: deque = deque()
        self._win_q = 0
        self._win_h = 0

    def record_query(self, queried: int, hit: int) -> None:
        """One ``match_prefix`` of ``queried`` tokens that matched ``hit`` of them."""
        self.queries += 1
        self.queried_tokens += queried
        self.hit_tokens += hit
        win = self._win
        win.append((queried, hit))
        self._win_q += queried
        self._win_h += hit
        if len(win) > self.window:
            q, h = win.popleft()
            self._win_q -= q
            self._win_h -= h

    def record_insert(self, new_tokens: int) -> None:
        """One ``insert`` that stored ``new_tokens`` tokens not cached before."""
        self.inserts += 1
        self.inserted_tokens += new_tokens

    def record_evict(self, tokens: int) -> None:
        """One ``evict`` call that freed ``tokens`` tokens."""
        self.evictions += 1
        self.evicted_tokens += tokens

    def snapshot(self) -> MetricsSnapshot:
        """The counters and both hit rates (0.0 when nothing was queried)."""
        return MetricsSnapshot(
            queries=self.queries,
            queried_tokens=self.queried_tokens,
            hit_tokens=self.hit_tokens,
            inserts=self.inserts,
            inserted_tokens=self.inserted_tokens,
            evictions=self.evictions,
            evicted_tokens=self.evicted_tokens,
            hit_rate=self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
            window_queries=len(self._win),
            window_hit_rate=self._win_h / self._win_q if self._win_q else 0.0,
        )
