"""``radixkv bench vllm --model`` for the hybrid kinds, one short real run each (2 instances, 3
sessions x 2 turns, about 1.5 minutes at load ~6): vLLM runs them with the kind's settings
(bf16 Qwen3-Next; GraniteMoeHybrid one block per step) at the block size it raised, every prompt
token is either computed or a hit by vLLM's own count; per-instance caching stays within the
per-instance bound at that block size, and radixkv (attention KV + states through the manager)
within the shared bound, its external hits counted by vLLM."""
import json

import bench_vllm
import pytest


@pytest.mark.parametrize("model", ["qwen3-next", "granite-hybrid"])
def test_a_hybrid_model_runs_local_and_radixkv(model, tmp_path):
    out = tmp_path / "doc.json"
    argv = ["--model", model, "--configs", "local,radixkv", "--sessions", "3", "--turns", "2", "--cold", "1",
            "--model-dir", str(tmp_path / "model"), "--json", str(out)]
    assert bench_vllm.main(argv) == 0
    doc = json.loads(out.read_text())
    assert not doc.get("refused") and not doc.get("failed")
    shared = doc["results"]["radixkv"]
    assert shared["prefill_tokens"] + shared["hit_tokens"] == shared["prompt_tokens"]
    assert shared["hit_tokens"] <= shared["bound_shared_hit_tokens"]
    assert all(x["cached"] % shared["engine_block_size"] == 0 for x in shared["per_request"])
    r = doc["results"]["local"]
    assert r["engine_block_size"] >= doc["workload"]["block_size"]
    assert r["prefill_tokens"] + r["hit_tokens"] == r["prompt_tokens"] == doc["workload"]["prompt_tokens"]
    # each instance reuses only what it computed, in whole blocks of the engine's size
    assert r["hit_tokens"] <= r["bound_per_instance_hit_tokens"]
    assert all(x["cached"] % r["engine_block_size"] == 0 for x in r["per_request"])
    c = r["vllm_counters_trace"]
    assert c.get("vllm:prompt_tokens_by_source[local_compute]", r["prefill_tokens"]) == r["prefill_tokens"]
    assert c.get("vllm:prompt_tokens_by_source[external_kv_transfer]", 0) == 0
