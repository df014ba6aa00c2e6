"""KV-cache events: what the RadixCache stored, removed or cleared, in vLLM's event schema.

:class:`BlockStored`, :class:`BlockRemoved`, :class:`AllBlocksCleared` and
:class:`KVEventBatch` follow vLLM's ``vllm/distributed/kv_events.py``; radixkv adds
``extra_key`` on :class:`BlockStored` (the cache namespace), also written as ``lora_id``
(``int``) or ``lora_name`` (``str``) so vLLM consumers see it. One block is one page; storing
a node produces one ``BlockStored`` with one hash per page. The hashes are computed in
:mod:`radixkv.cache.block_hash` (``block_hashes``, ``chain_root``,
``encode_extra_key``, ``DEFAULT_SEED``, ``HASH_BITS``, ``Seed``). Consumers and wires:
``docs/events.md``.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixkv.cache.block_hash import (
    DEFAULT_SEED,
    Seed,
    block_hashes,
    chain_root,
)
from radixkv.cache.block_hash import (
    check_hash as _check_hash,
)
from radixkv.cache.block_hash import (
    page_tokens as _page_tokens,
)
from radixkv.errors import InvalidArgumentError, InvariantError, NotFoundError, describe_ids

__all__ = ["MEDIUM_GPU", "MEDIUM_CPU", "BlockStored", "BlockRemoved", "AllBlocksCleared",
           "KVEventBatch", "KVEventRecorder", "event_from_dict"]

#: The ``medium`` vLLM uses for device memory (radixkv's device tier, a CPU device included).
MEDIUM_GPU = "GPU"
#: The ``medium`` of the host-memory tier (vLLM's CPU offloading uses the same name).
MEDIUM_CPU = "CPU"


# --------------------------------------------------------------------------- events


def _extra_key_json(extra_key: Any) -> Any:
    """JSON form of an extra key: bytes and tuples are wrapped so they round-trip."""
    if isinstance(extra_key, (bytes, bytearray)):
        return {"bytes_hex": bytes(extra_key).hex()}
    if isinstance(extra_key, tuple):
        return {"tuple": [_extra_key_json(k) for k in extra_key]}
    if isinstance(extra_key, np.integer):
        return int(extra_key)
    return extra_key


def _extra_key_from_json(value: Any) -> Any:
    if isinstance(value, dict) and "bytes_hex" in value:
        return bytes.fromhex(value["bytes_hex"])
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_extra_key_from_json(k) for k in value["tuple"])
    return value


@dataclass(frozen=True, eq=False)
class BlockStored:
    """Pages newly stored in the cache (one tree node), vLLM's ``BlockStored``.

    Attributes:
        block_hashes: one hash per page, in token order.
        parent_block_hash: hash of the page before the first one; ``None`` at the root.
        token_ids: the tokens of all the pages (int32, read-only numpy array).
        block_size: tokens per block (the page size).
        lora_id: the extra key when it is an ``int``, else ``None`` (vLLM field).
        medium: where the blocks live (``"GPU"`` by default).
        lora_name: the extra key when it is a ``str``, else ``None`` (vLLM field).
        extra_key: the namespace the hashes were computed under (radixkv addition).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: np.ndarray
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_key: Hashable = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``type`` tags the event as msgspec's tagged union does)."""
        return {
            "type": "BlockStored",
            "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids.tolist(),
            "block_size": self.block_size,
            "lora_id": self.lora_id,
            "medium": self.medium,
            "lora_name": self.lora_name,
            "extra_key": _extra_key_json(self.extra_key),
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockStored) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.block_hashes, self.parent_block_hash, self.block_size, self.medium))


@dataclass(frozen=True)
class BlockRemoved:
    """Pages removed from the cache (evicted or deleted), vLLM's ``BlockRemoved``."""

    block_hashes: tuple[int, ...]
    medium: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache was reset, vLLM's ``AllBlocksCleared``."""

    def to_dict(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """Events drained together, with a wall-clock timestamp (seconds), vLLM's ``KVEventBatch``."""

    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ts": self.ts,
            "events": [e.to_dict() for e in self.events],
            "data_parallel_rank": self.data_parallel_rank,
        }


def event_from_dict(d: dict[str, Any]) -> KVEvent:
    """Inverse of ``to_dict()`` for the three event types."""
    kind = d.get("type")
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=tuple(int(h) for h in d["block_hashes"]),
            parent_block_hash=d["parent_block_hash"],
            token_ids=_frozen(np.asarray(d["token_ids"], dtype=np.int32)),
            block_size=int(d["block_size"]),
            lora_id=d.get("lora_id"),
            medium=d.get("medium"),
            lora_name=d.get("lora_name"),
            extra_key=_extra_key_from_json(d.get("extra_key")),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(int(h) for h in d["block_hashes"]), d.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise InvalidArgumentError(f"unknown event type {kind!r}")


