"""``radixkv bench`` (and the top-level CLI): every sub-command's ``--help``, ``hitrate``
with ``--engine radix`` writing the JSON schema, ``--policy default``, usage errors,
``python -m radixkv bench ...``, ``serve`` delegation and a gRPC-free ``demo`` path."""
import json
import os
import subprocess
import sys

import pytest
from trace_fixtures import ROWS

from radixkv.bench import cli as bench_cli
from radixkv.bench.radix_engine import default_policy_name
from radixkv.cli import main
from radixkv.data import mooncake_trace

TOP_KEYS = {"trace", "engine", "page_size", "requests", "prompt_tokens", "unique_tokens", "bounds", "results"}
RESULT_KEYS = {"policy", "capacity_frac", "capacity_tokens", "page_size", "hit_tokens",
               "token_hit_rate", "evicted_tokens"}
#: every row adds the tiers (null capacities and device-only shares when the tiers are off)
TIER_KEYS = {"host_capacity_frac", "storage_capacity_frac", "tier_hit_rates", "write_policy"}
HAVE_TRACE = os.path.isfile(str(mooncake_trace("conversation")))


@pytest.fixture
def trace_file(tmp_path):
    p = tmp_path / "tiny_trace.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return str(p)


def check_schema(doc, policies, fracs, page):
    assert set(doc) == TOP_KEYS
    assert set(doc["bounds"]) == {"infinite_capacity", "belady"}
    assert set(doc["bounds"]["belady"]) == {f"{f:g}" for f in fracs}
    assert [r["policy"] for r in doc["results"]] == [p for p in policies for _ in fracs]
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS | TIER_KEYS
        assert sum(r["tier_hit_rates"].values()) == pytest.approx(r["token_hit_rate"])
        assert r["page_size"] == page
        assert r["capacity_tokens"] == int(r["capacity_frac"] * doc["unique_tokens"])
        assert r["token_hit_rate"] == pytest.approx(r["hit_tokens"] / doc["prompt_tokens"])
        assert 0 <= r["token_hit_rate"] <= doc["bounds"]["infinite_capacity"] + 1e-12


def test_bench_lists_its_subcommands(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name in bench_cli.SUBCOMMANDS:
        assert f"\n  {name}" in out
    assert main(["bench"]) == 2
    assert main(["bench", "nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_hitrate_help_has_exactly_the_module_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "hitrate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: radixkv bench hitrate")
    for flag in ("--trace", "--workload", "--block-size", "--page-size", "--capacity-frac", "--policy",
                 "--engine", "--json", "--plot", "--limit", "--seed", "--no-progress"):
        assert flag in out


def test_only_the_packaged_benchmarks_are_offered_without_a_checkout(capsys, monkeypatch):
    """What ``radixkv bench`` offers works from a wheel: the checkout's scripts are not verbs there."""
    assert bench_cli.SUBCOMMANDS == ("hitrate", "cluster")
    monkeypatch.setattr(bench_cli, "checkout_benchmarks", lambda: None)
    assert main(["bench", "radix"]) == 2
    assert "unknown benchmark 'radix'" in capsys.readouterr().err
    assert main(["bench", "--help"]) == 0
    assert "vllm" not in capsys.readouterr().out


def test_a_checkout_also_offers_its_benchmark_scripts(capsys):
    """From this source checkout ``radixkv bench vllm`` (issue 16's command) and the other
    scripts are verbs: listed in the help and run as ``python benchmarks/bench_NAME.py``."""
    assert bench_cli.checkout_benchmarks() is not None
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for name, (script, _) in bench_cli.SCRIPTS.items():
        assert f"\n  {name}" in out and script in out
    assert main(["bench", "allocator", "--help"]) == 0


def test_hitrate_radix_engine_writes_the_json_schema(trace_file, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "hitrate", "--trace", trace_file, "--block-size", "4", "--page-size", "2",
               "--capacity-frac", "0.25,0.5,1", "--policy", "lru,aplru,default", "--engine", "radix",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    pols = ["lru", "aplru", default_policy_name()]
    check_schema(doc, pols, [0.25, 0.5, 1.0], 2)
    assert doc["requests"] == 6 and doc["prompt_tokens"] == 58
    full = [r for r in doc["results"] if r["capacity_frac"] == 1.0]
    assert all(r["hit_tokens"] == 32 and r["evicted_tokens"] == 0 for r in full)   # = infinite
    assert "| aplru |" in capsys.readouterr().out


@pytest.mark.skipif(not HAVE_TRACE, reason="bundled Mooncake trace absent")
def test_hitrate_radix_on_a_tiny_limit_of_the_bundled_trace(tmp_path):
    out = tmp_path / "c.json"
    rc = main(["bench", "hitrate", "--trace", "conversation", "--limit", "40", "--engine", "radix",
               "--capacity-frac", "0.1,1", "--policy", "default,aplru", "--json", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    check_schema(doc, [default_policy_name(), "aplru"], [0.1, 1.0], 512)
    assert doc["requests"] == 40
    for r in doc["results"]:
        if r["capacity_frac"] == 1.0:
            assert r["token_hit_rate"] == pytest.approx(doc["bounds"]["infinite_capacity"])


def test_unknown_radix_policy_fails_before_any_work(trace_file, capsys):
    rc = main(["bench", "hitrate", "--trace", trace_file, "--block-size", "4", "--engine", "radix",
               "--policy", "lru,nope", "--no-progress"])
    assert rc == 2
    captured = capsys.readouterr()
    assert "nope" in captured.err and "| policy |" not in captured.out


def test_python_dash_m_bench_hitrate(trace_file):
    proc = subprocess.run([sys.executable, "-m", "radixkv", "bench", "hitrate", "--trace", trace_file,
                           "--block-size", "4", "--capacity-frac", "0.5", "--policy", "default",
                           "--json", "-", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)                     # only the JSON on stdout
    assert "| policy |" in proc.stderr
    check_schema(doc, [default_policy_name()], [0.5], 4)


def test_serve_help_is_the_service_parser(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: radixkv serve") and "--address" in out


def test_demo_and_bench_paths_do_not_import_grpc():
    code = ("import sys\n"
            "from radixkv.cli import build_parser, main\n"
            "assert build_parser().parse_args(['demo']).cmd == 'demo'\n"
            "assert main(['bench', '--help']) == 0\n"
            "assert not any(m == 'grpc' or m.startswith('grpc.') for m in sys.modules), 'grpc imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "demo" in out and "bench" in out and "serve" in out
