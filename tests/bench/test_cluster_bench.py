"""``radixkv bench cluster``: the router's index predicts every manager's real hit exactly
(Python index; Dynamo's when installed, which must agree), round robin spreads evenly,
bounded loads stay bounded, the CLI runs on a bundled trace, and managers that are real
``radixkv serve`` processes give exactly the in-process managers' per-request hits, then
leave no process, socket or pool file behind (also when starting or replaying fails)."""
import argparse
import glob
import json
import os
import stat
import time

import numpy as np
import pytest

from radixkv.bench.cluster import (
    ROUTERS,
    InprocManager,
    PyRadixIndex,
    add_arguments,
    make_index,
    replay_cluster,
    replay_on,
    run,
    served_len,
)
from radixkv.bench.cluster_procs import ManagerProcesses, ManagerStartError
from radixkv.bench.hitrate import load_source
from radixkv.errors import AlignmentError, CapacityError, InvalidArgumentError

PAGE = 64


def requests(n=150, seed=0):
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 1000, 64).astype(np.int32) for _ in range(4)]
    out = []
    for _i in range(n):
        s = systems[int(rng.integers(0, 4))]
        out.append(np.concatenate([s, rng.integers(0, 1000, int(rng.integers(5, 80))).astype(np.int32)]))
    return out


def chats(n, cap, seed=0):
    """Multi-turn prompts that exercise every serving rule: the same prompt again (a
    page-aligned full match, of which the last page is recomputed), aligned and unaligned
    growth (a partial last page costs a whole page), prompts longer than a manager."""
    rng = np.random.default_rng(seed)
    convs, out = [], []
    for _ in range(n):
        if not convs or rng.random() < 0.3:
            convs.append(rng.integers(0, 5000, int(rng.integers(1, 20)) * PAGE).astype(np.int32))
        k = int(rng.integers(0, len(convs)))
        r = rng.random()
        add = 0 if r < 0.2 else int(rng.integers(1, 10)) * PAGE if r < 0.5 else int(rng.integers(1, 700))
        if rng.random() < 0.05:
            add += cap
        convs[k] = np.concatenate([convs[k], rng.integers(0, 5000, add).astype(np.int32)])
        out.append(convs[k])
    return out


def gone(pids):
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


@pytest.mark.parametrize("router", ["kv", "kv_bounded"])
def test_index_predicts_the_real_hit_of_every_routed_request(router):
    r = replay_cluster(requests(), 3, 256, 16, router, "python")
    assert r.predicted_exact == 1.0 and r.index == "python" and r.mode == "inproc"
    assert r.requests == 150 and r.hit_tokens == sum(m["hit_tokens"] for m in r.managers) == int(r.hits.sum())
    assert all(m["cached_tokens"] <= 256 for m in r.managers)
    assert r.hit_tokens > 0


def test_dynamo_index_gives_the_same_replay_as_the_python_one():
    pytest.importorskip("dynamo._core")
    a = replay_cluster(requests(seed=3), 3, 256, 16, "kv_bounded", "python")
    b = replay_cluster(requests(seed=3), 3, 256, 16, "kv_bounded", "dynamo")
    assert b.index == "dynamo" and b.predicted_exact == 1.0
    assert a.managers == b.managers and a.hit_tokens == b.hit_tokens
    assert np.array_equal(a.routes, b.routes) and np.array_equal(a.hits, b.hits)


def test_round_robin_and_bounded_loads():
    rr = replay_cluster(requests(), 3, 256, 16, "round_robin")
    assert [m["requests"] for m in rr.managers] == [50, 50, 50] and rr.predicted_exact is None
    assert rr.routes.tolist() == [i % 3 for i in range(150)]
    kb = replay_cluster(requests(), 3, 256, 16, "kv_bounded", "python", slack=0.1)
    comp = [m["computed_tokens"] for m in kb.managers]
    longest = max(int(t.size) for t in requests())
    assert max(comp) <= 1.1 * sum(comp) / 3 + longest
    with pytest.raises(InvalidArgumentError):
        replay_cluster(requests(2), 0, 256, 16)
    with pytest.raises(InvalidArgumentError):
        replay_cluster(requests(2), 2, 256, 16, "random")
    with pytest.raises(AlignmentError):
        replay_cluster(requests(2), 2, 250, 16)
    with pytest.raises(InvalidArgumentError):
        replay_cluster(requests(2), 2, 256, 16, mode="threads")
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
    assert all(r["requests"] == 40 and r["mode"] == "inproc" for r in doc["results"])
    assert "hit rate" in capsys.readouterr().out
    assert p.parse_args(["--router", "kv,round_robin"]).routers == "kv,round_robin"
    assert run(p.parse_args(["--trace", "synthetic", "--routers", "magic"])) == 2