def _frozen(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


# --------------------------------------------------------------------------- recorder


class KVEventRecorder:
    """Collects the cache's events and computes block hashes; the RadixCache owns one.

    The recorder also keeps the multiset of *live* block hashes (stored and not yet
    removed), so a removal of a block that was never stored is caught at once, and
    :meth:`check_invariants` can audit it.

    Args:
        page_size: tokens per block.
        seed: seed of the hash chain (:mod:`radixkv.cache.block_hash`); processes that must agree
            on hashes pass the same one. Default :data:`DEFAULT_SEED`.
        medium: the ``medium`` field of the events (``"GPU"``).
    """

    def __init__(self, page_size: int, seed: Seed = DEFAULT_SEED, medium: str = MEDIUM_GPU):
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise InvalidArgumentError(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = int(page_size)
        self.seed = seed
        self._root = chain_root(seed)  # validates the seed once
        self.medium = medium
        self._events: list[Any] = []  # KVEvents (HybridEventRecorder adds its state events)
        self._live: Counter[int] = Counter()

    # -- the interface the RadixCache calls

    # ``extra_key: Any``: any hashable namespace, read as an int or a str after the tests below
    def on_stored(self, parent_hash: int | None, token_ids: object, extra_key: Any = None,
                  medium: str | None = None) -> list[int]:
        """Record one ``BlockStored`` for a new node (``medium``: default the recorder's);
        return its per-page hashes. ``token_ids`` must be a whole number of pages. An empty
        node records nothing and returns ``[]``. Raises (recording nothing) on bad input.
        O(len(token_ids)).
        """
        tokens = _page_tokens(token_ids, self.page_size)
        hashes = block_hashes(tokens, self.page_size, parent_hash, extra_key, self.seed)
        if not hashes:
            return hashes
        is_int = isinstance(extra_key, (int, np.integer)) and not isinstance(extra_key, bool)
        event = BlockStored(
            block_hashes=tuple(hashes),
            parent_block_hash=None if parent_hash is None else int(parent_hash),
            token_ids=_frozen(tokens.astype(np.int32, copy=True)),
            block_size=self.page_size,
            lora_id=int(extra_key) if is_int else None,
            medium=self.medium if medium is None else medium,
            lora_name=extra_key if isinstance(extra_key, str) else None,
            extra_key=extra_key,
        )
        self._events.append(event)
        self._live.update(hashes)
        return hashes

    def on_removed(self, block_hashes: Sequence[int], medium: str | None = None) -> None:
        """Record one ``BlockRemoved`` for blocks that were stored (``medium``: default the
        recorder's).

        Raises ``NotFoundError`` naming the hashes that are not live (never stored, or
        removed already), recording nothing. An empty list records nothing. O(len).
        """
        hashes = [_check_hash(h, "block hash") for h in block_hashes]
        if not hashes:
            return
        want = Counter(hashes)
        missing = [h for h, n in want.items() if self._live.get(h, 0) < n]
        if missing:
            raise NotFoundError(f"BlockRemoved for blocks that are not stored: {describe_ids(missing)}")
        self._live.subtract(want)
        for h in want:
            if self._live[h] == 0:
                del self._live[h]
        self._events.append(BlockRemoved(tuple(hashes), self.medium if medium is None else medium))

    def on_cleared(self) -> None:
        """Record ``AllBlocksCleared``; every block stops being live."""
        self._live.clear()
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """Drain and return the pending events, oldest first."""
        events, self._events = self._events, []
        return events

    # -- conveniences

    def take_batch(self, data_parallel_rank: int | None = None) -> KVEventBatch:
        """Drain the pending events into a :class:`KVEventBatch` stamped with ``time.time()``."""
        return KVEventBatch(time.time(), self.take_events(), data_parallel_rank)

    def block_hashes(self, token_ids: object, parent_hash: int | None = None, extra_key: object = None) -> list[int]:
        """:func:`block_hashes` with this recorder's page size and seed (records nothing)."""
        return block_hashes(token_ids, self.page_size, parent_hash, extra_key, self.seed)

    def pending(self) -> int:
        """Number of events not yet taken."""
        return len(self._events)

    def live_blocks(self) -> int:
        """Number of blocks stored and not removed (with multiplicity)."""
        return sum(self._live.values())

    def is_live(self, block_hash: int) -> bool:
        """Whether ``block_hash`` is stored and not removed. O(1)."""
        return self._live.get(int(block_hash), 0) > 0

    def check_invariants(self) -> None:
        """Every live count is positive and every pending event is well formed."""
        bad = [h for h, n in self._live.items() if n <= 0]
        if bad:
            raise InvariantError(f"non-positive live counts for blocks {describe_ids(bad)}")
        for i, e in enumerate(self._events):
            if isinstance(e, BlockStored):
                if len(e.block_hashes) * e.block_size != e.token_ids.size:
                    raise InvariantError(
                        f"pending event {i}: {len(e.block_hashes)} hashes for {e.token_ids.size} tokens"
                    )
            elif not isinstance(e, (BlockRemoved, AllBlocksCleared)):
                raise InvariantError(f"pending event {i} has unknown type {type(e).__name__}")
