"""Idempotency keys: a retried call (same request id, same bytes) gets the first reply again.

A worker whose call timed out cannot know whether it ran, so unary calls may carry
``radixkv-request-id``; the manager keeps each successful reply under ``(scope, request
id)`` (scope: the session, or for ``Attach`` a hash of the client nonce) with a digest of the
request bytes. Same id and bytes: the kept reply, no engine call; same id, other bytes or
method: ``InvalidArgumentError``; failed calls are not kept. Bounds: ``per_scope`` replies
per scope and ``max_bytes`` in all (oldest first); an ended session's scope lives ``grace_s``
more (:meth:`ReplyCache.retain`). Single-threaded. Costs: O(1) amortized plus one SHA-256 of
the request bytes. Why SHA-256: ``docs/service.md``, "The reply cache".
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from typing import NamedTuple

from radixkv.errors import InvalidArgumentError, InvariantError

__all__ = ["ReplyCache", "CachedReply", "digest"]

def digest(method: str, request_bytes: bytes) -> bytes:
    """What identifies a request: SHA-256 of the method name and its bytes, cut to 128 bits."""
    h = hashlib.sha256(method.encode())
    h.update(b"\0")
    h.update(request_bytes)
    return h.digest()[:16]


class CachedReply(NamedTuple):
    digest: bytes
    reply: bytes


class ReplyCache:
    """Kept replies by ``(scope, request id)`` (see the module docstring).

    Args:
        per_scope: replies kept per scope (>= 1).
        max_bytes: reply bytes kept in all (>= 1).
    """

    def __init__(self, per_scope: int = 64, max_bytes: int = 64 << 20):
        for name, v in (("per_scope", per_scope), ("max_bytes", max_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        self.per_scope = per_scope
        self.max_bytes = max_bytes
        self._scopes: OrderedDict[str, OrderedDict[str, CachedReply]] = OrderedDict()
        self._ended: dict[str, float] = {}  # scope -> when it was first seen ended
        self.bytes = 0
        self.hits = 0

    def __len__(self) -> int:
        return sum(len(s) for s in self._scopes.values())

    def lookup(self, scope: str, request_id: str, key: bytes) -> bytes | None:
        """The kept reply of ``request_id`` in ``scope``, or None when there is none.
        Raises ``InvalidArgumentError`` when the id was used for another request."""
        entries = self._scopes.get(scope)
        hit = entries.get(request_id) if entries is not None else None
        if hit is None:
            return None
        if hit.digest != key:
            raise InvalidArgumentError(f"request id {request_id!r} was already used for another request")
        self.hits += 1
        return hit.reply

    def store(self, scope: str, request_id: str, key: bytes, reply: bytes) -> None:
        """Keep ``reply`` (the serialized response); drops the oldest entries over the bounds."""
        entries = self._scopes.get(scope)
        if entries is None:
            entries = self._scopes[scope] = OrderedDict()
        else:
            self._scopes.move_to_end(scope)
        old = entries.pop(request_id, None)
        if old is not None:
            self.bytes -= len(old.reply)
        entries[request_id] = CachedReply(key, reply)
        self.bytes += len(reply)
        while len(entries) > self.per_scope:
            _, dropped = entries.popitem(last=False)
            self.bytes -= len(dropped.reply)
        while self.bytes > self.max_bytes and self._scopes:
            first = next(iter(self._scopes))
            victims = self._scopes[first]
            _, dropped = victims.popitem(last=False)
            self.bytes -= len(dropped.reply)
            if not victims:
                del self._scopes[first]
                self._ended.pop(first, None)

    def retain(self, live: Iterable[str], now: float, grace_s: float, keep: tuple[str, ...] = ()) -> int:
        """Drop scopes that have not been live for ``grace_s`` (scopes in ``keep`` stay).
        Returns how many were dropped. O(scopes)."""
        live = set(live) | set(keep)
        dropped = 0
        for scope in list(self._scopes):
            if scope in live:
                self._ended.pop(scope, None)
                continue
            since = self._ended.setdefault(scope, now)
            if now - since >= grace_s:
                for e in self._scopes.pop(scope).values():
                    self.bytes -= len(e.reply)
                del self._ended[scope]
                dropped += 1
        return dropped

    def check_invariants(self) -> None:
        """The byte count matches the entries and every bound holds."""
        total = sum(len(e.reply) for s in self._scopes.values() for e in s.values())
        if total != self.bytes:
            raise InvariantError(f"reply cache counts {self.bytes} bytes, holds {total}")
        over = [s for s, e in self._scopes.items() if len(e) > self.per_scope or not e]
        if over:
            raise InvariantError(f"reply cache scopes over the bound or empty: {over}")
        if self.bytes > self.max_bytes:
            raise InvariantError(f"reply cache holds {self.bytes} bytes > {self.max_bytes}")
        stray = sorted(set(self._ended) - set(self._scopes))
        if stray:
            raise InvariantError(f"ended marks of unknown scopes: {stray}")
