"""``radixkv bench cluster``: the router's index predicts every manager's real hit exactly
(Python index; Dynamo's when installed, which must agree), round robin spreads evenly,
bounded loads stay bounded, and the CLI runs on a bundled trace."""
import argparse
import json

import numpy as np
import pytest

from radixkv.bench.cluster import PyRadixIndex, add_arguments, make_index, replay_cluster, run
from radixkv.errors import InvalidArgumentError


def requests(n=150, seed=0):
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 1000, 64).astype(np.int32) for _ in range(4)]
    out = []
    for i in range(n):
        s = systems[int(rng.integers(0, 4))]
        out.append(np.concatenate([s, rng.integers(0, 1000, int(rng.integers(5, 80))).astype(np.int32)]))
    return out


@pytest.mark.parametrize("router", ["kv", "kv_bounded"])
def test_index_predicts_the_real_hit_of_every_routed_request(router):
    r = replay_cluster(requests(), 3, 256, 16, router, "python")
    assert r.predicted_exact == 1.0 and r.index == "python"
    assert r.requests == 150 and r.hit_tokens == sum(m["hit_tokens"] for m in r.managers)
    assert all(m["cached_tokens"] <= 256 for m in r.managers)
    assert r.hit_tokens > 0


def test_dynamo_index_gives_the_same_replay_as_the_python_one():
    pytest.importorskip("dynamo._core")
    a = replay_cluster(requests(seed=3), 3, 256, 16, "kv_bounded", "python")
    b = replay_cluster(requests(seed=3), 3, 256, 16, "kv_bounded", "dynamo")
    assert b.index == "dynamo" and b.predicted_exact == 1.0
    assert a.managers == b.managers and a.hit_tokens == b.hit_tokens


def test_round_robin_and_bounded_loads():
    rr = replay_cluster(requests(), 3, 256, 16, "round_robin")
    assert [m["requests"] for m in rr.managers] == [50, 50, 50] and rr.predicted_exact is None
    kb = replay_cluster(requests(), 3, 256, 16, "kv_bounded", "python", slack=0.1)
    comp = [m["computed_tokens"] for m in kb.managers]
    longest = max(int(t.size) for t in requests())
    assert max(comp) <= 1.1 * sum(comp) / 3 + longest
    with pytest.raises(InvalidArgumentError):
        replay_cluster(requests(2), 0, 256, 16)
    with pytest.raises(InvalidArgumentError):
        replay_cluster(requests(2), 2, 256, 16, "random")
    with pytest.raises(InvalidArgumentError):
        make_index("redis")
    assert isinstance(make_index("python"), PyRadixIndex)


def test_cli_on_a_bundled_trace(capsys, tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "c.json"
    args = p.parse_args(["--trace", "synthetic", "--limit", "40", "--managers", "2", "--index", "python",
                         "--json", str(out)])
    assert run(args) == 0
    doc = json.loads(out.read_text())
    assert [r["router"] for r in doc["results"]] == ["kv", "kv_bounded", "round_robin"]
    assert all(r["requests"] == 40 for r in doc["results"])
    assert "hit rate" in capsys.readouterr().out
    assert run(p.parse_args(["--trace", "synthetic", "--routers", "magic"])) == 2
