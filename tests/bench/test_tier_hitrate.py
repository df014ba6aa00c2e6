"""``radixkv bench hitrate --host-capacity-frac / --storage-capacity-frac``: the replay through
the real tiered cache; its rows name the tiers and their hit rates sum to the token hit rate."""
import json

import numpy as np
import pytest

from radixkv.bench.hitrate import load_source, main, measure, replay
from radixkv.bench.tier_engine import TieredReplayEngine
from radixkv.errors import InvalidArgumentError


def _src():
    return load_source(workload="multi-turn", limit=120, page_size=8, seed=1)


def test_tier_rows_sum_to_the_hit_rate_and_the_host_adds_hits():
    src = _src()
    base = measure(src, [0.02], ["lru"], "radix", show_progress=False)["results"][0]
    tiered = measure(src, [0.02], ["lru"], "radix", show_progress=False, host_frac=0.08)["results"][0]
    assert base["host_capacity_frac"] is None and base["tier_hit_rates"]["host"] == 0
    t = tiered["tier_hit_rates"]
    assert tiered["host_capacity_frac"] == 0.08 and tiered["storage_capacity_frac"] is None
    assert sum(t.values()) == pytest.approx(tiered["token_hit_rate"])
    assert t["host"] > 0 and tiered["token_hit_rate"] > base["token_hit_rate"]


def test_unbounded_storage_reaches_the_infinite_capacity_bound():
    src = _src()
    doc = measure(src, [0.1], ["lru"], "radix", show_progress=False, host_frac=0.1, storage_frac=float("inf"))
    r = doc["results"][0]
    assert r["storage_capacity_frac"] == "inf" and r["tier_hit_rates"]["storage"] > 0
    assert r["token_hit_rate"] >= doc["bounds"]["infinite_capacity"] - 0.02


def test_the_replay_keeps_the_tiers_consistent():
    src = _src()
    te = TieredReplayEngine(int(0.02 * src.unique_tokens), int(0.04 * src.unique_tokens), 200, "lru", 8)
    for i, toks in enumerate(src.tokens()):
        replay([toks], te)
        if i % 20 == 0:
            te.check_invariants()
    te.close()
    assert sum(te.tier_hits.values()) > 0


def test_write_through_replays_and_is_refused_without_a_host_tier(capsys):
    """``--write-policy write_through`` reaches the tiered cache (pages copied at insert); the
    row names the policy; without ``--host-capacity-frac`` or with an unknown name it is refused."""
    src = _src()
    wb, wt = (measure(src, [0.02], ["lru"], "radix", show_progress=False, host_frac=0.08, write_policy=p)["results"][0]
              for p in ("write_back", "write_through"))
    assert (wb["write_policy"], wt["write_policy"]) == ("write_back", "write_through")
    assert sum(wt["tier_hit_rates"].values()) == pytest.approx(wt["token_hit_rate"])
    assert wt["tier_hit_rates"]["host"] > 0
    te = TieredReplayEngine(int(0.02 * src.unique_tokens), int(0.08 * src.unique_tokens), None, "lru", 8,
                            "write_through")
    replay(src.tokens(), te)
    te.check_invariants()
    assert te.cache.tier_stats["written_through_pages"] > 0
    te.close()
    assert main(["--workload", "multi-turn", "--limit", "20", "--engine", "radix", "--write-policy", "write_through",
                 "--no-progress"]) == 2
    assert main(["--workload", "multi-turn", "--limit", "20", "--engine", "radix", "--host-capacity-frac", "0.1",
                 "--write-policy", "later", "--no-progress"]) == 2
    assert "write_policy must be one of" in capsys.readouterr().err


def test_cli_json_and_refusals(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["--workload", "multi-turn", "--limit", "60", "--page-size", "8", "--engine", "radix",
                 "--capacity-frac", "0.05", "--host-capacity-frac", "0.05", "--storage-capacity-frac", "0.1",
                 "--json", str(out), "--no-progress"]) == 0
    row = json.loads(out.read_text())["results"][0]
    assert row["storage_capacity_frac"] == 0.1 and set(row["tier_hit_rates"]) == {"device", "host", "storage"}
    assert "lru + host 5% + storage 10%" in capsys.readouterr().out
    assert main(["--workload", "multi-turn", "--limit", "20", "--host-capacity-frac", "0.1", "--no-progress"]) == 2
    with pytest.raises(InvalidArgumentError):
        measure(_src(), [0.1], ["lru"], "radix", storage_frac=0.1)
    assert np.isfinite(row["token_hit_rate"])
