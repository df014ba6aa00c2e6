"""benchmarks/vllm_trace.py: the workload and offline bounds of ``benchmarks/bench_vllm.py``.

No vLLM here: the session chains, the token mapping and the hit bounds are checked against
independent counts (a dict of block prefixes replayed request by request)."""
import importlib.util
import itertools
import pathlib
import sys

import numpy as np
import pytest

from radixkv.bench.traces import MooncakeTrace
from radixkv.errors import InvalidArgumentError

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACE = ROOT / "radixkv" / "data" / "mooncake" / "conversation_trace.jsonl"


@pytest.fixture(scope="module")
def vt():
    spec = importlib.util.spec_from_file_location("vllm_trace", ROOT / "benchmarks" / "vllm_trace.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vllm_trace"] = mod          # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _trace(chains, block=4):
    """A MooncakeTrace of the given hash-id lists (every last block full)."""
    off = np.zeros(len(chains) + 1, dtype=np.int64)
    np.cumsum([len(c) for c in chains], out=off[1:])
    ids = np.concatenate([np.asarray(c, dtype=np.int64) for c in chains])
    n = len(chains)
    return MooncakeTrace("t", np.zeros(n, np.int64), np.diff(off) * block, np.zeros(n, np.int64), off, ids, block)


def test_find_sessions_follows_last_full_blocks(vt):
    #            0: root+a   1: other      2: continues 0     3: continues 2       4: only the root shared
    t = _trace([[0, 1, 2], [0, 9, 10], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6], [0, 20]])
    assert vt.find_sessions(t) == [[0, 2, 3], [1], [4]]
    with pytest.raises(InvalidArgumentError):
        vt.find_sessions(t, min_shared=0)


def test_find_sessions_branch_opens_a_new_chain(vt):
    t = _trace([[0, 1, 2], [0, 1, 2, 3], [0, 1, 5]])      # 2 continues 0 too, after 1 did
    assert vt.find_sessions(t) == [[0, 1], [2]]


def test_to_vocab_is_deterministic_and_in_range(vt):
    x = np.arange(100_000, dtype=np.int32)
    a, b = vt.to_vocab(x, 4096), vt.to_vocab(x.copy(), 4096)
    assert a.dtype == np.int32 and np.array_equal(a, b)
    assert a.min() >= 0 and a.max() < 4096 and len(np.unique(a)) == 4096
    with pytest.raises(InvalidArgumentError):
        vt.to_vocab(x, 1)


def _bound_by_replay(prompts, bs, group):
    """Independent count: per group a set of stored block prefixes (bytes of the prefix)."""
    stored = {}
    hits = []
    for p, g in zip(prompts, group):
        seen = stored.setdefault(int(g), set())
        h = 0
        for k in range((len(p) - 1) // bs):
            if p[: (k + 1) * bs].tobytes() not in seen:
                break
            h += bs
        hits.append(h)
        for k in range(len(p) // bs):
            seen.add(p[: (k + 1) * bs].tobytes())
    return np.asarray(hits)


def test_hit_bound_matches_a_replay(vt):
    rng = np.random.default_rng(0)
    base = [rng.integers(0, 50, 40).astype(np.int32) for _ in range(4)]
    prompts = []
    for i in range(40):
        b = base[i % 4]
        cut = int(rng.integers(1, 40))
        tail = rng.integers(0, 50, int(rng.integers(0, 20))).astype(np.int32)
        prompts.append(np.concatenate([b[:cut], tail]))
    group = np.arange(40) % 2
    for bs in (1, 4, 8):
        assert np.array_equal(vt.hit_bound(prompts, bs), _bound_by_replay(prompts, bs, np.zeros(40)))
        assert np.array_equal(vt.hit_bound(prompts, bs, group), _bound_by_replay(prompts, bs, group))


def test_workload_on_the_bundled_trace(vt):
    w = vt.build_workload(str(TRACE), sessions=5, turns=3, tokens_per_block=16, max_prompt=600, vocab=4096)
    assert w.n_requests == 15 and len(w.rounds()) == 3
    assert all(p.dtype == np.int32 and 0 < len(p) <= 600 and p.max() < 4096 for p in w.prompts)
    assert vt.alternation(w) == 1.0                 # 5 sessions, 2 instances: every turn switches
    for s in range(5):           # each turn extends the previous one's blocks but its (scaled) tail
        idx = [i for i in range(15) if w.session[i] == s]
        for a, b in itertools.pairwise(idx):
            pa, pb = w.prompts[a], w.prompts[b]
            kept = (-(-len(pa) // 16) - 1) * 16
            assert kept > 0 and np.array_equal(pa[:kept], pb[:kept])
    shared = vt.hit_bound(w.prompts, 16).sum()
    local = vt.hit_bound(w.prompts, 16, w.instance).sum()
    assert 0 < local < shared < w.prompt_tokens


@pytest.mark.parametrize("n", [2, 3])
def test_alternate_routing_moves_every_session_at_every_turn(vt, n):
    # an even session count: round robin would keep each session on one instance with N = 2
    w = vt.build_workload(str(TRACE), sessions=4, turns=3, tokens_per_block=16, max_prompt=600, vocab=4096,
                          n_instances=n)
    assert vt.alternation(w) == 1.0
    assert np.array_equal(w.instance, (w.session + w.turn) % n)
    rr = vt.build_workload(str(TRACE), sessions=4, turns=3, tokens_per_block=16, max_prompt=600, vocab=4096,
                           routing="round-robin")
    assert vt.alternation(rr) == 0.0
    with pytest.raises(InvalidArgumentError):
        vt.build_workload(str(TRACE), sessions=4, turns=3, tokens_per_block=16, max_prompt=600, vocab=4096,
                          routing="random")


def test_workload_refuses_too_many_sessions(vt):
    with pytest.raises(InvalidArgumentError):
        vt.build_workload(str(TRACE), sessions=10_000, turns=3, tokens_per_block=16, max_prompt=600,
                          vocab=4096, scan=200)
