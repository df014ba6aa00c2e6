"""``EngineReq``: the engine's :class:`~radixkv.scheduler.req.Req`, with its tokens in one
growable int32 buffer.

A request's tokens arrive in pieces (prompt chunks, then one token per decode step, maybe
more input after that). Appending to numpy arrays would copy the whole sequence every step
(quadratic over a generation); here the tokens live in one buffer whose capacity doubles,
so an append is amortized O(tokens appended), and ``fill_ids`` is a view (no copy).

``origin_input_ids`` is the part given before the first decode step and ``output_ids``
the rest, both views of the buffer, so the scheduler flow and the tree read the request as
any ``Req``. Appends can be undone (:meth:`mark` / :meth:`rollback`), which is how an
engine call that fails leaves its requests unchanged.
"""
from __future__ import annotations

import numpy as np

from radixkv.scheduler.req import Req

__all__ = ["EngineReq"]

_MIN_CAPACITY = 16


class EngineReq(Req):
    """A ``Req`` whose tokens live in a growable buffer (see the module docstring).

    Build with :meth:`create`. Positions ``< seq_len`` of the buffer are never rewritten,
    so views handed out earlier stay valid."""

    _buf: np.ndarray
    _n: int
    _prompt_len: int

    @classmethod
    def create(cls, rid: str, tokens: np.ndarray, extra_key: str | None = None,
               priority: int = 0) -> EngineReq:
        """A new request whose prompt (so far) is ``tokens`` (int32, validated by the caller)."""
        req = cls(rid=rid, origin_input_ids=tokens, extra_key=extra_key, priority=priority)
        n = int(tokens.size)
        req._buf = np.empty(max(_MIN_CAPACITY, 2 * n), dtype=np.int32)
        req._buf[:n] = tokens
        req._n = n
        req._prompt_len = n
        req._sync()
        return req

    # -- Req's view of the tokens ---------------------------------------------------------
    @property
    def fill_ids(self) -> np.ndarray:
        """Every token of the request (a read-only view, no copy)."""
        v = self._buf[:self._n]
        v.flags.writeable = False
        return v

    @property
    def seq_len(self) -> int:
        return self._n

    def append_output(self, token_id: int) -> None:
        """Append one generated token (amortized O(1))."""
        self._reserve(1)
        self._buf[self._n] = token_id
        self._n += 1
        self._sync()

    def append_outputs(self, tokens: np.ndarray) -> None:
        """Append generated tokens, as :meth:`append_output` for each (amortized O(len))."""
        k = int(tokens.size)
        self._reserve(k)
        self._buf[self._n:self._n + k] = tokens
        self._n += k
        self._sync()

    def append_tokens(self, tokens: np.ndarray) -> None:
        """Append more input: to the prompt while nothing was decoded, else after the
        output (the order of ``fill_ids`` is the order tokens arrived). O(len(tokens))
        amortized."""
        k = int(tokens.size)
        self._reserve(k)
        self._buf[self._n:self._n + k] = tokens
        if self._prompt_len == self._n:
            self._prompt_len += k
        self._n += k
        self._sync()

    # -- undo -------------------------------------------------------------------------------
    def mark(self) -> tuple[int, int]:
        """A marker for :meth:`rollback`."""
        return (self._n, self._prompt_len)

    def rollback(self, marker: tuple[int, int]) -> None:
        """Drop every token appended since ``marker`` was taken."""
        self._n, self._prompt_len = marker
        self._sync()

    # -- helpers ----------------------------------------------------------------------------
    def _reserve(self, k: int) -> None:
        if self._n + k > self._buf.size:
            buf = np.empty(max(2 * self._buf.size, self._n + k), dtype=np.int32)
            buf[:self._n] = self._buf[:self._n]
            self._buf = buf

    def _sync(self) -> None:
        self.origin_input_ids = self._buf[:self._prompt_len]
        self.output_ids = self._buf[self._prompt_len:self._n]
