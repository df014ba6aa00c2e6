"""benchmarks/count_radix.py: the callgrind out-file parser, the per-call division, and the
child's routing (exactly the counted op goes through ``operator.call``). The valgrind run itself
takes minutes; it runs only with RADIXKV_CALLGRIND=1."""
import importlib.util
import json
import os
import pathlib
import shutil
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def counter():
    spec = importlib.util.spec_from_file_location("count_radix", ROOT / "benchmarks" / "count_radix.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_callgrind_reads_events_and_totals(counter):
    text = ("version: 1\ncmd: python x\nevents: Ir Dr I1mr\nsummary: 10 4 2\n"
            "fn=(1) f\n3 5 1\ntotals: 12 6 3\n")
    assert counter.parse_callgrind(text) == {"Ir": 10, "Dr": 4, "I1mr": 2}
    assert counter.parse_callgrind("events: Ir Dr\ntotals: 7\n") == {"Ir": 7, "Dr": 0}
    with pytest.raises(ValueError):
        counter.parse_callgrind("events: Ir\n")
    with pytest.raises(ValueError):
        counter.parse_callgrind("totals: 1 2\n")


def test_per_call_divides_and_refuses_zero_calls(counter):
    assert counter.per_call({"Ir": 1001, "I1mr": 3}, 2) == {"Ir": 500.5, "I1mr": 1.5}
    with pytest.raises(ValueError):
        counter.per_call({"Ir": 1}, 0)


@pytest.mark.parametrize("op", ["match_prefix", "insert", "evict"])
def test_child_routes_exactly_the_counted_op(counter, monkeypatch, op):
    routed = []

    def spy(fn, *args):
        routed.append(fn.__name__)
        return fn(*args)

    monkeypatch.setattr(counter, "operator", types.SimpleNamespace(call=spy))
    threads = torch.get_num_threads()
    try:
        calls = counter.run_child(op, 4, 40, 60000, 0)
    finally:
        torch.set_num_threads(threads)
    want = {"match_prefix": "match_prefix", "insert": "insert", "evict": "evict"}[op]
    assert calls == len(routed) > 0 and set(routed) == {want}
    if op != "evict":
        assert calls == 40


def test_without_valgrind_it_says_skipped(counter, monkeypatch, capsys):
    monkeypatch.setattr(counter.shutil, "which", lambda name: None)
    assert counter.main(["--requests", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "skipped"


@pytest.mark.skipif(os.environ.get("RADIXKV_CALLGRIND") != "1" or shutil.which("valgrind") is None,
                    reason="minutes under valgrind: set RADIXKV_CALLGRIND=1")
def test_counts_under_valgrind(counter, capsys):
    assert counter.main(["--requests", "20", "--pool", "60000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calls"] == 20 and out["per_call"]["Ir"] > 1000
