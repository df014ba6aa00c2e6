"""benchmarks/bench_vs_sglang.py's driver on a tiny workload.

The radixkv half always runs; the SGLang half only where SGLang imports (installed, or a
``pip --target`` directory named by ``RADIXKV_SGLANG_PATH``), else those tests skip. The
hit rates the driver counts are checked against an independent count: with a pool that
never evicts, a request's hit is the longest page-aligned common prefix of its prompt with
any earlier request's (page-aligned) full sequence, computed here with numpy. Speed is
never checked.
"""
import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest
import torch

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vs_sglang.py"
N_REQUESTS = 40
BIG_POOL = 400_000    # > the workload's total tokens: nothing is evicted
SMALL_POOL = 30_000   # evicts on most requests


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_vs_sglang", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def work(bench):
    return bench.make_workload(N_REQUESTS, seed=3)


@pytest.fixture(scope="module")
def sg(bench):
    threads = torch.get_num_threads()
    found = bench.load_sglang(os.environ.get("RADIXKV_SGLANG_PATH"))
    torch.set_num_threads(threads)
    if found is None:
        pytest.skip("sglang not importable (set RADIXKV_SGLANG_PATH to a pip --target dir)")
    return found


def independent_hits(work, page_size):
    """Per request: the longest page-aligned prefix its prompt shares with any earlier
    request's page-aligned full sequence (what a tree that never evicts must match)."""
    seen, hits = [], []
    for prompt, full in work:
        p = prompt[:prompt.size - prompt.size % page_size]
        best = 0
        for s in seen:
            n = min(p.size, s.size)
            diff = np.flatnonzero(p[:n] != s[:n])
            common = int(diff[0]) if diff.size else n
            best = max(best, common - common % page_size)
        hits.append(best)
        seen.append(full[:full.size - full.size % page_size])
    return hits


def _driver(bench, impl, pool, ps, sg=None):
    return bench.radixkv_driver(pool, ps) if impl == "radixkv" else bench.sglang_driver(sg, pool, ps)


def _check_no_eviction(bench, work, impl, ps, sg=None):
    drv = _driver(bench, impl, BIG_POOL, ps, sg)
    run = bench.run_cycle(drv, bench.build_keys(work, ps, impl, sg), ps)
    want = independent_hits(work, ps)
    assert run["evicted_tokens"] == 0 and not run["wall"]["evict"]
    assert run["hits"] == want
    assert run["hit_rate"] == sum(want) / sum(p.size for p, _ in work)
    assert 0 < run["hit_rate"] < 1  # the workload shares prefixes, and not everything
    assert len(run["wall"]["match_prefix"]) == len(run["wall"]["insert"]) == N_REQUESTS
    return drv, run


def _check_with_eviction(bench, work, impl, ps, sg=None):
    drv = _driver(bench, impl, SMALL_POOL, ps, sg)
    run = bench.run_cycle(drv, bench.build_keys(work, ps, impl, sg), ps)
    assert run["evicted_tokens"] > 0
    # Eviction can only shorten a match: never above the never-evicting tree's.
    assert all(h <= w for h, w in zip(run["hits"], independent_hits(work, ps)))
    # The driver frees every duplicate row: the pool is the tree's plus the free rows.
    assert drv.alloc.available_size() + drv.cache.total_size() == SMALL_POOL
    return drv, run


@pytest.mark.parametrize("ps", [1, 16])
def test_radixkv_hits_match_independent_count(bench, work, ps):
    drv, _ = _check_no_eviction(bench, work, "radixkv", ps)
    drv.cache.check_invariants()


@pytest.mark.parametrize("ps", [1, 16])
def test_radixkv_cycle_with_eviction_conserves_rows(bench, work, ps):
    drv, _ = _check_with_eviction(bench, work, "radixkv", ps)
    drv.cache.check_invariants()


