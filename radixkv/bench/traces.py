"""Request traces for hit-rate studies: Mooncake JSONL loading, pseudo-token expansion, and
the block-level view every simulator here works on.

Mooncake traces (FAST'25 release) give, per request, ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``: chained ids of consecutive ``block_size``-token prompt
blocks (equal ids mean equal prefixes up to and including that block; the last block holds
``input_length - block_size * (len(hash_ids) - 1)`` tokens). No token ids are published, so
block ``b`` expands to the pseudo-tokens ``b*block_size .. b*block_size + block_size - 1``
(the last block cut to its real length): the expansion keeps the prefix structure exactly.

:class:`BlockTrace` is the block-level view: per request the list of dense block ids (root
first), per block its length and its parent. Since ids are chained, a block always has the
same parent and the same length; the loader checks this and refuses a trace that breaks it.
Every number derived from it (prompt tokens, unique prompt tokens, the infinite-capacity
hit count) is computed with whole-array numpy operations.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from radixkv.errors import AlignmentError, InvalidArgumentError, describe_ids

__all__ = ["BlockTrace", "MooncakeTrace", "RequestBlocks", "find_sessions", "load_mooncake", "MOONCAKE_BLOCK_SIZE"]

#: Tokens per ``hash_ids`` block in the Mooncake traces.
MOONCAKE_BLOCK_SIZE = 512


class RequestBlocks(NamedTuple):
    """One request's block view: dense block ids (root first) and its last block's length."""

    block_ids: np.ndarray
    last_block_len: int


class BlockTrace:
    """A request stream as chains of blocks (the input of :mod:`blocksim` and :mod:`belady`).

    Attributes (read-only by convention):
        offsets: int64 ``(n_requests + 1,)``; request ``i`` is ``blocks[offsets[i]:offsets[i+1]]``.
        blocks: int32 flattened dense block ids, each request's chain root first.
        block_len: int64 ``(n_blocks,)`` tokens per block (``block_size`` except partial tails).
        parent: int32 ``(n_blocks,)`` parent block (``-1``: the block starts a prompt).
        prompt_len: int64 ``(n_requests,)`` prompt tokens per request.
        block_size: tokens of a full block.

    Build it with :meth:`from_chains`, :meth:`from_token_requests` or
    :meth:`MooncakeTrace.block_trace`; all validate before returning.
    """

    def __init__(self, offsets: np.ndarray, blocks: np.ndarray, block_len: np.ndarray, parent: np.ndarray,
                 prompt_len: np.ndarray, block_size: int):
        self.offsets = offsets
        self.blocks = blocks
        self.block_len = block_len
        self.parent = parent
        self.prompt_len = prompt_len
        self.block_size = int(block_size)

    # ------------------------------------------------------------------ sizes
    @property
    def n_requests(self) -> int:
        return len(self.offsets) - 1

    @property
    def n_blocks(self) -> int:
        return len(self.block_len)

    @property
    def prompt_tokens(self) -> int:
        """All prompt tokens of the stream."""
        return int(self.prompt_len.sum())

    @property
    def unique_tokens(self) -> int:
        """Distinct prompt tokens = nodes of the token trie = the sum of block lengths
        (chained ids make every block a distinct trie path)."""
        return int(self.block_len.sum())

    def request(self, i: int) -> RequestBlocks:
        """Block view of request ``i`` (a view into :attr:`blocks`, no copy)."""
        if not 0 <= i < self.n_requests:
            raise InvalidArgumentError(f"request {i} out of range [0, {self.n_requests})")
        ids = self.blocks[self.offsets[i]:self.offsets[i + 1]]
        return RequestBlocks(ids, int(self.block_len[ids[-1]]))

    def __iter__(self) -> Iterator[np.ndarray]:
        """Each request's dense block ids, in order."""
        off, blk = self.offsets, self.blocks
        for i in range(self.n_requests):
            yield blk[off[i]:off[i + 1]]

    def infinite_hit_tokens(self) -> int:
        """Prompt tokens an unbounded prefix cache would hit: every occurrence of a block
        after its first one (a block seen before has its whole prefix seen before). O(B log B)."""
        first = np.zeros(len(self.blocks), dtype=bool)
        _, idx = np.unique(self.blocks, return_index=True)
        first[idx] = True
        return int(self.block_len[self.blocks[~first]].sum())

    def head(self, n: int) -> BlockTrace:
        """The first ``n`` requests (block ids renumbered densely; validated)."""
        n = min(int(n), self.n_requests)
        raw = self.blocks[: self.offsets[n]].astype(np.int64)
        lens = self.block_len[raw]
        return BlockTrace.from_chains(raw, self.offsets[: n + 1].copy(), lens, self.block_size)

    # ------------------------------------------------------------------ builders
    @classmethod
    def from_chains(cls, raw_ids: npt.ArrayLike, offsets: npt.ArrayLike, occ_len: npt.ArrayLike,
                    block_size: int) -> BlockTrace:
        """Build from flattened chained ids (any non-negative ints), request offsets and the
        token length of every occurrence. Ids are renumbered densely in increasing order.

        Raises:
            InvalidArgumentError: an empty request, a negative id, a length outside
                ``[1, block_size]``, a non-tail block shorter than ``block_size``, or an id
                whose parent or length differs between occurrences (not a chained trace).
        """
        raw = np.asarray(raw_ids, dtype=np.int64)
        off = np.asarray(offsets, dtype=np.int64)
        ln = np.asarray(occ_len, dtype=np.int64)
        if off.ndim != 1 or len(off) < 1 or off[0] != 0 or off[-1] != len(raw) or len(ln) != len(raw):
            raise InvalidArgumentError("offsets must start at 0, end at len(ids), one length per id")
        sizes = np.diff(off)
        if (sizes <= 0).any():
            raise InvalidArgumentError(f"requests without blocks: {describe_ids(np.flatnonzero(sizes <= 0))}")
        if len(raw) and raw.min() < 0:
            raise InvalidArgumentError(f"negative block ids: {describe_ids(np.unique(raw[raw < 0]))}")
        if ((ln < 1) | (ln > block_size)).any():
            bad = np.flatnonzero((ln < 1) | (ln > block_size))
            raise InvalidArgumentError(f"block lengths outside [1, {block_size}] at occurrences {describe_ids(bad)}")
        is_tail = np.zeros(len(raw), dtype=bool)
        is_tail[off[1:] - 1] = True
        if (~is_tail & (ln != block_size)).any():
            bad = np.flatnonzero(~is_tail & (ln != block_size))
            raise InvalidArgumentError(f"partial blocks before a request's tail at occurrences {describe_ids(bad)}")
        uniq, dense = np.unique(raw, return_inverse=True)
        dense = dense.astype(np.int32)
        occ_parent = np.empty(len(raw), dtype=np.int32)
        occ_parent[1:] = dense[:-1]
        occ_parent[off[:-1]] = -1
        parent = np.full(len(uniq), -1, dtype=np.int32)
        parent[dense] = occ_parent
        block_len = np.zeros(len(uniq), dtype=np.int64)
        block_len[dense] = ln
        bad = (parent[dense] != occ_parent) | (block_len[dense] != ln)
        if bad.any():
            raise InvalidArgumentError(
                f"block ids {describe_ids(np.unique(raw[bad]))} have different parents or lengths "
                "in different requests: the ids are not chained prefix hashes")
        prompt_len = np.add.reduceat(ln, off[:-1]) if len(raw) else np.zeros(0, np.int64)
        return cls(off, dense, block_len, parent, prompt_len.astype(np.int64), block_size)

    @classmethod
    def from_token_requests(cls, requests: Sequence[np.ndarray], block_size: int) -> BlockTrace:
        """Chunk token arrays into ``block_size`` blocks with chained ids: two chunks share an
        id iff their whole prefixes are equal (a dict keyed by (parent id, chunk bytes)).
        One dict probe per block, no per-token Python work.

        Raises:
            InvalidArgumentError: a non-int32 or empty request, or ``block_size < 1``.
        """
        if int(block_size) < 1:
            raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
        bs = int(block_size)
        table: dict[tuple[int, bytes], int] = {}  # (parent id, chunk bytes) -> id
        ids: list[int] = []
        lens: list[int] = []
        off = [0]
        for r, toks in enumerate(requests):
            if not isinstance(toks, np.ndarray) or toks.dtype != np.int32 or toks.ndim != 1:
                raise InvalidArgumentError(f"request {r}: tokens must be a 1-D int32 numpy array")
            if len(toks) == 0:
                raise InvalidArgumentError(f"request {r} is empty")
            raw = toks.tobytes()
            prev = -1
            for s in range(0, len(toks), bs):
                key = (prev, raw[4 * s: 4 * (s + bs)])
                b = table.get(key)
                if b is None:
                    b = table[key] = len(table)
                ids.append(b)
                lens.append(min(bs, len(toks) - s))
                prev = b
            off.append(len(ids))
        return cls.from_chains(np.asarray(ids, np.int64), np.asarray(off, np.int64),
                               np.asarray(lens, np.int64), bs)

    def rechunk(self, page_size: int) -> BlockTrace:
        """The same stream with ``page_size``-token blocks (``page_size`` divides
        :attr:`block_size`): block ``b`` becomes ``ceil(len(b)/page_size)`` chained sub-blocks.
        Equal to chunking the expanded tokens by ``page_size``; fully vectorized.

        Raises:
            AlignmentError: ``page_size`` does not divide :attr:`block_size`.
        """
        p = int(page_size)
        if p < 1 or self.block_size % p:
            raise AlignmentError(f"page_size {page_size} must divide block_size {self.block_size}")
        if p == self.block_size:
            return self
        m = -(-self.block_len // p)                       # sub-blocks per block
        base = np.zeros(len(m) + 1, dtype=np.int64)
        np.cumsum(m, out=base[1:])
        n_sub = int(base[-1])
        owner = np.repeat(np.arange(len(m)), m)
        j = np.arange(n_sub) - base[owner]
        sub_len = np.where(j == m[owner] - 1, self.block_len[owner] - p * (m[owner] - 1), p)
        sub_parent = np.where(j > 0, np.arange(n_sub) - 1, -1)
        par = self.parent[owner]
        head = (j == 0) & (par >= 0)
        sub_parent[head] = base[par[head] + 1] - 1        # last sub-block of the parent
        occ_m = m[self.blocks]
        occ_base = base[self.blocks]
        flat_owner = np.repeat(np.arange(len(self.blocks)), occ_m)
        starts = np.zeros(len(self.blocks) + 1, dtype=np.int64)
        np.cumsum(occ_m, out=starts[1:])
        flat = occ_base[flat_owner] + (np.arange(int(starts[-1])) - starts[flat_owner])
        new_off = starts[self.offsets]
        return BlockTrace(new_off, flat.astype(np.int32), sub_len.astype(np.int64),
                          sub_parent.astype(np.int32), self.prompt_len.copy(), p)


class MooncakeTrace:
    """A Mooncake JSONL trace: per-request metadata plus the raw chained ``hash_ids``.

    Attributes:
        name: file stem.
        timestamp, input_length, output_length: int64 per request.
        hash_offsets: int64 ``(n+1,)``; ``hash_ids[hash_offsets[i]:hash_offsets[i+1]]`` are
            request ``i``'s raw block ids.
        hash_ids: int64 flattened raw ids.
        block_size: tokens per block (512 for the published traces).
    """

    def __init__(self, name: str, timestamp: np.ndarray, input_length: np.ndarray, output_length: np.ndarray,
                 hash_offsets: np.ndarray, hash_ids: np.ndarray, block_size: int):
        self.name = name
        self.timestamp = timestamp
        self.input_length = input_length
        self.output_length = output_length
        self.hash_offsets = hash_offsets
        self.hash_ids = hash_ids
        self.block_size = int(block_size)
        occ_len = np.full(len(hash_ids), self.block_size, dtype=np.int64)
        n_blk = np.diff(hash_offsets)
        occ_len[hash_offsets[1:] - 1] = input_length - self.block_size * (n_blk - 1)
        # validates the chaining, lengths and ids; also the pseudo-token range
        self._blocks = BlockTrace.from_chains(hash_ids, hash_offsets, occ_len, self.block_size)
        if len(hash_ids) and (int(hash_ids.max()) + 1) * self.block_size > np.iinfo(np.int32).max:
            raise InvalidArgumentError(
                f"block id {int(hash_ids.max())} x block_size {self.block_size} overflows int32 pseudo-tokens")

    def __len__(self) -> int:
        return len(self.input_length)

    def block_trace(self) -> BlockTrace:
        """The validated block-level view (dense ids; built once at load)."""
        return self._blocks

    def tokens(self, i: int) -> np.ndarray:
        """Request ``i``'s prompt as int32 pseudo-tokens (built on demand, vectorized)."""
        if not 0 <= i < len(self):
            raise InvalidArgumentError(f"request {i} out of range [0, {len(self)})")
        ids = self.hash_ids[self.hash_offsets[i]:self.hash_offsets[i + 1]]
        bs = self.block_size
        toks = (ids[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)[: int(self.input_length[i])]
        return toks.astype(np.int32)

    def iter_tokens(self) -> Iterator[np.ndarray]:
        """Every request's pseudo-tokens, lazily, in trace order."""
        for i in range(len(self)):
            yield self.tokens(i)

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_length.sum())

    @property
    def unique_tokens(self) -> int:
        """Distinct prompt tokens of the expanded trace (token-trie nodes)."""
        return self._blocks.unique_tokens


def load_mooncake(path: str, limit: int | None = None, block_size: int = MOONCAKE_BLOCK_SIZE) -> MooncakeTrace:
    """Load a Mooncake JSONL trace (one JSON object per line; blank lines skipped).

    ``limit`` keeps only the first ``limit`` requests. Parsing is one ``json.loads`` per
    line; everything after it is whole-array numpy.

    Raises:
        InvalidArgumentError: a missing file, a malformed line (its number is named), a
            missing field, or a trace that is not chained (see :meth:`BlockTrace.from_chains`).
    """
    if not os.path.isfile(path):
        raise InvalidArgumentError(f"trace file not found: {path}")
    ts: list[int] = []
    il: list[int] = []
    ol: list[int] = []
    counts: list[int] = []
    chunks: list[list[object]] = []  # each line's hash_ids (np.fromiter checks they are ints)
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(ts) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                h = rec["hash_ids"]
                ts.append(int(rec.get("timestamp", 0)))
                il.append(int(rec["input_length"]))
                ol.append(int(rec.get("output_length", 0)))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgumentError(f"{path}:{lineno}: malformed trace line ({exc})") from None
            if not isinstance(h, list) or not h:
                raise InvalidArgumentError(f"{path}:{lineno}: hash_ids must be a non-empty list")
            counts.append(len(h))
            chunks.append(h)
    if not ts:
        raise InvalidArgumentError(f"{path}: no requests")
    off = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    try:
        ids = np.fromiter((x for h in chunks for x in h), dtype=np.int64, count=int(off[-1]))
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgumentError(f"{path}: hash_ids must be integers ({exc})") from None
    il_arr = np.asarray(il, dtype=np.int64)
    n_blk = np.diff(off)
    bad = np.flatnonzero((il_arr <= block_size * (n_blk - 1)) | (il_arr > block_size * n_blk))
    if len(bad):
        raise InvalidArgumentError(
            f"{path}: input_length does not fit len(hash_ids) blocks of {block_size} for requests {describe_ids(bad)}")
    name = os.path.splitext(os.path.basename(path))[0]
    return MooncakeTrace(name, np.asarray(ts, np.int64), il_arr, np.asarray(ol, np.int64), off, ids, block_size)


def find_sessions(trace: MooncakeTrace, min_shared: int = 2) -> list[list[int]]:
    """Conversations: chains of requests (trace indices, in trace order) where each continues
    the previous one. The trace has no session ids, but its ``hash_ids`` are chained (one id
    names a whole prefix), so a request continues an earlier one when it contains that
    request's last *full* block (``hash_ids[-2]``); the predecessor is the latest such request
    sharing at least ``min_shared`` blocks (the trace's common root block alone does not make a
    conversation). A request continued by two later ones starts a branch: the later
    continuation opens a new chain, so every chain is linear. One dict probe per block."""
    if min_shared < 1:
        raise InvalidArgumentError(f"min_shared must be >= 1, got {min_shared}")
    off, ids = trace.hash_offsets, trace.hash_ids
    last_full: dict[int, int] = {}          # block id -> latest request whose last full block it is
    chain_of: dict[int, int] = {}           # request -> chain index
    chains: list[list[int]] = []
    for i in range(len(trace)):
        h = ids[off[i]:off[i + 1]]
        pred = -1
        for k in range(len(h) - 1, min_shared - 2, -1):   # deepest shared prefix first
            j = last_full.get(int(h[k]))
            if j is not None:
                pred = j
                break
        if pred >= 0 and chains[chain_of[pred]][-1] == pred:
            chain_of[i] = chain_of[pred]
            chains[chain_of[i]].append(i)
        else:
            chain_of[i] = len(chains)
            chains.append([i])
        if len(h) >= 2:
            last_full[int(h[-2])] = i
    return chains