def test_dynamo_mocker_replays_the_same_requests_with_the_managers_capacity(tmp_path):
    pytest.importorskip("dynamo._core")
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "m.json"
    assert run(p.parse_args(["--trace", "synthetic", "--limit", "20", "--managers", "2", "--router", "round_robin",
                             "--mocker", "--capacity-frac", "1", "--json", str(out)])) == 0
    doc = json.loads(out.read_text())  # capacity >= every prompt: the mocker admits them all
    mock = doc["dynamo_mocker"]
    assert mock["extra_engine_args"]["engine"] == {"block_size": PAGE,
                                                   "num_gpu_blocks": doc["capacity_tokens_each"] // PAGE}
    for mode in ("kv_router", "round_robin"):
        assert mock[mode]["total_input_tokens"] == doc["prompt_tokens"] and mock[mode]["completed_requests"] == 20
        assert 0.0 <= mock[mode]["prefix_cache_reused_ratio"] <= 1.0

def test_process_managers_serve_exactly_the_inproc_hits():
    cap = 32768  # far below the prompts' tokens: both managers evict throughout
    conv = list(load_source("conversation", None, 512, PAGE, 40).tokens())
    syn = chats(80, cap)
    assert len(conv) == 40 and any(t.size > cap for t in syn)
    procs = ManagerProcesses(2, cap, PAGE)
    with procs:
        assert stat.S_IMODE(os.stat(procs.directory).st_mode) == 0o700
        files = os.listdir(procs.directory)
        assert {"m0.sock", "m1.sock", "token"} <= set(files)
        for pid in procs.pids:  # the pool files live in the directory, none in /dev/shm
            assert any(f.startswith(f"radixkv-{pid}-") for f in files)
            assert not glob.glob(f"/dev/shm/radixkv-{pid}-*")
        for name, reqs in (("conversation", conv), ("chats", syn)):
            for router in ROUTERS:
                procs.reset()
                got = replay_on(procs.managers, reqs, cap, PAGE, router)
                want = replay_cluster(reqs, 2, cap, PAGE, router, "python")
                assert (got.mode, want.mode) == ("process", "inproc")
                assert np.array_equal(got.routes, want.routes), (name, router)
                assert np.array_equal(got.hits, want.hits), (name, router, np.flatnonzero(got.hits != want.hits))
                assert got.managers == want.managers, (name, router)
                assert got.predicted_exact == (None if router == "round_robin" else 1.0), (name, router)
                for m in procs.managers:
                    s = m.client.stats(m.session)
                    assert s.kv_held == 0 and s.requests == 0
                    assert s.kv_available + s.kv_evictable + s.kv_protected == s.kv_capacity == cap
                if name == "chats" and router == "round_robin":
                    served = np.array([served_len(t.size, cap) for t in reqs])
                    full = (served % PAGE == 0) & (got.hits == served - PAGE)
                    assert full.any()  # the last page of a cached aligned prompt is recomputed
        assert min(m.client.stats(m.session).evicted_tokens for m in procs.managers) > 0
        pids, directory = procs.pids, procs.directory
    assert procs.returncodes == [0, 0] and gone(pids) and not os.path.exists(directory)


def test_processes_are_stopped_when_starting_or_replaying_fails():
    bad = ManagerProcesses(1, 1024, PAGE, extra_args=["--eviction-policy", "nope"], start_timeout_s=600,
                           stop_timeout_s=600)
    with pytest.raises(ManagerStartError, match="eviction_policy"):
        bad.start()
    assert bad.returncodes == [2] and gone(bad.pids) and not os.path.exists(bad.directory)

    def broken_trace():
        yield from requests(5, seed=1)
        raise RuntimeError("trace file truncated")

    # generous hang guards: a loaded machine may take long to start or stop a manager, and
    # a SIGKILL after a short stop timeout would fail the returncode check for no fault
    procs = ManagerProcesses(1, 1024, PAGE, start_timeout_s=600, stop_timeout_s=600)
    with pytest.raises(RuntimeError, match="truncated"):
        with procs:
            m = procs.managers[0]
            with pytest.raises(CapacityError):
                m.serve(np.arange(1025, dtype=np.int32))  # over the manager's context: refused
            s = m.client.stats(m.session)
            assert s.kv_held == 0 and s.kv_available == 1024 and s.requests == 0
            # 16 one-page prompts fill the manager; a 65-token prompt needs two whole pages,
            # so it evicts the two oldest (the partial page costs a page): r1 + 1 token misses,
            # r3 + 1 token hits its page, r3 itself does not (one token is always computed)
            r = [np.arange(k * 64, k * 64 + 64, dtype=np.int32) for k in range(17)]
            seq = r[:16] + [np.arange(5000, 5065, dtype=np.int32)] + [np.append(r[k], 9).astype(np.int32)
                                                                       for k in (1, 3)] + [r[3]]
            local = InprocManager(1024, PAGE)
            want = [0] * 18 + [64, 0]
            assert [local.serve(t) for t in seq] == want
            assert [m.serve(t) for t in seq] == want
            assert m.cached_tokens() == local.cached_tokens() == 15 * PAGE
            procs.reset()
            replay_on(procs.managers, broken_trace(), 1024, PAGE, "kv")
    assert procs.returncodes == [0] and gone(procs.pids) and not os.path.exists(procs.directory)


def test_cli_process_mode_reports_what_inproc_mode_reports(tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    docs = {}
    for mode in ("inproc", "process"):
        out = tmp_path / f"{mode}.json"
        assert run(p.parse_args(["--trace", "synthetic", "--limit", "30", "--managers", "1", "--index", "python",
                                 "--capacity-frac", "0.2", "--router", "kv,round_robin", "--managers-mode", mode,
                                 "--json", str(out)])) == 0
        docs[mode] = json.loads(out.read_text())
    proc = docs["process"]
    assert proc["managers_mode"] == "process" and len(proc["manager_pids"]) == 1 and gone(proc["manager_pids"])
    strip = ("mode", "seconds", "requests_per_s")
    for a, b in zip(docs["inproc"]["results"], proc["results"]):
        assert b["mode"] == "process" and b["requests"] == 30
        assert {k: v for k, v in a.items() if k not in strip} == {k: v for k, v in b.items() if k not in strip}


def test_replay_counts_every_request_on_the_progress_bar():
    class Bar:
        n = 0

        def update(self, k):
            self.n += k

    bar = Bar()
    r = replay_on([InprocManager(256, 16) for _ in range(2)], requests(), 256, 16, "kv", "python", progress=bar)
    assert bar.n == r.requests == 150


def test_cli_draws_a_bar_per_router_on_stderr_unless_told_not_to(capsys, monkeypatch):
    import radixkv.bench.cluster as cluster

    drawn = []
    real = cluster.Progress
    monkeypatch.setattr(cluster, "Progress", lambda total, label, enabled=None: drawn.append((total, label, enabled))
                        or real(total, label, enabled=False))
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--trace", "synthetic", "--limit", "20", "--managers", "2", "--index", "python",
                             "--routers", "kv,round_robin"])) == 0
    assert drawn == [(20, "kv router", None), (20, "round_robin router", None)]
    drawn.clear()
    assert run(p.parse_args(["--trace", "synthetic", "--limit", "20", "--managers", "2", "--index", "python",
                             "--routers", "kv", "--no-progress"])) == 0
    assert drawn == [(20, "kv router", False)]


