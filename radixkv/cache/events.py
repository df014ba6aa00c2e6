"""KV-cache events: what the RadixCache stored, removed or cleared, in vLLM's event schema.

An external router (or a second cache tier) that mirrors the cache's contents consumes these
events. The event types and their field names follow vLLM's KV-event schema
(``vllm/distributed/kv_events.py``): :class:`BlockStored`, :class:`BlockRemoved`,
:class:`AllBlocksCleared` and :class:`KVEventBatch`. radixkv adds one field, ``extra_key``
on :class:`BlockStored`: the cache namespace (LoRA id/name, tenant, salt) that vLLM spreads
over ``lora_id`` / ``lora_name``. ``lora_id`` is filled when the extra key is an ``int`` and
``lora_name`` when it is a ``str``, so vLLM consumers that only read those still see it.

One block is one page of the cache (``page_size`` tokens). A node of the radix tree holds a
whole number of pages, and storing it produces one ``BlockStored`` event that lists one hash
per page.

Block hash: the exact byte layout
---------------------------------
Hashes are chained SHA-256, reduced to unsigned 64-bit integers, so that any process (or
language) that knows the seed, the page size and the tokens computes the same hashes.

1. **Chain root.** The seed (``bytes``, ``str`` or ``int``) is reduced to 8 bytes, ``R``:

   * ``int`` ``s`` (``0 <= s < 2**64``): ``R = s.to_bytes(8, "little")``;
   * ``bytes`` ``b``: ``R = sha256(b).digest()[:8]``;
   * ``str`` ``t``: as the bytes ``t.encode("utf-8")``.

   The default seed is :data:`DEFAULT_SEED` (``b"radixkv/kv-events/v1"``).

2. **Extra key** ``E`` (the namespace), a tagged, length-prefixed field:

   * ``None``  -> ``b"\\x00"``
   * ``str``   -> ``b"\\x01" + u32le(len(utf8)) + utf8``
   * ``bytes`` -> ``b"\\x02" + u32le(len(b)) + b``
   * ``int``   -> ``b"\\x03" + i64le(value)`` (``-2**63 <= value < 2**63``)
   * ``tuple`` -> ``b"\\x04" + u32le(len(t)) + E(t[0]) + E(t[1]) + ...`` (nested keys)

   where ``u32le`` / ``i64le`` are little-endian unsigned 32-bit / signed 64-bit integers.

3. **Page ``i``** with tokens ``t[i*P:(i+1)*P]`` (``P`` = page size) and previous link
   ``prev_i`` (8 bytes)::

       digest_i = sha256(prev_i || E || int32le(t[i*P]) || ... || int32le(t[(i+1)*P - 1]))
       h_i      = int.from_bytes(digest_i[:8], "little")          # unsigned 64-bit

   with ``prev_0 = R`` when the block has no parent (the node hangs off the root), else
   ``prev_0 = parent_hash.to_bytes(8, "little")``, and ``prev_i = h_{i-1}.to_bytes(8,
   "little")`` for ``i > 0``.

Every field has a fixed width or a length prefix, so no two different inputs share a byte
string. Since the parent link carries the whole chain, a node's page hashes do not change
when the tree splits the node (the split simply divides its hash list).

:func:`block_hashes` is the single place the hash is computed.
"""
from __future__ import annotations

import hashlib
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Union

import numpy as np

from radixkv.errors import AlignmentError, InvalidArgumentError, InvariantError, NotFoundError, describe_ids

__all__ = ["DEFAULT_SEED", "MEDIUM_GPU", "HASH_BITS", "BlockStored", "BlockRemoved", "AllBlocksCleared",
           "KVEventBatch", "KVEventRecorder", "block_hashes", "chain_root", "encode_extra_key",
           "event_from_dict"]

#: Seed of the hash chain when the caller gives none. Processes that must agree on hashes
#: only need to agree on this value (and the page size).
DEFAULT_SEED: bytes = b"radixkv/kv-events/v1"
#: The ``medium`` vLLM uses for device memory.
MEDIUM_GPU = "GPU"
#: Width of a block hash.
HASH_BITS = 64
_HASH_LIMIT = 1 << HASH_BITS

Seed = Union[bytes, int, str]


# --------------------------------------------------------------------------- hashing


def chain_root(seed: Seed = DEFAULT_SEED) -> bytes:
    """The 8-byte root of the hash chain for ``seed`` (layout step 1 of the module doc)."""
    if isinstance(seed, bool):
        raise InvalidArgumentError("seed must be bytes, str or int, not bool")
    if isinstance(seed, int):
        if not 0 <= seed < _HASH_LIMIT:
            raise InvalidArgumentError(f"an int seed must lie in [0, 2**64), got {seed}")
        return seed.to_bytes(8, "little")
    if isinstance(seed, str):
        seed = seed.encode("utf-8")
    if isinstance(seed, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(seed)).digest()[:8]
    raise InvalidArgumentError(f"seed must be bytes, str or int, got {type(seed).__name__}")


def encode_extra_key(extra_key: Any) -> bytes:
    """The tagged byte form of a namespace key (layout step 2 of the module doc)."""
    if extra_key is None:
        return b"\x00"
    if isinstance(extra_key, bool):
        raise InvalidArgumentError("extra_key must be None, str, bytes or int, not bool")
    if isinstance(extra_key, str):
        raw = extra_key.encode("utf-8")
        return b"\x01" + struct.pack("<I", len(raw)) + raw
    if isinstance(extra_key, (bytes, bytearray)):
        raw = bytes(extra_key)
        return b"\x02" + struct.pack("<I", len(raw)) + raw
    if isinstance(extra_key, (int, np.integer)):
        value = int(extra_key)
        if not -(1 << 63) <= value < (1 << 63):
            raise InvalidArgumentError(f"an int extra_key must fit in int64, got {value}")
        return b"\x03" + struct.pack("<q", value)
    if isinstance(extra_key, tuple):
        return b"\x04" + struct.pack("<I", len(extra_key)) + b"".join(map(encode_extra_key, extra_key))
    raise InvalidArgumentError(
        f"extra_key must be None, str, bytes, int or a tuple of those, got {type(extra_key).__name__}"
    )


