"""The ``bench hitrate`` CLI: JSON schema, table, engines, errors, plot and progress bar."""
import argparse
import io
import json

import numpy as np
import pytest
from trace_fixtures import ROWS

from radixkv.bench import hitrate
from radixkv.bench.hitrate import BlockSimAdapter, add_arguments, main, run
from radixkv.bench.progress import Progress

TOP_KEYS = {"trace", "engine", "page_size", "requests", "prompt_tokens", "unique_tokens", "bounds", "results"}
RESULT_KEYS = {"policy", "capacity_frac", "capacity_tokens", "page_size", "hit_tokens",
               "token_hit_rate", "evicted_tokens", "host_capacity_frac", "storage_capacity_frac", "tier_hit_rates",
               "write_policy"}


@pytest.fixture
def trace_file(tmp_path):
    p = tmp_path / "tiny_trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return str(p)


def _check_schema(doc, policies, fracs, page):
    assert set(doc) == TOP_KEYS
    assert set(doc["bounds"]) == {"infinite_capacity", "belady"}
    assert set(doc["bounds"]["belady"]) == {f"{f:g}" for f in fracs}
    assert len(doc["results"]) == len(policies) * len(fracs)
    assert [r["policy"] for r in doc["results"]] == [p for p in policies for _ in fracs]
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS
        assert r["capacity_tokens"] == int(r["capacity_frac"] * doc["unique_tokens"])
        assert r["page_size"] == page
        assert r["token_hit_rate"] == pytest.approx(r["hit_tokens"] / doc["prompt_tokens"])
        assert 0 <= r["token_hit_rate"] <= doc["bounds"]["infinite_capacity"] + 1e-12
        assert isinstance(r["hit_tokens"], int) and isinstance(r["evicted_tokens"], int)
        assert r["host_capacity_frac"] is None and r["storage_capacity_frac"] is None and r["write_policy"] is None
        assert r["tier_hit_rates"] == {"device": pytest.approx(r["token_hit_rate"]), "host": 0, "storage": 0}


