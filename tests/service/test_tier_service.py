"""The tiers at the service level (issue 31, items 4 and 5): the per-tier Prometheus metrics,
storage down at start, a worker SIGKILLed while its load is in flight, and a manager
SIGKILLed with the file tier then restarted on the same directory (warm hits; no page whose
checksum fails is served). KV is a pure function of the tokens (``service_workers.kv_of``),
so a row served after a load or a restart is checked against what was written."""
import logging
import os
import re
import signal
import time
import urllib.request

import numpy as np
import service_workers as workers
import torch
from radixkv.service.client import connect
from radixkv.service.server.manager import ServeOptions
from service_util import SPAWN, START_TIMEOUT_S, start_server, stop_server
from tooling.testing import ThreadedServer

from radixkv.cache.block_hash import encode_extra_key
from radixkv.engine.config import EngineConfig
from radixkv.engine.pools import kv_fingerprint
from radixkv.engine.protocol import ExtendItem, MatchQuery
from radixkv.storage.file import FileStorage
from radixkv.storage.keys import page_keys, storage_seed

PS = 4


def _tiers(storage_dir, **kw):
    cfg = dict(page_size=PS, kv_tokens=64, host_kv_tokens=128, request_rows=8, max_context_len=64,
               storage=f"file://{storage_dir}", storage_timeout_ms=60_000.0)
    cfg.update(kw)
    return cfg


def _drained(c):
    deadline = time.monotonic() + 60
    while (st := c.stats()).storage_pending:
        assert time.monotonic() < deadline, f"storage writes still pending: {st}"
        time.sleep(0.01)
    return st


def _write(wb, r, tokens):
    """Play the model: the KV of tokens ``start .. seq_len`` into the call's slots."""
    loc = torch.as_tensor(r.out_cache_loc)
    for layer in workers._full_layers(wb):
        k, v = workers.kv_of(tokens[r.start:r.seq_len], layer, wb.config.head_num, wb.config.head_dim)
        wb.set_kv_buffer(layer, loc, k, v)


def _check_rows(wb, r, tokens):
    """The rows of ``r``'s prefix hold exactly the KV of its tokens."""
    rows = wb.req_to_token[r.req_pool_idx, :r.prefix_len].to(torch.int64)
    for layer in workers._full_layers(wb):
        k_buf, v_buf = wb.get_kv_buffer(layer)
        k, v = workers.kv_of(tokens[:r.prefix_len], layer, wb.config.head_num, wb.config.head_dim)
        assert torch.equal(k_buf[rows], k) and torch.equal(v_buf[rows], v), f"layer {layer}"


def _cache(c, s, wb, rid, tokens):
    (r,) = c.alloc_extend(s, [ExtendItem(rid, tokens)])
    _write(wb, r, tokens)
    c.cache_finished(s, [rid])
    return r


def _metric(text, name, **labels):
    lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + lab + '}') if lab else ''} (\S+)$", text, re.M)
    assert m, f"{name} {labels} not exported"
    return float(m.group(1))


