"""Hybrid (KV + state) hit-rate replay and ``bench hitrate --hybrid``: against an independent
computation (unlimited slots with ``every`` = the plain KV hit; no slots = no hit), the tree
replay against the scheduler flow, the JSON schema / tables / plot, and usage errors."""
import json

import numpy as np
import pytest
from trace_fixtures import ROWS, bundled_trace

from radixkv.bench.hitrate import main
from radixkv.bench.hybrid_hitrate import (
    chunk_ends,
    kv_budget,
    parse_state_policy,
    replay_flow,
    replay_tree,
    state_policy_label,
)
from radixkv.bench.workloads import make_workload
from radixkv.cache.hybrid.mamba_policies import FlopStateOrder
from radixkv.errors import InvalidArgumentError

B = 8  # tokens per block of the synthetic chains


def block_chains(n: int, seed: int):
    """Requests made of whole ``B``-token blocks (distinct tokens per block): a random prefix
    of an earlier request, then 1-3 fresh blocks, the last one never seen again. So every
    KV match ends on a block boundary, short of the prompt's last block."""
    rng = np.random.default_rng(seed)
    chains, nxt = [], 0
    for _ in range(n):
        base = []
        if chains and rng.random() < 0.8:
            prev = chains[int(rng.integers(len(chains)))]
            base = prev[: int(rng.integers(0, len(prev)))]
        k = int(rng.integers(1, 4))
        chain = base + list(range(nxt, nxt + k))
        nxt += k
        chains.append(chain)
    reqs = [(np.asarray(c, np.int64)[:, None] * B + np.arange(B)).reshape(-1).astype(np.int32) for c in chains]
    return chains, reqs


def expected_hits(chains):
    """Unbounded cache: longest prefix (in blocks) shared with any earlier request."""
    seen, out = set(), []
    for c in chains:
        k = 0
        while k < len(c) and tuple(c[:k + 1]) in seen:
            k += 1
        out.append(k * B)
        seen.update(tuple(c[:j]) for j in range(1, len(c) + 1))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_unlimited_slots_every_equals_the_kv_hit(seed):
    chains, reqs = block_chains(150, seed)
    want = sum(expected_hits(chains))
    total_blocks = sum(len(c) for c in chains)
    kv = replay_tree(reqs, 10 ** 9, 0, B)                     # KV-only tree
    assert kv.hit_tokens == want
    for ckpt in (False, True):
        r = replay_tree(reqs, 10 ** 9, total_blocks, B, "every", "lru", ckpt, working_slot=True)
        assert (r.hit_tokens, r.kv_hit_tokens, r.lost_tokens) == (want, want, 0)
        assert r.state_hits == sum(h > 0 for h in expected_hits(chains))
        assert r.evicted_tokens == 0 and r.evicted_states == 0
    # a finite KV budget, still unlimited slots: every KV match has its state. (Not equal
    # to the KV-only tree's hit: chunk-end inserts split nodes, and the tree evicts whole
    # nodes, so the two trees evict different units.)
    cap = kv_budget(sum(len(x) for x in reqs), 0.1, max(len(x) for x in reqs))
    r = replay_tree(reqs, cap, total_blocks, B, "every", "lru", False, working_slot=True)
    assert r.evicted_tokens > 0 and r.hit_tokens > 0
    assert r.hit_tokens == r.kv_hit_tokens


def test_zero_slots_nothing_hits_but_the_kv_is_matched():
    chains, reqs = block_chains(120, 3)
    want = sum(expected_hits(chains))
    for adm in ("every", "branch"):
        r = replay_tree(reqs, 10 ** 9, 0, B, adm, "flop", True, working_slot=True)
        assert (r.hit_tokens, r.state_hits, r.flops_saved, r.states_end) == (0, 0, 0.0, 0)
        assert r.kv_hit_tokens == r.lost_tokens == want


def test_fewer_slots_never_hit_more_than_the_kv_match():
    reqs = make_workload("multi-turn", n_requests=150, seed=1).requests
    cap = kv_budget(10 ** 5, 0.5, max(len(x) for x in reqs))
    by_slots = [replay_tree(reqs, cap, s, 256, "every", "lru", True, working_slot=True) for s in (0, 4, 64)]
    for r in by_slots:
        assert 0 <= r.hit_tokens <= r.kv_hit_tokens <= r.prompt_tokens
        assert r.states_end is not None
    assert by_slots[0].hit_tokens == 0 < by_slots[1].hit_tokens
    assert by_slots[1].states_end <= 4 and by_slots[2].states_end <= 64
    assert by_slots[1].evicted_states > 0