def test_storage_for_run_gives_each_replay_an_empty_place(tmp_path):
    from urllib.parse import parse_qsl, urlsplit

    from radixkv.bench.cluster_procs import storage_for_run

    url = storage_for_run(f"file://{tmp_path}/s", "r1")
    assert url == f"file://{tmp_path}/s/r1" and (tmp_path / "s" / "r1").is_dir()
    moon = storage_for_run("mooncake://127.0.0.1:5/?metadata=http://127.0.0.1:6/metadata&prefix=x/", "r-2")
    q = dict(parse_qsl(urlsplit(moon).query))
    assert q == {"metadata": "http://127.0.0.1:6/metadata", "prefix": "x/r-2/"} and moon.startswith("mooncake://127.0.0.1:5/?")
    assert dict(parse_qsl(urlsplit(storage_for_run("mooncake://h:5", "t")).query)) == {"prefix": "radixkv/t/"}
    for bad_url, tag in (("s3://b/k", "t"), ("file:///x", "../up"), ("file:///x", "")):
        with pytest.raises(InvalidArgumentError):
            storage_for_run(bad_url, tag)


def _pages_under(path) -> int:
    return sum(len([f for f in files if f.endswith(".page")]) for _, _, files in os.walk(path))


def test_a_page_one_manager_computed_is_a_storage_hit_for_another(tmp_path):
    from radixkv.bench.cluster_procs import storage_for_run

    url = storage_for_run(f"file://{tmp_path}", "one")
    extra = ["--host-kv-tokens", "1024", "--storage", url, "--storage-timeout-ms", "10000"]
    prompt = np.arange(3 * PAGE, dtype=np.int32)
    with ManagerProcesses(2, 1024, PAGE, extra_args=extra, start_timeout_s=600, stop_timeout_s=600) as procs:
        a, b = procs.managers
        assert a.serve(prompt) == 0 and (a.host_tokens, a.storage_tokens) == (0, 0)
        deadline = time.monotonic() + 60  # a bound on the background backup, never a timing check
        while _pages_under(tmp_path / "one") < 3:
            assert time.monotonic() < deadline, "manager A never backed its 3 pages up"
            time.sleep(0.05)
        assert b.serve(np.append(prompt, 7).astype(np.int32)) == 3 * PAGE
        assert b.host_tokens == b.storage_tokens == 3 * PAGE
        got = replay_on(procs.managers, [np.append(prompt, 8).astype(np.int32)], 1024, PAGE, "round_robin")
        assert (got.hit_tokens, got.host_hit_tokens, got.storage_hit_tokens) == (3 * PAGE, 0, 0)  # A's device
        assert got.managers[0]["storage_hit_tokens"] == 0


