"""The prefix index a KV-aware router consults: Dynamo's Rust radix indexer
(``dynamo._core.RadixTree`` from ai-dynamo-runtime) when it is installed, else
:class:`PyRadixIndex`, the same semantics in Python. Both take Dynamo ``KvCacheEvent`` JSON
per worker (:mod:`radixkv.events.dynamo`) and score a request's ``tokens_hash`` blocks:
per worker, the number of leading blocks it holds."""
from __future__ import annotations

import json
import os
from typing import Any, Protocol, TypedDict

from radixkv.errors import InvalidArgumentError

__all__ = ["PyRadixIndex", "DynamoIndex", "make_index"]


class KVIndex(Protocol):
    """What a router asks of a prefix index (both below; any object with these two)."""

    def apply_event(self, worker: int, raw: bytes) -> None:
        """Apply one Dynamo ``KvCacheEvent`` (UTF-8 JSON) of ``worker``."""
    def scores(self, hashes: list[int]) -> dict[int, int]:
        """Per worker, the leading blocks of ``hashes`` (``tokens_hash`` values) it holds."""


class _Node(TypedDict):
    """A node of :class:`PyRadixIndex`: children by ``tokens_hash``, the workers holding it."""

    kids: dict[int, _Node]
    workers: set[int]


class PyRadixIndex:
    """Dynamo's radix indexer semantics in Python (the fallback index): nodes keyed by
    ``tokens_hash`` under their parent, a per-worker map of block hash -> node, a worker's
    score = the leading blocks it holds contiguously. Same interface as :class:`DynamoIndex`."""

    name = "python"

    def __init__(self) -> None:
        self._root: _Node = {"kids": {}, "workers": set()}
        self._lookup: dict[int, dict[int, _Node]] = {}  # worker -> block hash -> node

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

    def scores(self, hashes: list[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        node = self._root
        alive: set[int] | None = None
        for depth, h in enumerate(hashes, 1):
            child = node["kids"].get(h)
            if child is None:
                break
            node = child
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

    def scores(self, hashes: list[int]) -> dict[int, int]:
        # keyed by (worker_id, dp_rank) at run time (the stub says int)
        scores: dict[Any, int] = self._tree.find_matches(hashes).scores
        return {w: n for (w, _), n in scores.items()}


def make_index(kind: str = "auto") -> PyRadixIndex | DynamoIndex:
    """``dynamo``, ``python``, or ``auto`` (Dynamo's when importable)."""
    if kind not in ("auto", "dynamo", "python"):
        raise InvalidArgumentError(f"index must be auto, dynamo or python, got {kind!r}")
    if kind == "python":
        return PyRadixIndex()
    try:
        return DynamoIndex()
    except ImportError as e:
        if kind == "dynamo":
            raise InvalidArgumentError(
                "the dynamo index needs ai-dynamo-runtime (pip install ai-dynamo-runtime)") from e
        return PyRadixIndex()
