"""Trace loading and expansion, the block view, rechunking, and the synthetic generators."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trace_fixtures import bundled_trace

from radixkv.bench.traces import BlockTrace, load_mooncake
from radixkv.bench.workloads import WORKLOADS, make_workload, random_block_trace, unique_prefix_tokens
from radixkv.errors import AlignmentError, InvalidArgumentError


def _trace_path(name):
    return bundled_trace(name, shared_fallback=True)


HAVE_MOONCAKE = _trace_path("conversation") is not None and _trace_path("synthetic") is not None


def _write(tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


ROWS = [
    {"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [0, 1, 2]},     # tail of 2
    {"timestamp": 5, "input_length": 12, "output_length": 1, "hash_ids": [0, 1, 3]},     # full tail
    {"timestamp": 9, "input_length": 5, "output_length": 2, "hash_ids": [4, 5]},
    {"timestamp": 9, "input_length": 9, "output_length": 2, "hash_ids": [0, 1, 6]},
]


def test_expansion_partial_tail_and_chained_ids(tmp_path):
    tr = load_mooncake(_write(tmp_path, ROWS), block_size=4)
    assert len(tr) == 4 and tr.prompt_tokens == 36
    t0 = tr.tokens(0)
    assert t0.dtype == np.int32
    assert t0.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]          # block 2 cut to 2 tokens
    assert tr.tokens(1).tolist() == list(range(8)) + [12, 13, 14, 15]
    assert tr.tokens(2).tolist() == [16, 17, 18, 19, 20]
    assert [len(t) for t in tr.iter_tokens()] == [10, 12, 5, 9]
    bt = tr.block_trace()
    view = bt.request(0)
    assert view.block_ids.tolist() == [0, 1, 2] and view.last_block_len == 2
    assert bt.request(1).last_block_len == 4
    assert bt.parent.tolist() == [-1, 0, 1, 1, -1, 4, 1]
    assert bt.block_len.tolist() == [4, 4, 2, 4, 4, 1, 1]
    # unique tokens = distinct pseudo-token prefixes
    prefixes = {tuple(t[:i].tolist()) for t in tr.iter_tokens() for i in range(1, len(t) + 1)}
    assert tr.unique_tokens == len(prefixes) == 20
    # infinite capacity: request 1 hits blocks 0,1 (8), request 3 hits 0,1 (8)
    assert bt.infinite_hit_tokens() == 16
    with pytest.raises(InvalidArgumentError):
        tr.tokens(4)


def test_limit_and_head(tmp_path):
    tr = load_mooncake(_write(tmp_path, ROWS), block_size=4, limit=2)
    assert len(tr) == 2 and tr.block_trace().n_blocks == 4
    full = load_mooncake(_write(tmp_path, ROWS), block_size=4).block_trace()
    h = full.head(2)
    assert h.n_requests == 2 and h.infinite_hit_tokens() == 8


@pytest.mark.parametrize("bad,match", [
    ([{"input_length": 3, "hash_ids": [0]}, {"input_length": 5, "hash_ids": [1, 0]}], "not chained"),
    ([{"input_length": 2, "hash_ids": [0, 1]}], "does not fit"),
    ([{"input_length": 9, "hash_ids": [0, 1]}], "does not fit"),
    ([{"input_length": 3, "hash_ids": []}], "non-empty"),
    ([{"hash_ids": [0]}], "malformed"),
    ([{"input_length": 2, "hash_ids": [-1]}], "negative"),
    ([{"input_length": 3, "hash_ids": [0]}, {"input_length": 4, "hash_ids": [0]}], "not chained"),
])
def test_invalid_traces_raise(tmp_path, bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        load_mooncake(_write(tmp_path, bad), block_size=4)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(InvalidArgumentError, match="not found"):
        load_mooncake(str(tmp_path / "nope.jsonl"))
    p = tmp_path / "bad.jsonl"
    p.write_text('{"input_length": 3, "hash_ids": [0]}\n{not json\n')
    with pytest.raises(InvalidArgumentError, match=":2:"):
        load_mooncake(str(p), block_size=4)


def test_from_token_requests_chains_by_whole_prefix():
    a = np.array([1, 2, 3, 4, 5, 6], np.int32)
    b = np.array([9, 9, 3, 4, 5, 6], np.int32)        # same 2nd block content, other prefix
    c = np.array([1, 2, 3, 4, 5], np.int32)           # tail [5]: a block of its own
    bt = BlockTrace.from_token_requests([a, b, c], 2)
    ra, rb, rc = (r.tolist() for r in bt)
    assert ra[:2] == rc[:2] and ra[1] != rb[1] and ra[2] != rc[2]
    # block-level counts the tail [5] again; the token trie does not
    assert bt.block_len[rc[-1]] == 1 and bt.unique_tokens == unique_prefix_tokens([a, b, c]) + 1 == 13
    with pytest.raises(InvalidArgumentError):
        BlockTrace.from_token_requests([a.astype(np.int64)], 2)
    with pytest.raises(InvalidArgumentError):
        BlockTrace.from_token_requests([np.zeros(0, np.int32)], 2)


@settings(max_examples=30)
@given(seed=st.integers(0, 10_000), page=st.sampled_from([1, 2, 4, 8]))
def test_rechunk_equals_chunking_expanded_tokens(seed, page):
    bt = random_block_trace(30, 20, seed=seed, block_size=8)
    toks = []
    for r in bt:                                      # pseudo-tokens of the dense ids
        t = (r[:, None].astype(np.int64) * 8 + np.arange(8)).reshape(-1)
        toks.append(t[: int(bt.block_len[r].sum())].astype(np.int32))
    a = bt.rechunk(page)
    b = BlockTrace.from_token_requests(toks, page)
    assert a.n_blocks == b.n_blocks and a.unique_tokens == b.unique_tokens == unique_prefix_tokens(toks)
    assert a.infinite_hit_tokens() == b.infinite_hit_tokens()
    assert np.array_equal(np.diff(a.offsets), np.diff(b.offsets))
    # same block partition up to renaming
    assert sorted(a.block_len.tolist()) == sorted(b.block_len.tolist())
    with pytest.raises(AlignmentError):
        bt.rechunk(3)


@pytest.mark.skipif(not HAVE_MOONCAKE, reason="Mooncake traces not present")
@pytest.mark.parametrize("name,n,inf", [("conversation", 12031, 37.4), ("synthetic", 3993, 65.1)])
def test_mooncake_infinite_capacity_matches_readme(name, n, inf):
    tr = load_mooncake(_trace_path(name))
    bt = tr.block_trace()
    assert len(tr) == n
    assert round(100 * bt.infinite_hit_tokens() / tr.prompt_tokens, 1) == inf
    assert tr.unique_tokens == bt.unique_tokens < tr.prompt_tokens
    last = tr.tokens(n - 1)
    assert len(last) == tr.input_length[n - 1] and last.dtype == np.int32


# ---------------------------------------------------------------------- workloads
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_deterministic_per_seed(name):
    a = make_workload(name, n_requests=120, seed=7)
    b = make_workload(name, n_requests=120, seed=7)
    c = make_workload(name, n_requests=120, seed=8)
    assert len(a.requests) == 120 and a.output_lens.shape == (120,)
    assert all(r.dtype == np.int32 and r.ndim == 1 and len(r) > 0 for r in a.requests)
    assert all(np.array_equal(x, y) for x, y in zip(a.requests, b.requests))
    assert np.array_equal(a.output_lens, b.output_lens)
    assert any(len(x) != len(y) or not np.array_equal(x, y) for x, y in zip(a.requests, c.requests))
    # every workload has prefix sharing, and the trie count is right
    assert a.unique_tokens < a.prompt_tokens
    small = a.requests[:25]
    prefixes = {tuple(r[:i].tolist()) for r in small for i in range(1, len(r) + 1)}
    assert unique_prefix_tokens(small) == len(prefixes)


def test_workload_structures():
    mt = make_workload("multi-turn", n_requests=200, seed=1).requests
    extends = sum(any(len(p) < len(q) and np.array_equal(q[: len(p)], p) for p in mt[:i]) for i, q in enumerate(mt))
    assert extends > 50                                     # later turns extend earlier prompts
    tot = make_workload("tree-of-thought", n_requests=40, seed=1, branching=2, depth=3).requests
    assert all(np.array_equal(tot[i][: len(tot[0])], tot[0]) for i in range(15))   # one tree
    with pytest.raises(InvalidArgumentError):
        make_workload("nope")
    with pytest.raises(InvalidArgumentError):
        make_workload("agent", n_requests=0)
