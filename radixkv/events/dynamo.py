"""radixkv's KV events as NVIDIA Dynamo ``KvCacheEvent`` JSON, for Dynamo's KV router.

Events are ``{"event_id", "data": {"stored": {"parent_hash", "blocks": [{"block_hash",
"tokens_hash"}]}} | {"removed": {"block_hashes"}} | "cleared", "dp_rank"}``. ``block_hash``
/ ``parent_hash`` are radixkv's chained block hashes, unchanged; ``tokens_hash`` is what the
router computes (``compute_block_hash_for_seq``): per page, XXH3-64 of the tokens as u32
little-endian, seeded with :func:`dynamo_seed` of the LoRA name and cache namespace, NOT
chained (checked against ai-dynamo-runtime 1.6.1 in ``tests/events/test_dynamo_adapter.py``).

:func:`default_namespace` maps ``extra_key`` to Dynamo's ``(lora_name, cache_namespace)``
keeping distinct keys distinct; ``namespace_fn`` maps otherwise (a mapping that merges two
keys is refused). State events have no Dynamo kind: :meth:`DynamoEventAdapter.convert` skips
them. The format, seed and namespace table: ``docs/events.md``, section 2.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import Any, NamedTuple

import numpy as np
import xxhash

from radixkv.cache.block_hash import encode_extra_key
from radixkv.cache.hybrid.state_events import CacheEvent, any_event_from_dict, is_state_event
from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.errors import (
    InvalidArgumentError,
    InvariantError,
    LengthMismatchError,
    NotFoundError,
    describe_ids,
)

__all__ = ["XXH3_SEED", "DynamoNamespace", "default_namespace", "dynamo_seed", "compute_block_hash_for_seq",
           "tokens_hashes", "DynamoEventAdapter", "dumps"]

#: Dynamo's base seed of the token-block hash.
XXH3_SEED = 1337
_M64 = (1 << 64) - 1
_xxh3 = xxhash.xxh3_64_intdigest


class DynamoNamespace(NamedTuple):
    """The two request-wide identities Dynamo mixes into its block hash."""

    lora_name: str | None = None
    cache_namespace: str | None = None


def default_namespace(extra_key: Hashable) -> DynamoNamespace:
    """radixkv ``extra_key`` -> Dynamo namespace (module doc). Injective over extra keys."""
    if extra_key is None:
        return DynamoNamespace()
    if isinstance(extra_key, str) and extra_key:
        return DynamoNamespace(lora_name=extra_key)
    return DynamoNamespace(cache_namespace="radixkv:" + encode_extra_key(extra_key).hex())


def _opt_str(v: object, what: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise InvalidArgumentError(f"{what} must be a str or None, got {type(v).__name__}")
    return v or None  # "" is absent, as in Dynamo


def dynamo_seed(lora_name: str | None = None, cache_namespace: str | None = None) -> int:
    """Dynamo's XXH3 seed for a request's LoRA name and cache namespace. O(len(names))."""
    lora_name = _opt_str(lora_name, "lora_name")
    cache_namespace = _opt_str(cache_namespace, "cache_namespace")
    seed = XXH3_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode("utf-8"), 0)) & _M64
    if cache_namespace:
        seed = (seed + _xxh3(cache_namespace.encode("utf-8"), 1)) & _M64
    return seed


def _u32_bytes(tokens: object) -> bytes:
    if hasattr(tokens, "detach"):  # torch
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype not in (np.dtype("<i4"), np.dtype("<u4")):
        if arr.size and (int(arr.min()) < -(1 << 31) or int(arr.max()) >= (1 << 32)):
            raise InvalidArgumentError("tokens do not fit in 32 bits")
        arr = arr.astype("<i8").astype("<u4")  # wraps negatives to their u32 bytes
    return np.ascontiguousarray(arr).tobytes()


def _hash_pages(buf: bytes, block_size: int, seed: int) -> list[int]:
    step = 4 * block_size
    view = memoryview(buf)
    return [_xxh3(view[i:i + step], seed) for i in range(0, len(buf) - len(buf) % step, step)]


def compute_block_hash_for_seq(tokens: object, block_size: int, lora_name: str | None = None,
                               cache_namespace: str | None = None) -> list[int]:
    """Dynamo's ``compute_block_hash_for_seq``: one ``tokens_hash`` per FULL block of
    ``tokens`` (a trailing partial block is ignored), what a router walks its tree with.

    Raises InvalidArgumentError for a bad block size, tokens or names.
    O(tokens): one vectorized conversion, one XXH3 call per block.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
    return _hash_pages(_u32_bytes(tokens), int(block_size), dynamo_seed(lora_name, cache_namespace))


def tokens_hashes(tokens: object, block_size: int, extra_key: Hashable = None,
                  namespace_fn: Callable[[Hashable], DynamoNamespace] = default_namespace) -> list[int]:
    """:func:`compute_block_hash_for_seq` for a radixkv request: the namespace comes from its
    ``extra_key`` through ``namespace_fn``."""
    ns = namespace_fn(extra_key)
    return compute_block_hash_for_seq(tokens, block_size, ns.lora_name, ns.cache_namespace)