@pytest.mark.parametrize("adm, pol, ckpt", [("every", "lru", True), ("branch", "flop", True), ("every", "lru", False)])
def test_tree_replay_matches_the_scheduler_flow(adm, pol, ckpt):
    reqs = make_workload("multi-turn", n_requests=80, seed=2).requests
    mx = max(len(x) for x in reqs)
    cap = kv_budget(sum(len(x) for x in reqs), 0.05, mx)
    t = replay_tree(reqs, cap, 6, 128, adm, pol, ckpt, working_slot=True)
    f = replay_flow(reqs, mx, cap, 6, 128, adm, pol, ckpt, working_slot=True)
    assert (t.hit_tokens, t.kv_hit_tokens, t.state_hits) == (f.hit_tokens, f.kv_hit_tokens, f.state_hits)
    assert t.flops_saved == pytest.approx(f.flops_saved)
    # the KV-only tree replay skips chunk-end inserts (they gain it nothing, but split
    # nodes, which changes whole-node eviction): compare it unchunked
    kv_t, kv_f = replay_tree(reqs, cap, 0, 10 ** 9), replay_flow(reqs, mx, cap, 0, 10 ** 9)
    assert (kv_t.hit_tokens, kv_t.evicted_tokens) == (kv_f.hit_tokens, kv_f.evicted_tokens)


@pytest.mark.parametrize("ckpt", [False, True])
def test_host_state_tier_gives_back_the_hits_of_unlimited_device_slots(ckpt):
    """2 device state slots and a host state tier holding every state: no state is lost, so
    the hit is the unbounded cache's, as with unlimited device slots; without the host
    tier the same 2 slots hit less."""
    chains, reqs = block_chains(150, 4)
    want = sum(expected_hits(chains))
    total_blocks = sum(len(c) for c in chains)
    r = replay_tree(reqs, 10 ** 9, 2, B, "every", "lru", ckpt, working_slot=True, host_slots=total_blocks)
    assert (r.hit_tokens, r.kv_hit_tokens) == (want, want)
    assert replay_tree(reqs, 10 ** 9, 2, B, "every", "lru", ckpt, working_slot=True).hit_tokens < want


def test_host_kv_tier_gives_back_the_hits_of_an_unbounded_cache():
    """A device KV budget of a few prompts and 2 state slots, with host KV and host state
    tiers holding everything (TieredMambaRadixCache): the hit is the unbounded cache's;
    with the host state tier alone the same budget hits less."""
    chains, reqs = block_chains(150, 4)
    want = sum(expected_hits(chains))
    total = sum(len(c) for c in chains) * B
    cap = 3 * max(len(x) for x in reqs)
    r = replay_tree(reqs, cap, 2, B, "every", "lru", False, working_slot=True, host_slots=total,
                    host_kv_tokens=total)
    assert (r.hit_tokens, r.kv_hit_tokens) == (want, want)
    assert replay_tree(reqs, cap, 2, B, "every", "lru", False, working_slot=True, host_slots=total).hit_tokens < want
    with pytest.raises(InvalidArgumentError, match="host-state-slots"):
        replay_tree(reqs, cap, 2, B, "every", "lru", False, working_slot=True, host_kv_tokens=total)


def test_tree_replay_matches_the_scheduler_flow_with_host_states():
    reqs = make_workload("multi-turn", n_requests=80, seed=2).requests
    mx = max(len(x) for x in reqs)
    cap = kv_budget(sum(len(x) for x in reqs), 0.05, mx)
    t = replay_tree(reqs, cap, 3, 128, "every", "lru", True, working_slot=True, host_slots=8)
    f = replay_flow(reqs, mx, cap, 3, 128, "every", "lru", True, working_slot=True, host_slots=8)
    assert (t.hit_tokens, t.kv_hit_tokens, t.state_hits) == (f.hit_tokens, f.kv_hit_tokens, f.state_hits)
    assert t.hit_tokens > replay_tree(reqs, cap, 3, 128, "every", "lru", True, working_slot=True).hit_tokens


