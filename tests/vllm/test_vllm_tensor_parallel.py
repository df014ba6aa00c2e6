"""Tensor-parallel engines share one radixkv manager: an engine at TP=2 reuses what an engine at
TP=1 computed, and back, token for token.

The manager's rows hold every KV head; each rank's worker copies its own heads (a tiny Llama
with 2 KV heads: one per rank at TP=2). Two engines with the connector (vLLM prefix caching
off, so every reuse comes through the manager): ``tp1`` (executor ``uni``) and ``tp2``
(``tensor_parallel_size=2``, executor ``mp``). A no-cache run is the same engine with a fresh
``cache_salt`` (a namespace nobody wrote: everything computed). The reuse must show in vLLM's
own counters: ``RequestOutput.num_cached_tokens`` and ``vllm:external_prefix_cache_hits``.
"""
import secrets

import pytest
from tooling.vllm_cluster import connector_config, holds, make_manager, running, settled, tiny_llama, tokens
from vllm_harness import EngineProcess

BLOCK = 32
MAX_TOKENS = 16
NAMESPACE = "tiny-llama-kv2"


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-radixkv-tp")
    model = tiny_llama(root, kv_heads=2)
    manager = make_manager(root, ["--model-config", model, "--page-size", str(BLOCK), "--kv-tokens", "2048",
                                  "--max-context-len", "1024", "--lease-ttl-s", "60"])
    manager.start()
    common = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=BLOCK,
                  max_model_len=1024, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False,
                  disable_log_stats=False, seed=0, kv_transfer_config=connector_config(manager, NAMESPACE))
    engines = {
        "tp1": EngineProcess("tp1", {**common, "distributed_executor_backend": "uni"}),
        "tp2": EngineProcess("tp2", {**common, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                             # the ranks share the machine's cores (vLLM's auto binding wants a NUMA node per rank)
                             env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}),
    }
    with running(engines, manager):
        yield {**engines, "manager": manager}


def run(engine, prompt, salt=None):
    [(out, cached)] = engine.generate([prompt], MAX_TOKENS, salt=salt)
    return out, cached


def no_cache(engine, prompt):
    """The engine's tokens for ``prompt`` with nothing reused (a fresh ``cache_salt``)."""
    out, cached = run(engine, prompt, salt=secrets.token_hex(8))
    assert cached == 0
    return out


def ext_hits(engine):
    return engine.metrics().get("vllm:external_prefix_cache_hits", 0)


def reuse(cluster, src, dst, prompt, want, populate=None):
    """``src`` runs ``populate`` (default: ``prompt``, computed from scratch), then ``dst``
    runs ``prompt``: its tokens equal its no-cache run's, with ``want`` tokens reused."""
    ref = no_cache(cluster[dst], prompt)
    out, cached = run(cluster[src], populate if populate is not None else prompt)
    if populate is None:
        assert cached == 0 and out == no_cache(cluster[src], prompt)
    holds(cluster["manager"], prompt, want, NAMESPACE)
    settled(cluster["manager"])
    before = ext_hits(cluster[dst])
    out, cached = run(cluster[dst], prompt)
    assert out == ref
    assert cached == want
    assert ext_hits(cluster[dst]) - before == want


def test_tp2_reuses_what_tp1_computed(tp_cluster):
    p = tokens(21, 100)
    # the model depends on the prefix (else a wrong head's load could go unseen), and TP=1 and
    # TP=2 compute the same tokens
    assert no_cache(tp_cluster["tp2"], [p[0] + 1] + p[1:]) != no_cache(tp_cluster["tp2"], p)
    assert no_cache(tp_cluster["tp1"], p) == no_cache(tp_cluster["tp2"], p)
    reuse(tp_cluster, "tp1", "tp2", p, 96)  # 3 whole blocks (at most n - 1 tokens are reused)


def test_tp1_reuses_what_tp2_computed(tp_cluster):
    reuse(tp_cluster, "tp2", "tp1", tokens(22, 130), 128)
    base = tokens(23, 100)
    reuse(tp_cluster, "tp2", "tp1", base[:80] + tokens(24, 50), 64, populate=base)  # diverges inside block 2
    stats = settled(tp_cluster["manager"])
    assert stats.requests == 0 and stats.kv_protected == 0  # nothing left locked