def test_cli_with_a_shared_file_store_reports_it_beside_the_single_cache_bound(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "r.json"
    store = tmp_path / "store"
    args = ["--trace", "conversation", "--limit", "40", "--managers", "2", "--index", "python",
            "--capacity-frac", "0.02", "--router", "kv_bounded,round_robin", "--json", str(out), "--no-progress"]
    assert run(p.parse_args([*args, "--storage", f"file://{store}"])) == 2  # inproc managers have no store
    assert "--managers-mode process" in capsys.readouterr().err
    assert run(p.parse_args([*args, "--managers-mode", "process", "--storage", f"file://{store}"])) == 0
    doc = json.loads(out.read_text())
    assert doc["host_capacity_tokens_each"] == doc["capacity_tokens_each"] > 0
    bound = doc["single_cache_bound"]["hit_rate"]
    assert [r["router"] for r in doc["results_with_storage"]] == ["kv_bounded", "round_robin"]
    for plain, shared in zip(doc["results"], doc["results_with_storage"], strict=True):
        assert plain["storage_hit_tokens"] == 0 and plain["requests"] == shared["requests"] == 40
        assert plain["hit_rate"] <= bound and shared["hit_rate"] <= bound
        assert shared["storage_hit_tokens"] <= shared["host_hit_tokens"] <= shared["hit_tokens"]
        assert shared["points_below_bound"] == pytest.approx(100 * (bound - shared["hit_rate"]))
    assert len(os.listdir(store)) == 2  # one empty place per router's replay
    assert _pages_under(store) > 0