def test_helpers_and_bad_arguments():
    assert parse_state_policy("LRU") == "lru"
    fl = parse_state_policy("flop:3")
    assert isinstance(fl, FlopStateOrder) and fl.alpha == 3.0
    assert state_policy_label(fl) == "flop(alpha=3)" and state_policy_label("flop") == "flop"
    for bad in ("nope", "lru:2", "flop:x", "flop:-1"):
        with pytest.raises(InvalidArgumentError):
            parse_state_policy(bad)
    with pytest.raises(InvalidArgumentError):
        replay_tree([np.arange(4, dtype=np.int32)], 100, -1, 8, "every", working_slot=True)
    with pytest.raises(InvalidArgumentError):
        replay_tree([np.arange(4, dtype=np.int32)], 100, 1, 8, "every")   # the pool needs >= 2 slots
    assert kv_budget(1000, 0.01, 50) == 51 and kv_budget(10 ** 6, 0.01, 50) == 10 ** 4

    class M:
        prefix_len, kv_prefix_len = 3, 10

    assert chunk_ends(M, 30, 8, True) == [10, 18, 26, 30]
    assert chunk_ends(M, 30, 8, False) == [11, 19, 27, 30]


# ---------------------------------------------------------------------- the CLI
RESULT_KEYS = {"policy", "capacity_frac", "capacity_tokens", "page_size", "track", "state_slots",
               "host_state_slots", "admission", "state_policy", "checkpoint", "hit_tokens", "token_hit_rate",
               "kv_hit_tokens", "kv_hit_rate",
               "lost_tokens", "lost_rate", "state_hits", "state_hit_rate", "flop_saved", "evicted_tokens",
               "evicted_states", "states_end", "kv_tokens_end"}


@pytest.fixture
def trace_file(tmp_path):
    p = tmp_path / "tiny_trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return str(p)


