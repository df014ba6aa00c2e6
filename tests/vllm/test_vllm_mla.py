"""MLA (DeepSeek-V2-style, a tiny random model) through the connector: the manager's pool is
``MLATokenToKVPool`` (``--model-config`` reads kv_lora_rank + qk_rope_head_dim = 576) and the
connector loads and saves the latent rows. vLLM's CPU platform runs MLA with block size 16 and
its own prefix caching and chunked prefill off; the connector is called all the same."""
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
                  kv_transfer_config=connector_config(manager, NAMESPACE))
    engines = {"a": EngineProcess("a", common), "b": EngineProcess("b", common)}
    with running(engines, manager):
        yield {**engines, "manager": manager}


def run(engine, prompt, salt=None):
    [(out, cached)] = engine.generate([prompt], MAX_TOKENS, salt=salt)
    return out, cached


def test_b_reuses_the_latents_a_computed(mla_cluster):
    p = tokens(31, 100)
    ref, cached = run(mla_cluster["b"], p, salt=secrets.token_hex(8))
    assert cached == 0
    out, cached = run(mla_cluster["a"], p)
    assert cached == 0
    holds(mla_cluster["manager"], p, 96, NAMESPACE)
    settled(mla_cluster["manager"])
    out_b, cached_b = run(mla_cluster["b"], p)
    assert cached_b == 96
    assert out_b == ref