def test_tier_metrics_and_idle_check(tmp_path):
    opts = ServeOptions(metrics_port=0, check_idle=True, sweep_interval_s=0.05, grace_s=1.0)
    with ThreadedServer(_tiers(tmp_path / "pages"), options=opts) as srv:
        c = srv.client()
        info = c.attach("m")
        s, wb = info.session, c.worker_buffers(info)
        a = np.arange(100, 132, dtype=np.int32)
        _cache(c, s, wb, "a", a)
        assert c.evict(s, 64).tokens == 32  # demoted: 8 pages to the host
        q = np.concatenate([a, np.arange(5, dtype=np.int32)])
        (b,) = c.alloc_extend(s, [ExtendItem("b", q)])
        assert (b.prefix_len, b.host_len) == (32, 32)
        _check_rows(wb, b, q)
        c.release(s, ["b"])
        _drained(c)
        assert c.flush(s)
        (m,) = c.match(s, [MatchQuery(q)])
        assert (m.prefix_len, m.storage_len) == (32, 32)
        st = c.stats()
        assert (st.tier_hit_device, st.tier_hit_host, st.tier_hit_storage) == (0, 32, 32)
        assert (st.host_used, st.host_loaded_pages, st.storage_loaded_pages, st.storage_written_pages) == (32, 8, 8, 8)
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=30).read().decode()
        assert _metric(text, "radixkv_host_tier_tokens", state="capacity") == 128
        assert _metric(text, "radixkv_host_tier_tokens", state="used") == 32  # a's pages, read from storage
        hits = {t: _metric(text, "radixkv_tier_hit_tokens_total", tier=t) for t in ("device", "host", "storage")}
        assert hits == {"device": 0, "host": 32, "storage": 32}
        assert sum(hits.values()) == _metric(text, "radixkv_prefix_cache_hits_total")
        assert _metric(text, "radixkv_tier_pages_total", move="loaded") == 8
        assert _metric(text, "radixkv_tier_pages_total", move="demoted") == 8
        assert _metric(text, "radixkv_tier_loaded_bytes_total") == st.host_loaded_bytes > 0
        assert _metric(text, "radixkv_tier_load_seconds_total") > 0
        assert _metric(text, "radixkv_storage_read_bytes_total") == st.storage_loaded_bytes == st.host_loaded_bytes
        assert _metric(text, "radixkv_storage_read_seconds_total") > 0
        for outcome, want in (("written", 8), ("fetched", 8), ("write_failed", 0), ("backup_dropped", 0)):
            assert _metric(text, "radixkv_storage_pages_total", outcome=outcome) == want
        assert _metric(text, "radixkv_storage_errors_total") == 0
        assert _metric(text, "radixkv_storage_fetch_timeouts_total") == 0
        assert _metric(text, "radixkv_storage_queue_pages") == 0
        types = {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE")}
        assert all(name.endswith("_total") for name, kind in types.items() if kind == "counter"), types
        # the idle check covered both tiers at every sweep since: none failed, and it runs now
        time.sleep(0.3)  # a few sweeps; the assertion below does not depend on how many ran
        assert srv.call(lambda server: list(server.servicer.idle_failures)) == []
        c.check_invariants()
        c.detach(s)


def test_stats_tier_fields_read_the_tier_counters(tmp_path):
    """EngineStats' tier fields (what travels to a remote client) read the tree's counters
    (the metrics' source) one for one: each counter set to a distinct value."""
    from radixkv.engine import CacheEngine

    eng = CacheEngine(EngineConfig(**_tiers(tmp_path / "pages")))
    try:
        t = {k: 1000 + i for i, k in enumerate(eng.tier_stats())}
        eng.tree.tier_counters = lambda: t
        st = eng.stats()
        pb = t["page_bytes"]
        assert (st.host_capacity, st.host_used, st.host_available) == (
            t["host_capacity_tokens"], t["host_used_tokens"], t["host_capacity_tokens"] - t["host_used_tokens"])
        assert (st.tier_hit_device, st.tier_hit_host, st.tier_hit_storage) == (
            t["hit_tokens_device"], t["hit_tokens_host"], t["hit_tokens_storage"])
        assert (st.host_loaded_pages, st.host_loaded_bytes, st.host_load_us) == (
            t["loaded_pages"], t["loaded_pages"] * pb, t["load_ns"] // 1000)
        assert (st.host_demoted_pages, st.host_dropped_pages) == (t["demoted_pages"], t["host_dropped_pages"])
        assert (st.storage_loaded_pages, st.storage_loaded_bytes, st.storage_load_us) == (
            t["storage_fetched"], t["storage_fetched"] * pb, t["storage_wait_us"])
        assert (st.storage_written_pages, st.storage_write_failed, st.storage_backup_dropped,
                st.storage_fetch_timeouts, st.storage_errors, st.storage_pending) == tuple(
            t[f"storage_{k}"] for k in ("written", "write_failed", "backup_dropped", "fetch_timeouts", "errors",
                                        "pending"))
    finally:
        eng.close()


def test_no_tier_families_with_the_tiers_off():
    with ThreadedServer({"kv_tokens": 64}, options=ServeOptions(metrics_port=0, grace_s=1.0)) as srv:
        srv.client().stats()
        text = srv.server.metrics.exposition().decode()
        assert "radixkv_tier_" not in text and "radixkv_storage_" not in text
        assert "radixkv_prefix_cache_hits_total 0.0" in text


def test_storage_down_at_start_runs_on_device_and_host(tmp_path, caplog):
    """The storage directory cannot be created (its parent is a file): the manager starts,
    warns once, serves from the device and host tiers, and counts every failed write."""
    (tmp_path / "afile").write_bytes(b"x")
    caplog.set_level(logging.WARNING)
    with ThreadedServer(_tiers(tmp_path / "afile" / "pages")) as srv:
        c = srv.client()
        info = c.attach("down")
        s, wb = info.session, c.worker_buffers(info)
        for i in range(3):
            tokens = np.arange(200 * i, 200 * i + 32, dtype=np.int32)
            _cache(c, s, wb, f"p{i}", tokens)
            assert c.evict(s, 64).tokens >= 32  # this prompt, and the one loaded back before
            (r,) = c.alloc_extend(s, [ExtendItem(f"q{i}", np.append(tokens, np.int32(1)))])
            assert (r.prefix_len, r.host_len, r.storage_len) == (32, 32, 0)  # the host tier serves
            _check_rows(wb, r, tokens)
            c.release(s, [f"q{i}"])
        st = _drained(c)
        assert (st.storage_written_pages, st.storage_write_failed) == (0, 24)
        c.check_invariants()
        c.detach(s)
    warned = [r for r in caplog.records if r.name.startswith("radixkv.storage") and r.levelno >= logging.WARNING]
    assert len(warned) == 1, [r.getMessage() for r in warned]


def _serve_args(storage_dir):
    return ["--device", "cpu", "--kv-tokens", "64", "--page-size", str(PS), "--host-kv-tokens", "128",
            "--request-rows", "8", "--max-context-len", "64", "--storage", f"file://{storage_dir}",
            "--storage-timeout-ms", "60000", "--lease-ttl-s", "2.0", "--sweep-interval-s", "0.1",
            "--check-idle", "--grace-s", "2"]


def _keys(tokens):
    cfg = EngineConfig(page_size=PS, kv_tokens=64, host_kv_tokens=128)
    return page_keys(tokens, PS, storage_seed(encode_extra_key(None), kv_fingerprint(cfg)))


def test_manager_sigkill_then_restart_serves_only_sound_pages(tmp_path):
    pages = tmp_path / "pages"
    prompts = [np.arange(1000 * i + 1, 1000 * i + 33, dtype=np.int32) for i in range(3)]
    srv = start_server(_serve_args(pages))
    try:
        with connect(srv.address, token=srv.token, wait_s=START_TIMEOUT_S) as c:
            info = c.attach("before")
            s, wb = info.session, c.worker_buffers(info)
            for i, p in enumerate(prompts):
                _cache(c, s, wb, f"p{i}", p)
            assert _drained(c).storage_written_pages == 24
    finally:
        stop_server(srv, signal.SIGKILL)  # no drain, no goodbye
    files = FileStorage(pages, page_bytes=1)
    corrupt = files.path_of(_keys(prompts[1])[2])  # prompt 1: its third page flipped
    data = bytearray(corrupt.read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    truncated = files.path_of(_keys(prompts[2])[0])  # prompt 2: its first page cut short
    truncated.write_bytes(truncated.read_bytes()[:-7])
    srv = start_server(_serve_args(pages))
    try:
        with connect(srv.address, token=srv.token, wait_s=START_TIMEOUT_S) as c:
            info = c.attach("after")
            s, wb = info.session, c.worker_buffers(info)
            got = [(m.prefix_len, m.storage_len) for m in c.match(s, [MatchQuery(p) for p in prompts])]
            assert got == [(32, 32), (8, 8), (0, 0)]  # warm hits; pages from the bad one on are misses
            for i, p in enumerate(prompts[:2]):
                (r,) = c.alloc_extend(s, [ExtendItem(f"r{i}", np.append(p, np.int32(7)))])
                assert r.prefix_len == (32, 8)[i]
                _check_rows(wb, r, p)
                c.release(s, [f"r{i}"])
            c.check_invariants()
            c.detach(s)
    finally:
        assert stop_server(srv) == 0


def test_worker_killed_while_its_load_is_in_flight(tmp_path):
    """A worker asks for a prompt whose pages are on the host tier and is SIGKILLed as it
    asks: the kill lands before, during or after the manager's load, and every outcome
    leaves nothing held, the invariants (both tiers) sound and the pages cached, whole."""
    srv = start_server(_serve_args(tmp_path / "pages"))
    try:
        with connect(srv.address, token=srv.token, wait_s=START_TIMEOUT_S) as c:
            info = c.attach("main")
            s, wb = info.session, c.worker_buffers(info)
            c.start_keepalive(s, interval_s=0.2)  # the worker's start (a spawn) outlasts a 2 s lease
            p = np.arange(50, 82, dtype=np.int32)
            _cache(c, s, wb, "p", p)
            assert c.evict(s, 64).tokens == 32
            q = SPAWN.Queue()
            proc = SPAWN.Process(target=workers.loading_worker, daemon=True,
                                 args=(srv.address, srv.token, np.append(p, np.int32(3)), q))
            proc.start()
            try:
                kind, payload = q.get(timeout=START_TIMEOUT_S)
                assert kind == "loading", payload
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(30)
            finally:
                if proc.is_alive():
                    proc.kill()
                    proc.join(10)
            deadline = time.monotonic() + 30
            while (st := c.stats()).sessions > 1 or st.requests:
                assert time.monotonic() < deadline, f"the killed worker's session is still held: {st}"
                time.sleep(0.05)
            assert st.kv_held == st.kv_protected == 0, st
            c.check_invariants()
            (m,) = c.match(s, [MatchQuery(p)])
            assert m.prefix_len == 32  # on the host (the load did not run) or the device (it did)
            (r,) = c.alloc_extend(s, [ExtendItem("again", np.append(p, np.int32(3)))])
            assert r.prefix_len == 32
            _check_rows(wb, r, p)
            c.release(s, ["again"])
            c.check_invariants()
            c.detach(s)
    finally:
        assert stop_server(srv) == 0