def test_trace_json_schema_and_table(trace_file, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--trace", trace_file, "--block-size", "4", "--capacity-frac", "0.25,0.5,1",
               "--policy", "lru,lfu", "--json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    _check_schema(doc, ["lru", "lfu"], [0.25, 0.5, 1.0], 4)
    assert doc["trace"] == "tiny_trace" and doc["requests"] == 6 and doc["prompt_tokens"] == 58
    # hits: req1 8, req3 8, req4 12, req5 4 -> 32 of 58 with unbounded capacity
    assert doc["bounds"]["infinite_capacity"] == pytest.approx(32 / 58)
    full = [r for r in doc["results"] if r["capacity_frac"] == 1.0]
    assert all(r["hit_tokens"] == 32 and r["evicted_tokens"] == 0 for r in full)
    assert doc["engine"] == "blocksim" and doc["page_size"] == 4
    stdout = capsys.readouterr().out
    assert "tiny_trace, 6 requests, engine blocksim, page size 4" in stdout
    assert "token hit rate (% of prompt tokens) by cache capacity" in stdout
    assert "| policy | 25% | 50% | 100% |" in stdout
    for row in ("| lru |", "| lfu |", "| belady (offline) |", "| infinite capacity |"):
        assert row in stdout


def test_workload_json_to_stdout_with_research_policies(capsys):
    """benchmarks/bench_policies.py: hitrate's CLI with the block-level research policies."""
    from bench_policies import main as policies_main

    rc = policies_main(["--workload", "few-shot", "--limit", "80", "--page-size", "8", "--capacity-frac", "0.1",
                        "--policy", "lru,s3fifo,aplru", "--json", "-", "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)                    # stdout holds the JSON alone
    assert "| lru |" in captured.err                  # the table went to stderr
    _check_schema(doc, ["lru", "s3fifo", "aplru"], [0.1], 8)
    assert doc["trace"] == "few-shot(seed=0)" and doc["requests"] == 80
    assert doc["bounds"]["belady"]["0.1"] >= max(r["token_hit_rate"] for r in doc["results"])


def test_registered_engine_is_used(trace_file, tmp_path, monkeypatch):
    calls = []

    def factory(cap, policy, page):
        calls.append((cap, policy, page))
        return BlockSimAdapter(cap, policy, page)

    monkeypatch.setitem(hitrate.ENGINES, "toy", factory)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = ["--trace", trace_file, "--block-size", "4", "--capacity-frac", "0.5", "--policy", "lru", "--no-progress"]
    assert main(base + ["--json", str(a)]) == 0
    assert main(base + ["--engine", "toy", "--json", str(b)]) == 0
    ra, rb = json.loads(a.read_text())["results"], json.loads(b.read_text())["results"]
    assert calls and ra == rb


@pytest.mark.parametrize("extra", [
    ["--policy", "nope"],
    ["--policy", "s3fifo"],              # research only: benchmarks/bench_policies.py
    ["--policy", "aplru"],               # the tree's aplru keeps node state: --engine radix
    ["--engine", "not-registered"],
    ["--page-size", "3"],
])
def test_errors_exit_2(trace_file, extra, capsys):
    assert main(["--trace", trace_file, "--block-size", "4", "--no-progress"] + extra) == 2
    assert "error:" in capsys.readouterr().err


def test_missing_trace_and_bad_args(tmp_path, capsys):
    assert main(["--trace", str(tmp_path / "none.jsonl")]) == 2
    with pytest.raises(SystemExit):
        main(["--trace", "x", "--workload", "agent"])
    with pytest.raises(SystemExit):
        main(["--workload", "agent", "--capacity-frac", "0,abc"])
    capsys.readouterr()
    assert main(["--workload", "agent", "--capacity-frac", "0.5,1.5"]) == 2   # above every unique token
    assert "(0, 1]" in capsys.readouterr().err


def test_run_is_callable_from_another_parser(trace_file, tmp_path):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    add_arguments(sub.add_parser("hitrate"))
    args = parser.parse_args(["hitrate", "--trace", trace_file, "--block-size", "4",
                              "--capacity-frac", "0.5", "--no-progress", "--json", str(tmp_path / "x.json")])
    assert run(args) == 0


def test_plot_written_or_skipped_with_a_note(trace_file, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--trace", trace_file, "--block-size", "4", "--capacity-frac", "0.25,0.5",
                 "--json", str(out), "--no-progress"]) == 0
    png = tmp_path / "p.png"
    try:
        import matplotlib  # noqa: F401
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    except ImportError:
        assert not png.exists()
        assert "matplotlib is not installed" in capsys.readouterr().err


def test_replay_driver_counts():
    reqs = [np.arange(10, dtype=np.int32), np.arange(12, dtype=np.int32), np.arange(10, dtype=np.int32)]
    r = hitrate.replay(reqs, BlockSimAdapter(100, "lru", page_size=4))
    assert (r.requests, r.prompt_tokens) == (3, 32)
    assert r.hit_tokens == 8 + 10                     # 2nd: full blocks; 3rd repeats the 1st
    other = [reqs[0], np.arange(100, 110, dtype=np.int32), reqs[0]]
    roomy = hitrate.replay(other, BlockSimAdapter(100, "lru", page_size=4))
    tight = hitrate.replay(other, BlockSimAdapter(8, "lru", page_size=4))
    assert (roomy.hit_tokens, roomy.evicted_tokens) == (10, 0)
    assert (tight.hit_tokens, tight.evicted_tokens) == (0, 16)   # 8 cached, evicted twice


def test_progress_bar_is_tqdm_and_quiet_off_a_terminal():
    buf = io.StringIO()
    with Progress(4, "x", stream=buf, enabled=True) as bar:
        bar.update(2)
        bar.update(2)
    text = buf.getvalue()
    assert "x: 100%" in text and "4/4" in text and "req/s" in text
    quiet = io.StringIO()
    with Progress(4, stream=quiet) as bar:            # StringIO is not a terminal
        bar.update(4)
    assert quiet.getvalue() == ""


def test_progress_reaches_the_total_with_the_batched_simulator(trace_file, monkeypatch):
    """blocksim reports every 256 requests: the bar still ends at 100%."""
    ends = []
    real = hitrate.Progress

    def spy(*a, **k):
        bar = real(*a, **{**k, "enabled": True, "stream": io.StringIO()})
        ends.append(bar)
        return bar

    monkeypatch.setattr(hitrate, "Progress", spy)
    assert main(["--trace", trace_file, "--block-size", "4", "--capacity-frac", "0.5"]) == 0
    assert ends and all(b.n == b.total == 6 for b in ends)


def test_bundled_trace_shorthand(tmp_path):
    from radixkv.data import mooncake_trace

    if not mooncake_trace("synthetic").is_file():
        pytest.skip("bundled traces not present")
    out = tmp_path / "s.json"
    assert main(["--trace", "synthetic", "--limit", "300", "--capacity-frac", "0.05",
                 "--no-progress", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["trace"] == "synthetic_trace" and doc["requests"] == 300
