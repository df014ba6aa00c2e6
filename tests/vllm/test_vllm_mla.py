"""MLA (DeepSeek-V2-style, a tiny random model) through the connector: the manager's pool is
``MLATokenToKVPool`` (``--model-config`` reads kv_lora_rank + qk_rope_head_dim = 576) and the
connector loads and saves the latent rows. vLLM's CPU platform runs MLA with block size 16 and
its own prefix caching and chunked prefill off; the connector is called all the same (B loads
96 tokens), but what vLLM computes over the loaded prefix is not what it computes from scratch
(the logprobs differ), which is why the connector refuses MLA on CPU unless ``mla_on_cpu``."""
import secrets

import pytest
from tooling.vllm_cluster import (
    connector_config,
    holds,
    make_manager,
    running,
    settled,
    tiny_deepseek_v2,
    tokens,
)
from vllm_harness import EngineProcess

BLOCK = 16  # vLLM's CPU MLA kernel takes no other
MAX_TOKENS = 16
NAMESPACE = "tiny-deepseek-v2"


@pytest.fixture(scope="module")
def mla_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-radixkv-mla")
    model = tiny_deepseek_v2(root)
    manager = make_manager(root, ["--model-config", model, "--page-size", str(BLOCK), "--kv-tokens", "1024",
                                  "--max-context-len", "512", "--lease-ttl-s", "60"])
    manager.start()
    common = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=BLOCK,
                  max_model_len=512, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
                  distributed_executor_backend="uni", disable_log_stats=False, seed=0,
                  kv_transfer_config=connector_config(manager, NAMESPACE, mla_on_cpu=True))
    engines = {"a": EngineProcess("a", common), "b": EngineProcess("b", common)}
    with running(engines, manager):
        yield {**engines, "manager": manager}


def run(engine, prompt, salt=None):
    [(out, cached, logprobs)] = engine.generate([prompt], MAX_TOKENS, salt=salt, logprobs=True)
    return out, cached, logprobs


def test_b_loads_the_latents_a_computed_but_vllm_cpu_computes_other_logprobs(mla_cluster):
    p = tokens(31, 100)
    ref, cached, ref_lp = run(mla_cluster["b"], p, salt=secrets.token_hex(8))  # no cache: computed
    assert cached == 0
    out, cached, _ = run(mla_cluster["a"], p)
    assert cached == 0
    holds(mla_cluster["manager"], p, 96, NAMESPACE)
    settled(mla_cluster["manager"])
    before = mla_cluster["b"].metrics().get("vllm:external_prefix_cache_hits", 0)
    out_b, cached_b, lp = run(mla_cluster["b"], p)
    assert cached_b == 96  # the connector was asked, matched and loaded 6 blocks of 16
    assert mla_cluster["b"].metrics().get("vllm:external_prefix_cache_hits", 0) - before == 96
    diff = max(abs(x - y) for x, y in zip(lp, ref_lp, strict=True))
    # The day vLLM's CPU MLA computes over a loaded prefix what it computes from scratch, this
    # fails: then MLA can be shared on CPU as on GPU (drop the refusal, MLA_ON_CPU).
    assert diff > 1e-3, f"vLLM's CPU MLA now reproduces a computed prefix (max logprob difference {diff})"