def _check_hash(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < _HASH_LIMIT:
        raise InvalidArgumentError(f"{what} must lie in [0, 2**64), got {value}")
    return value


def _page_tokens(token_ids: Any, page_size: int) -> np.ndarray:
    """Validated tokens as a little-endian int32 array (no copy when already one)."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise InvalidArgumentError(f"page_size must be a positive int, got {page_size!r}")
    if hasattr(token_ids, "detach"):  # torch tensor
        token_ids = token_ids.detach().cpu().numpy()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.size % page_size:
        raise AlignmentError(
            f"{arr.size} tokens is not a whole number of pages of {page_size} tokens"
        )
    if arr.dtype != np.dtype("<i4"):
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise InvalidArgumentError("token_ids do not fit in int32")
        arr = arr.astype("<i4")
    return np.ascontiguousarray(arr)


def block_hashes(
    token_ids: Any,
    page_size: int,
    parent_hash: Optional[int] = None,
    extra_key: Any = None,
    seed: Seed = DEFAULT_SEED,
) -> List[int]:
    """Chained per-page hashes of ``token_ids`` (the layout in the module docstring).

    Args:
        token_ids: int tokens (numpy/torch/list), a multiple of ``page_size`` long.
        page_size: tokens per block.
        parent_hash: hash of the block just before the first page, ``None`` at the root.
        extra_key: the cache namespace (``None``, ``str``, ``bytes`` or ``int``).
        seed: the chain seed used when ``parent_hash`` is ``None``.

    Returns:
        One unsigned 64-bit hash per page, in order.

    Raises:
        AlignmentError: the length is not a multiple of ``page_size``.
        InvalidArgumentError: bad dtype, page size, parent hash, extra key or seed.

    Complexity: O(n) bytes hashed; one ``sha256`` call per page (the token bytes are
    produced by one vectorized conversion, then sliced).
    """
    tokens = _page_tokens(token_ids, page_size)
    extra = encode_extra_key(extra_key)
    if parent_hash is None:
        prev = chain_root(seed)
    else:
        prev = _check_hash(parent_hash, "parent_hash").to_bytes(8, "little")
    buf = memoryview(tokens.tobytes())
    step = int(page_size) * 4
    out: List[int] = []
    sha256 = hashlib.sha256
    for start in range(0, len(buf), step):
        h = sha256(prev + extra + buf[start:start + step]).digest()[:8]
        out.append(int.from_bytes(h, "little"))
        prev = h
    return out


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

    block_hashes: tuple
    parent_block_hash: Optional[int]
    token_ids: np.ndarray
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None
    extra_key: Any = None

    def to_dict(self) -> dict:
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

    block_hashes: tuple
    medium: Optional[str]

    def to_dict(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium}


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole cache was reset, vLLM's ``AllBlocksCleared``."""

    def to_dict(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventBatch:
    """Events drained together, with a wall-clock timestamp (seconds), vLLM's ``KVEventBatch``."""

    ts: float
    events: List[KVEvent] = field(default_factory=list)
    data_parallel_rank: Optional[int] = None

    def to_dict(self) -> dict:
        return {
            "ts": self.ts,
            "events": [e.to_dict() for e in self.events],
            "data_parallel_rank": self.data_parallel_rank,
        }


def event_from_dict(d: dict) -> KVEvent:
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
        seed: seed of the hash chain (see the module docstring); processes that must agree
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
        self._events: List[KVEvent] = []
        self._live: Counter = Counter()

    # -- the interface the RadixCache calls

    def on_stored(self, parent_hash: Optional[int], token_ids: Any, extra_key: Any = None) -> List[int]:
        """Record one ``BlockStored`` for a new node; return its per-page hashes.

        ``token_ids`` must be a whole number of pages. An empty node records nothing and
        returns ``[]``. Raises (and records nothing) on bad input. O(len(token_ids)).
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
            medium=self.medium,
            lora_name=extra_key if isinstance(extra_key, str) else None,
            extra_key=extra_key,
        )
        self._events.append(event)
        self._live.update(hashes)
        return hashes

    def on_removed(self, block_hashes: Sequence[int]) -> None:
        """Record one ``BlockRemoved`` for blocks that were stored.

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
        self._events.append(BlockRemoved(tuple(hashes), self.medium))

    def on_cleared(self) -> None:
        """Record ``AllBlocksCleared``; every block stops being live."""
        self._live.clear()
        self._events.append(AllBlocksCleared())

    def take_events(self) -> List[KVEvent]:
        """Drain and return the pending events, oldest first."""
        events, self._events = self._events, []
        return events

    # -- conveniences

    def take_batch(self, data_parallel_rank: Optional[int] = None) -> KVEventBatch:
        """Drain the pending events into a :class:`KVEventBatch` stamped with ``time.time()``."""
        return KVEventBatch(time.time(), self.take_events(), data_parallel_rank)

    def block_hashes(self, token_ids: Any, parent_hash: Optional[int] = None, extra_key: Any = None) -> List[int]:
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
