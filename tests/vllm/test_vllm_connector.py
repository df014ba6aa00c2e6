"""Two vLLM engines share one radixkv manager through ``RadixKVConnector``: token equality.

Engines (started once, in parallel, each in its own spawned process): ``ref`` has no cache at
all (no connector, vLLM prefix caching off), ``a`` and ``b`` use the connector (vLLM prefix
caching off, so every reuse comes through the manager). ``a``'s engine core runs its own loop
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``, as in ``vllm serve``), so its misses take the deferred
save (answered with no round trip, saved after the request); ``b`` is an in-process ``LLM``
and asks the manager for every request. A tiny Llama with random fp32 weights
is made at test time (nothing downloaded). The manager is started only after the engines:
they start without it and connect when it comes up.

For every scenario B's greedy tokens must equal ``ref``'s, and the reuse must show in vLLM's
own counters: ``RequestOutput.num_cached_tokens`` and ``vllm:external_prefix_cache_hits``.
"""
import os

import pytest
from tooling.vllm_cluster import connector_config, make_manager, running, settled, tiny_llama, tokens, wait_for_sessions
from tooling.vllm_cluster import holds as holds_in
from vllm_harness import EngineProcess

BLOCK = 32
POOL_TOKENS = 512  # the manager's KV pool: 16 blocks
MAX_TOKENS = 16
NAMESPACE = "tiny-llama"
OWN_LOOP = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-radixkv")
    model = tiny_llama(root, kv_heads=1)
    manager = make_manager(root, ["--model-config", model, "--page-size", str(BLOCK), "--kv-tokens",
                                  str(POOL_TOKENS), "--max-context-len", "1024", "--lease-ttl-s", "30",
                                  "--enable-kv-events"])
    evict_flag = str(root / "evict-now")
    common = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=BLOCK,
                  max_model_len=1024, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False,
                  distributed_executor_backend="uni", disable_log_stats=False, seed=0)
    ktc = connector_config(manager, NAMESPACE)
    engines = {
        "ref": EngineProcess("ref", common),
        "a": EngineProcess("a", {**common, "kv_transfer_config": ktc}, env=OWN_LOOP),
        "b": EngineProcess("b", {**common, "kv_transfer_config": {
            **ktc, "kv_connector": "EvictingRadixKVConnector", "kv_connector_module_path": "vllm_test_connector",
            "kv_connector_extra_config": dict(ktc["kv_connector_extra_config"])}},
            env={"RADIXKV_TEST_EVICT_FLAG": evict_flag}),
    }
    with running(engines, manager, start_manager=True):  # the manager after the engines: they start without it
        yield {**engines, "manager": manager, "evict_flag": evict_flag}


def holds(manager, prompt, n):
    holds_in(manager, prompt, n, NAMESPACE)


def run(engine, prompt):
    [(out, cached)] = engine.generate([prompt], MAX_TOKENS)
    return out, cached


def ext_hits(engine):
    return engine.metrics().get("vllm:external_prefix_cache_hits", 0)


def check_b(cluster, prompt, want_cached, populate=None):
    """A runs ``populate`` (default: ``prompt``), then B runs ``prompt``: B's tokens equal
    ref's and vLLM counted ``want_cached`` tokens from the connector."""
    ref_out, ref_cached = run(cluster["ref"], prompt)
    assert ref_cached == 0
    a_out, _ = run(cluster["a"], populate if populate is not None else prompt)
    if populate is None:  # A computed it, or loaded what B or A saved before
        assert a_out == ref_out
    holds(cluster["manager"], prompt, want_cached)
    settled(cluster["manager"])
    before = ext_hits(cluster["b"])
    out, cached = run(cluster["b"], prompt)
    assert out == ref_out
    assert cached == want_cached
    assert ext_hits(cluster["b"]) - before == want_cached
    return out


def test_full_prefix_hit_from_a_equals_no_cache(cluster):
    p = tokens(1, 100)
    # the model depends on the prefix (else a wrong load could go unseen)
    variant = [p[0] + 1] + p[1:]
    assert run(cluster["ref"], variant)[0] != run(cluster["ref"], p)[0]
    check_b(cluster, p, 96)  # 3 whole blocks (at most n - 1 tokens are reused)
    check_b(cluster, p[:96] + tokens(2, 40), 96, populate=p)  # A's blocks, then a new tail


def test_partial_hit_diverging_inside_a_block(cluster):
    base = tokens(3, 100)
    q = base[:80] + tokens(4, 50)  # diverges at token 80, inside block 2
    check_b(cluster, q, 64, populate=base)


def test_hit_shorter_than_one_block_is_no_hit(cluster):
    base = tokens(5, 100)
    check_b(cluster, base[:20] + tokens(6, 70), 0, populate=base)


def test_prompt_longer_than_the_manager_pool(cluster):
    long = tokens(7, POOL_TOKENS + 150)
    check_b(cluster, long, 0)
    # and the cache still works afterwards
    check_b(cluster, tokens(8, 70), 64)


def test_eviction_between_match_and_load(cluster):
    flag = cluster["evict_flag"]
    with open(flag, "w"):
        pass
    try:
        run(cluster["a"], tokens(12, 70))  # something unlocked to evict
        before = cluster["manager"].client().stats().evicted_tokens
        check_b(cluster, tokens(9, 130), 128)
        with open(flag) as f:
            lines = f.read().split()
        assert lines, "B did not evict between match and load"
        assert cluster["manager"].client().stats().evicted_tokens > before
    finally:
        os.unlink(flag)


def test_manager_killed_and_restarted_between_requests(cluster):
    mgr = cluster["manager"]
    p = tokens(10, 100)
    check_b(cluster, p, 96)
    mgr.kill()
    ref_out, _ = run(cluster["ref"], p)
    for name in ("a", "b"):  # both serve without the manager: same tokens, nothing reused
        assert run(cluster[name], p) == (ref_out, 0)
    mgr.start()
    wait_for_sessions(mgr, 2)
    assert run(cluster["b"], p) == (ref_out, 0)  # the new manager is empty
    check_b(cluster, tokens(11, 100), 96)  # and shared again
    stats = settled(mgr)
    assert stats.requests == 0 and stats.kv_protected == 0  # nothing left locked