class DynamoEventAdapter:
    """Turns one radixkv manager's KV events into Dynamo ``KvCacheEvent`` dicts / JSON.

    It tracks the live blocks (parent, tokens hash, live children) to refuse what Dynamo's tree
    would reject or mis-apply (an unstored parent, a block stored twice, removing an unknown
    block or one whose children stay), and to :meth:`snapshot` the state for a late router.

    Args: ``page_size`` (tokens per block); ``namespace_fn`` (``extra_key -> DynamoNamespace``,
    default :func:`default_namespace`); ``dp_rank``; ``first_event_id`` (then +1 per event).

    Every method that raises leaves the adapter unchanged (the event id included).
    Cost: O(tokens) per stored event (one XXH3 call per page), O(blocks) per removal.
    """

    def __init__(self, page_size: int, namespace_fn: Callable[[Hashable], DynamoNamespace] = default_namespace,
                 dp_rank: int = 0, first_event_id: int = 0):
        for name, v, lo in (("page_size", page_size, 1), ("dp_rank", dp_rank, 0),
                            ("first_event_id", first_event_id, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
        if not callable(namespace_fn):
            raise InvalidArgumentError("namespace_fn must be callable")
        self.page_size = page_size
        self.namespace_fn = namespace_fn
        self.dp_rank = dp_rank
        self._next_id = first_event_id
        self._blocks: dict[int, tuple[int | None, int]] = {}  # hash -> (parent, tokens_hash)
        self._children: Counter[int] = Counter()  # hash -> live children
        self._seeds: dict[Hashable, int] = {}  # extra_key -> seed
        self._owner: dict[int, bytes] = {}  # seed -> encoded extra key that claimed it

    # ------------------------------------------------------------------ conversion
    @property
    def next_event_id(self) -> int:
        return self._next_id

    def seed_for(self, extra_key: Hashable) -> int:
        """The Dynamo seed of ``extra_key``'s namespace (validated injective). O(1) cached."""
        seed = self._seeds.get(extra_key) if _hashable(extra_key) else None
        if seed is not None:
            return seed
        ns = self.namespace_fn(extra_key)
        if not isinstance(ns, tuple) or len(ns) != 2:
            raise InvalidArgumentError(f"namespace_fn must return a DynamoNamespace, got {ns!r}")
        seed = dynamo_seed(*ns)
        enc = encode_extra_key(extra_key)
        owner = self._owner.get(seed)
        if owner is not None and owner != enc:
            raise InvalidArgumentError(
                f"extra keys {extra_key!r} and the one encoded {owner.hex()} share the Dynamo namespace {ns}")
        self._owner[seed] = enc
        self._seeds[extra_key] = seed
        return seed

    def convert(self, event: CacheEvent | dict[str, object]) -> dict[str, Any] | None:
        """The Dynamo event dict for one radixkv event (object or ``to_dict()`` dict), or
        ``None`` for a state event (no Dynamo equivalent).

        Raises: InvalidArgumentError (wrong page size, namespace collision, a block stored
        twice), LengthMismatchError (tokens vs hashes), NotFoundError (unknown parent or
        removed block), InvalidArgumentError for a removal that leaves live children.
        """
        if isinstance(event, dict):
            event = any_event_from_dict(event)
        if is_state_event(event):
            return None
        data: dict[str, Any] | str
        if isinstance(event, BlockStored):
            data = self._stored(event)
        elif isinstance(event, BlockRemoved):
            data = self._removed(event)
        elif isinstance(event, AllBlocksCleared):
            self._blocks.clear()
            self._children.clear()
            data = "cleared"
        else:
            raise InvalidArgumentError(f"not a KV event: {type(event).__name__}")
        out = {"event_id": self._next_id, "data": data, "dp_rank": self.dp_rank}
        self._next_id += 1
        return out

    def convert_all(self, events: Iterable[CacheEvent | dict[str, object]]) -> list[dict[str, Any]]:
        """:meth:`convert` of each event, state events left out. Events before one that
        raises are converted (and counted) already."""
        out = []
        for e in events:
            d = self.convert(e)
            if d is not None:
                out.append(d)
        return out

    def encode(self, event: CacheEvent | dict[str, object]) -> bytes | None:
        """:meth:`convert` as the UTF-8 JSON bytes ``RadixTree.apply_event`` takes."""
        d = self.convert(event)
        return None if d is None else dumps(d)

    def _stored(self, ev: BlockStored) -> dict[str, Any]:
        if int(ev.block_size) != self.page_size:
            raise InvalidArgumentError(f"BlockStored of block_size {ev.block_size}, adapter page_size {self.page_size}")
        hashes = [int(h) for h in ev.block_hashes]
        toks = np.asarray(ev.token_ids)
        if toks.size != len(hashes) * self.page_size:
            raise LengthMismatchError(f"BlockStored: {len(hashes)} hashes but {toks.size} tokens "
                                      f"(page_size {self.page_size})")
        parent = None if ev.parent_block_hash is None else int(ev.parent_block_hash)
        if parent is not None and parent not in self._blocks:
            raise NotFoundError(f"BlockStored under parent {parent}, which is not stored")
        if len(set(hashes)) != len(hashes) or any(h in self._blocks for h in hashes) or parent in hashes:
            dup = [h for h in hashes if h in self._blocks or hashes.count(h) > 1 or h == parent]
            raise InvalidArgumentError(f"BlockStored of blocks already stored: {describe_ids(set(dup))}")
        seed = self.seed_for(ev.extra_key)
        th = _hash_pages(_u32_bytes(toks), self.page_size, seed)
        # ---- mutation ----
        prev = parent
        for h, t in zip(hashes, th):
            self._blocks[h] = (prev, t)
            if prev is not None:
                self._children[prev] += 1
            prev = h
        return {"stored": {"parent_hash": parent,
                           "blocks": [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, th)]}}

    def _removed(self, ev: BlockRemoved) -> dict[str, Any]:
        hashes = [int(h) for h in ev.block_hashes]
        missing = [h for h in hashes if h not in self._blocks]
        if missing or len(set(hashes)) != len(hashes):
            raise NotFoundError(f"BlockRemoved of blocks not stored (or named twice): "
                                f"{describe_ids(missing or hashes)}")
        gone = set(hashes)
        within = Counter(self._blocks[h][0] for h in hashes if self._blocks[h][0] in gone)
        kept = [h for h in hashes if self._children.get(h, 0) - within.get(h, 0) > 0]
        if kept:
            raise InvalidArgumentError(f"BlockRemoved of blocks whose children stay: {describe_ids(kept)}")
        # ---- mutation ----
        for h in hashes:
            parent = self._blocks.pop(h)[0]
            self._children.pop(h, None)
            if parent is not None and parent not in gone:
                self._children[parent] -= 1
                if self._children[parent] == 0:
                    del self._children[parent]
        return {"removed": {"block_hashes": hashes}}

    # ------------------------------------------------------------------ state
    def live_blocks(self) -> int:
        """Blocks stored and not removed."""
        return len(self._blocks)

    def holds(self, block_hash: int) -> bool:
        """Whether ``block_hash`` is stored and not removed. O(1)."""
        return int(block_hash) in self._blocks

    def tokens_hash_of(self, block_hash: int) -> int:
        """The ``tokens_hash`` sent for a live block. Raises NotFoundError."""
        try:
            return self._blocks[int(block_hash)][1]
        except KeyError:
            raise NotFoundError(f"block {block_hash} is not stored") from None

    def snapshot(self) -> list[dict[str, Any]]:
        """Stored events that rebuild every live block in a fresh router (parents before
        children; one event per chain of single children). Takes event ids. O(blocks)."""
        kids: dict[int | None, list[int]] = {}
        for h, (p, _) in self._blocks.items():
            kids.setdefault(p, []).append(h)
        out: list[dict[str, Any]] = []
        stack: list[tuple[int | None, int]] = [(None, h) for h in kids.get(None, ())]
        while stack:
            parent, h = stack.pop()
            chain = [h]
            while len(kids.get(chain[-1], ())) == 1:
                chain.append(kids[chain[-1]][0])
            for c in kids.get(chain[-1], ()):
                stack.append((chain[-1], c))
            out.append({"event_id": self._next_id, "dp_rank": self.dp_rank, "data": {"stored": {
                "parent_hash": parent,
                "blocks": [{"block_hash": b, "tokens_hash": self._blocks[b][1]} for b in chain]}}})
            self._next_id += 1
        return out

    def check_invariants(self) -> None:
        """Every parent is live; the child counts match the parent links; no cycles."""
        orphans = [h for h, (p, _) in self._blocks.items() if p is not None and p not in self._blocks]
        if orphans:
            raise InvariantError(f"blocks whose parent is not stored: {describe_ids(orphans)}")
        counts = Counter(p for p, _ in self._blocks.values() if p is not None)
        wrong = [h for h in set(counts) | set(self._children) if counts.get(h, 0) != self._children.get(h, 0)]
        if wrong:
            raise InvariantError(f"child counts wrong for blocks {describe_ids(wrong)}")
        depth_ok: dict[int, bool] = {}
        seen: list[int]
        x: int | None
        for h in self._blocks:
            seen, x = [], h
            while x is not None and x not in depth_ok:
                if len(seen) > len(self._blocks):
                    raise InvariantError(f"a parent cycle through block {h}")
                seen.append(x)
                x = self._blocks[x][0]
            for s in seen:
                depth_ok[s] = True


def _hashable(v: object) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def dumps(event: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON of a Dynamo event dict."""
    return json.dumps(event, separators=(",", ":")).encode("utf-8")