def test_cli_hybrid_json_tables_and_plot(trace_file, tmp_path, capsys):
    out = tmp_path / "h.json"
    rc = main(["--trace", trace_file, "--block-size", "4", "--hybrid", "--capacity-frac", "0.5,4",
               "--state-slots", "0,2,100", "--admission", "every,branch", "--state-policy", "lru,flop:3",
               "--checkpoint", "on,off", "--chunk", "4", "--json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "hybrid" and doc["requests"] == 6 and doc["prompt_tokens"] == 58
    assert len(doc["results"]) == 2 * 3 * 2 * 2 * 2 and len(doc["kv_only"]) == 2
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS
        assert r["token_hit_rate"] == pytest.approx(r["hit_tokens"] / 58)
        assert r["lost_tokens"] == r["kv_hit_tokens"] - r["hit_tokens"] >= 0
        assert r["capacity_tokens"] == max(int(r["capacity_frac"] * doc["unique_tokens"]), 17)
        if r["state_slots"] == 0:
            assert r["hit_tokens"] == 0 and r["state_hits"] == 0
    # 4x the unique tokens: nothing evicted; 100 slots with every and 4-token chunks keep a
    # state at every block boundary, so the hit is the KV-only tree's (the last token is
    # never matched: 8 + 8 + 12 + 4 = 32 tokens of the block-level 32, less nothing)
    roomy = [r for r in doc["results"] if r["capacity_frac"] == 4 and r["state_slots"] == 100
             and r["admission"] == "every"]
    kv_roomy = [k for k in doc["kv_only"] if k["capacity_frac"] == 4][0]
    assert kv_roomy["hit_tokens"] == 32 and kv_roomy["evicted_tokens"] == 0
    assert all(r["hit_tokens"] == 32 and r["evicted_tokens"] == 0 for r in roomy)
    text = capsys.readouterr().out
    assert "token hit rate" in text and "KV-matched tokens lost" in text
    for row in ("| 100 slots, every+flop(alpha=3)+ckpt |", "| 2 slots, branch+lru |", "| kv-only radix |",
                "| belady (KV, offline) |", "| infinite capacity |"):
        assert row in text
    png = tmp_path / "h.png"
    try:
        import matplotlib  # noqa: F401
        assert png.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert not png.exists()


def test_cli_hybrid_flow_engine_agrees_with_tree(trace_file, tmp_path):
    docs = []
    for eng in ("tree", "flow"):
        out = tmp_path / f"{eng}.json"
        assert main(["--trace", trace_file, "--block-size", "4", "--hybrid", "--engine", eng,
                     "--capacity-frac", "0.5", "--state-slots", "3", "--chunk", "4",
                     "--json", str(out), "--no-progress"]) == 0
        docs.append(json.loads(out.read_text()))
    strip = [[{k: v for k, v in r.items()} for r in d["results"]] for d in docs]
    assert strip[0] == strip[1]


def test_cli_hybrid_pages_tracked_and_untracked(trace_file, tmp_path):
    """``--pages 1,3,8 --track on,off``: the tree replay and the real flow agree at every
    page size; tracking never loses a state hit to the untracked replay and, with prompts
    ending off the page grid, gains some."""
    docs = []
    for eng in ("tree", "flow"):
        out = tmp_path / f"p-{eng}.json"
        assert main(["--trace", trace_file, "--block-size", "4", "--hybrid", "--engine", eng,
                     "--capacity-frac", "4", "--state-slots", "100", "--admission", "every", "--state-policy", "lru",
                     "--checkpoint", "off", "--chunk", "5", "--pages", "1,3,8", "--track", "on,off",
                     "--json", str(out), "--no-progress"]) == 0
        docs.append(json.loads(out.read_text()))
    assert docs[0]["results"] == docs[1]["results"]
    res = {(r["page_size"], r["track"]): r for r in docs[0]["results"]}
    assert sorted(res) == [(1, True), (3, False), (3, True), (8, False), (8, True)]
    assert {k["page_size"] for k in docs[0]["kv_only"]} == {1, 3, 8}
    for ps in (3, 8):
        assert res[ps, True]["state_hits"] >= res[ps, False]["state_hits"]
    assert sum(res[ps, True]["hit_tokens"] - res[ps, False]["hit_tokens"] for ps in (3, 8)) > 0
    assert all(r["state_hits"] > 0 for r in res.values() if r["track"])


@pytest.mark.parametrize("extra", [
    ["--engine", "blocksim"], ["--track", "sometimes"], ["--pages", "0"], ["--admission", "sometimes"],
    ["--state-policy", "mru"],
    ["--checkpoint", "maybe"], ["--chunk", "0"], ["--page-size", "2"], ["--policy", "nope"],
])
def test_cli_hybrid_usage_errors(trace_file, extra, capsys):
    assert main(["--trace", trace_file, "--block-size", "4", "--hybrid", "--no-progress"] + extra) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.skipif(bundled_trace("conversation") is None, reason="bundled Mooncake trace absent")
def test_cli_hybrid_on_a_prefix_of_the_conversation_trace(tmp_path):
    out = tmp_path / "c.json"
    assert main(["--trace", "conversation", "--limit", "60", "--hybrid", "--capacity-frac", "0.05,1",
                 "--state-slots", "0,1000", "--admission", "every", "--state-policy", "lru",
                 "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == 60
    kv = {k["capacity_frac"]: k["hit_tokens"] for k in doc["kv_only"]}
    for r in doc["results"]:
        assert r["kv_hit_tokens"] >= r["hit_tokens"]
        if r["state_slots"] == 0:
            assert r["hit_tokens"] == 0
        elif r["capacity_frac"] == 1:                       # nothing evicted: the KV-only match
            assert r["kv_hit_tokens"] == kv[1] and r["evicted_tokens"] == 0


def test_cli_hybrid_host_state_slots(trace_file, tmp_path, capsys):
    out = tmp_path / "h.json"
    rc = main(["--trace", trace_file, "--block-size", "4", "--hybrid", "--capacity-frac", "4", "--state-slots", "1",
               "--host-state-slots", "0,64", "--admission", "every", "--state-policy", "lru", "--chunk", "4",
               "--json", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr()
    rows = json.loads(out.read_text())["results"]
    assert [r["host_state_slots"] for r in rows] == [0, 64]
    assert rows[1]["hit_tokens"] > rows[0]["hit_tokens"], rows
    assert "1 + 64 host slots" in capsys.readouterr().out
    rc = main(["--trace", trace_file, "--block-size", "4", "--hybrid", "--capacity-frac", "0.05", "--state-slots", "1",
               "--host-state-slots", "64", "--host-capacity-frac", "0.5", "--admission", "every",
               "--state-policy", "lru", "--chunk", "4", "--json", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr()
    (row,) = json.loads(out.read_text())["results"]
    assert row["host_capacity_frac"] == 0.5 and row["host_kv_tokens"] > 0 and row["write_policy"] == "write_back"
    assert "host KV 50%)" in capsys.readouterr().out
    rc = main(["--trace", trace_file, "--block-size", "4", "--hybrid", "--capacity-frac", "0.05", "--state-slots", "1",
               "--host-state-slots", "64", "--host-capacity-frac", "0.5", "--write-policy", "write_through",
               "--admission", "every", "--state-policy", "lru", "--chunk", "4", "--json", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr()
    (row,) = json.loads(out.read_text())["results"]
    assert row["write_policy"] == "write_through" and row["hit_tokens"] > 0
    assert "host KV 50%, write_through" in capsys.readouterr().out
    assert main(["--trace", trace_file, "--block-size", "4", "--hybrid", "--capacity-frac", "0.05", "--state-slots",
                 "1", "--write-policy", "write_through", "--no-progress"]) == 2
