"""Two vLLM instances, each on its own radixkv manager, one Mooncake Store: token equality.

A ``mooncake_master`` on free loopback ports (started here); managers ``A`` and ``B``, each
a ``radixkv serve`` process with its own device pool and host tier and ``--storage
mooncake://...`` on that master (two processes here, two nodes in production). Engines
(started once, in parallel, spawned): ``ref`` without any cache, ``e1`` attached to A, ``e2``
to B (vLLM prefix caching off: every reuse comes through a manager). A tiny Llama with random
fp32 weights is made at test time.

What ``e1`` computes through A, A backs up to the store; ``e2`` repeating it gets exactly the
whole-block tokens vLLM may reuse, which B loads storage -> host -> device rows (its
Prometheus tier counters say so), and greedy tokens equal to ``ref``'s. Without Mooncake in
this interpreter the module skips, naming what to install. Waits are bounded, never timed.
"""
import re
import time
import urllib.request

import pytest
from process_group import members
from tooling.mooncake_master import MooncakeMaster, free_port, mooncake_missing
from tooling.vllm_cluster import connector_config, holds, make_manager, settled, tiny_llama, tokens, wait_for_sessions
from vllm_harness import EngineProcess

BLOCK = 32
POOL_TOKENS = 512  # each manager's device pool and host tier: 16 blocks each
MAX_TOKENS = 16
NAMESPACE = "tiny-llama"  # the same on both managers: the store's keys include it
WAIT_S = 60.0  # the most a wait for the store takes (a bound, never a pass/fail timing)


def _metrics(port):
    """Manager counters of its Prometheus endpoint: ``name{label="value"}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'^(radixkv_(?:tier_hit_tokens|tier_pages|storage_pages)_total'
                                                   r'\{\w+="\w+"\}) (\S+)$', text, re.M)}


def _grown(before, after, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


STORAGE_HITS = 'radixkv_tier_hit_tokens_total{tier="storage"}'
FETCHED = 'radixkv_storage_pages_total{outcome="fetched"}'
LOADED = 'radixkv_tier_pages_total{move="loaded"}'
WRITTEN = 'radixkv_storage_pages_total{outcome="written"}'


def _wait(what, cond):
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = mooncake_missing()
    if why is not None:
        pytest.skip(why)
    master, managers, engines = MooncakeMaster(), {}, {}
    try:
        master.start()
        url = master.url(segment_bytes="32MiB", buffer_bytes="16MiB", retry_max_ms="500")
        model = tiny_llama(tmp_path_factory.mktemp("model"), kv_heads=1)
        ports = {"a": free_port(), "b": free_port()}
        for name in ("a", "b"):
            managers[name] = make_manager(tmp_path_factory.mktemp(f"mgr-{name}"), [
                "--model-config", model, "--page-size", str(BLOCK), "--kv-tokens", str(POOL_TOKENS),
                "--host-kv-tokens", str(POOL_TOKENS), "--max-context-len", "1024", "--lease-ttl-s", "30",
                "--storage", url, "--storage-timeout-ms", "10000", "--metrics-port", str(ports[name]),
                "--sweep-interval-s", "0.1"])
        common = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                      block_size=BLOCK, max_model_len=1024, kv_cache_memory_bytes=32 << 20,
                      enable_prefix_caching=False, distributed_executor_backend="uni", disable_log_stats=False,
                      seed=0)
        # every request asks its manager (no first-block index): the index knows the manager's
        # own tree, not the store, so it would answer "no hit" for a page only the store holds
        engines["ref"] = EngineProcess("ref", common)
        for e, m in (("e1", "a"), ("e2", "b")):
            engines[e] = EngineProcess(e, {**common, "kv_transfer_config": connector_config(
                managers[m], NAMESPACE, defer_miss_saves=False)})
        for m in managers.values():
            m.start()
        for e in engines.values():
            e.wait_ready()
        for m in managers.values():
            wait_for_sessions(m, 1)
        yield {**engines, **{f"mgr_{k}": v for k, v in managers.items()}, "ports": ports}
    finally:
        for e in engines.values():
            e.stop()
        for m in managers.values():
            m.stop()
        master.stop()
        left = {name: members(e.proc.pid) for name, e in engines.items()}
        assert not any(left.values()), f"engine processes left behind after stop: {left}"


def run(engine, prompt):
    [(out, cached)] = engine.generate([prompt], MAX_TOKENS)
    return out, cached


def ext_hits(engine):
    return engine.metrics().get("vllm:external_prefix_cache_hits", 0)


def computed_on_a(cluster, prompt, pages):
    """``e1`` computes ``prompt`` through A (no hit anywhere: equal to ``ref``) and A writes its
    ``pages`` whole pages to the store; ``ref``'s tokens."""
    ref_out, ref_cached = run(cluster["ref"], prompt)
    assert ref_cached == 0
    before = _metrics(cluster["ports"]["a"])
    out, cached = run(cluster["e1"], prompt)
    assert (out, cached) == (ref_out, 0)
    holds(cluster["mgr_a"], prompt, pages * BLOCK, NAMESPACE)
    settled(cluster["mgr_a"])
    _wait(f"A writes {pages} pages to the store",
          lambda: _grown(before, _metrics(cluster["ports"]["a"]), WRITTEN) >= pages)
    return ref_out


def on_b_from_store(cluster, prompt, want_cached):
    """``e2`` runs ``prompt`` through B: ``ref``'s tokens, ``want_cached`` tokens reused, all
    of them loaded by B from the store through its host tier into device rows."""
    ref_out, _ = run(cluster["ref"], prompt)
    port = cluster["ports"]["b"]
    before, hits = _metrics(port), ext_hits(cluster["e2"])
    out, cached = run(cluster["e2"], prompt)
    assert out == ref_out
    assert cached == want_cached
    assert ext_hits(cluster["e2"]) - hits == want_cached
    settled(cluster["mgr_b"])
    _wait("B's counters show the loads", lambda: _grown(before, _metrics(port), LOADED) >= want_cached // BLOCK)
    after = _metrics(port)
    assert _grown(before, after, STORAGE_HITS) == want_cached
    assert _grown(before, after, FETCHED) == want_cached // BLOCK
    assert _grown(before, after, LOADED) == want_cached // BLOCK


def test_prompt_computed_on_a_is_a_store_hit_on_b(cluster):
    p = tokens(1, 100)
    variant = [p[0] + 1] + p[1:]  # the output depends on the prefix (else a wrong load could go unseen)
    assert run(cluster["ref"], variant)[0] != run(cluster["ref"], p)[0]
    computed_on_a(cluster, p, 3)
    on_b_from_store(cluster, p, 96)  # 3 whole blocks (at most n - 1 tokens are reused)
    # B now holds them itself: a repeat is a hit again, none of it from the store
    before = _metrics(cluster["ports"]["b"])
    assert run(cluster["e2"], p) == (run(cluster["ref"], p)[0], 96)
    assert _grown(before, _metrics(cluster["ports"]["b"]), STORAGE_HITS) == 0


def test_prefix_diverging_inside_a_block_loads_the_blocks_before(cluster):
    base = tokens(3, 130)
    computed_on_a(cluster, base, 4)
    on_b_from_store(cluster, base[:80] + tokens(4, 50), 64)  # diverges inside block 2


def test_block_aligned_prompt_reuses_all_but_its_last_block(cluster):
    p = tokens(5, 4 * BLOCK)
    computed_on_a(cluster, p, 4)
    on_b_from_store(cluster, p, 3 * BLOCK)  # one token is always computed, so its whole block is