def test_summary_pools_reps_and_reports_match_plus_indices(bench, work):
    doc = bench.compare(work[:12], [1], reps=2, pool=BIG_POOL, sg=None, memory=False)["page1"]["radixkv"]
    ops = doc["ops"]
    assert ops["match_prefix"]["n"] == 24 and len(ops["match_prefix"]["rep_means_us"]) == 2
    assert ops["match_prefix+indices"]["n"] == 24  # radixkv: match returns the rows itself
    assert doc["hit_rate_by_rep"][0] == doc["hit_rate_by_rep"][1]


def test_missing_sglang_path_reports_skipped(bench, tmp_path, capsys):
    assert bench.main(["--sglang-path", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sglang"]["status"] == "skipped" and "pip install --no-deps" in out["sglang"]["reason"]


@pytest.mark.parametrize("ps", [1, 16])
def test_sglang_hits_match_independent_count(bench, work, sg, ps):
    _check_no_eviction(bench, work, "sglang", ps, sg)


@pytest.mark.parametrize("ps", [1, 16])
def test_sglang_cycle_with_eviction_conserves_rows(bench, work, sg, ps):
    _check_with_eviction(bench, work, "sglang", ps, sg)


def test_shims_are_only_placeholders(bench, sg):
    if not sg.shims:
        pytest.skip("a full SGLang install: nothing shimmed")
    import sys

    for name, read in sg.shims.items():
        if name == "sglang":
            continue
        for attr in read:
            with pytest.raises(RuntimeError, match="shimmed"):
                getattr(sys.modules[name], attr)()


# ----------------------------------------------------------------------------- MambaRadixCache part
SLOTS = N_REQUESTS + 8  # no state is ever evicted


def independent_state_hits(work):
    """Per request: the longest earlier full sequence that is a prefix of its prompt (every
    request leaves its state at its sequence's end; with no eviction a prompt resumes from
    the deepest such state)."""
    seen, hits = [], []
    for prompt, full in work:
        best = 0
        for s in seen:
            if s.size <= prompt.size and np.array_equal(prompt[:s.size], s):
                best = max(best, s.size)
        hits.append(best)
        seen.append(full)
    return hits


def _check_mamba(bench, work, impl, sg=None):
    import vs_sglang_mamba  # importable once the bench module put benchmarks/ on sys.path

    run = vs_sglang_mamba._mamba_cycle(work, BIG_POOL, SLOTS, impl, sg)
    want = independent_state_hits(work)
    assert sum(h > 0 for h in want) >= 3  # the workload resumes some conversations
    assert run["hits"] == want
    assert run["hit_rate"] == sum(want) / sum(p.size for p, _ in work)
    assert len(run["state"]) == N_REQUESTS and not run["wall"]["evict_states"]
    return run


def test_radixkv_mamba_state_hits_match_independent_count(bench, work):
    run = _check_mamba(bench, work, "radixkv")
    run["cache"].check_invariants()
    assert run["alloc"].available_size() + run["cache"].total_size() == BIG_POOL
    assert run["mamba"].available_size() + run["cache"].mamba_total_size() == SLOTS
    assert run["states_kept"] == run["cache"].mamba_total_size()


@pytest.fixture(scope="module")
def sg059(bench):
    threads = torch.get_num_threads()
    found = bench.load_sglang(os.environ.get("RADIXKV_SGLANG059_PATH"), "mamba")
    torch.set_num_threads(threads)
    if found is None:
        pytest.skip("sglang 0.5.9 not importable (set RADIXKV_SGLANG059_PATH to a pip --target dir)")
    return found


def test_sglang_mamba_state_hits_match_independent_count(bench, work, sg059):
    run = _check_mamba(bench, work, "sglang", sg059)
    run["cache"].sanity_check()
    full, states = run["cache"].total_size()
    assert run["alloc"].available_size() + full == BIG_POOL
    assert run["mamba"].available_size() + states == SLOTS
