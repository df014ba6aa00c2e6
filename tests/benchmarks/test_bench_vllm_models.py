"""``radixkv bench vllm --model / --tp`` without starting vLLM: the flags, what each model kind
asks of vLLM (dtype, batching limit, ranks), the KV bytes and FLOPs that choose the 8B-ratio
model (counted here from the shapes independently), the written models (where ``transformers``
is installed) and that the radixkv configuration runs every kind (where vLLM is)."""
import argparse
import json

import bench_vllm
import numpy as np
import pytest
import vllm_instance
import vllm_model
from vllm_trace import Workload

#: Llama-3-8B's published shape (config.json): what the ratio model is matched to
LLAMA3_8B = {"hidden": 4096, "inter": 14336, "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128,
             "vocab": 128256}


def _args(*argv):
    ap = argparse.ArgumentParser()
    bench_vllm.add_arguments(ap)
    return ap.parse_args(list(argv))


def _workload(n_prompts=3, length=100):
    prompts = [np.arange(length, dtype=np.int32) for _ in range(n_prompts)]
    z = np.zeros(n_prompts, dtype=np.int64)
    return Workload(prompts=prompts, session=z, turn=z, instance=z, trace_index=z, n_instances=1)


def test_flags_default_to_the_tiny_llama_at_tp_1():
    a = _args()
    assert (a.model, a.tp) == ("llama", 1)
    a = _args("--model", "granite-hybrid", "--tp", "2")
    assert (a.model, a.tp) == ("granite-hybrid", 2)
    with pytest.raises(SystemExit):
        _args("--model", "jamba")


def test_a_tp_below_one_is_a_usage_error(capsys):
    assert bench_vllm.main(["--tp", "0", "--dry-run"]) == 2
    assert "--tp 0" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(vllm_model.MODELS))
def test_instance_spec_carries_the_kinds_needs_into_vllms_arguments(name, tmp_path):
    kind = vllm_model.MODELS[name]
    spec = bench_vllm.instance_spec(_args("--model", name, "--tp", "2", "--block-size", "64"), kind,
                                    str(tmp_path), _workload())
    kw = vllm_instance.engine_kwargs(spec)
    assert kw["dtype"] == ("bfloat16" if name == "qwen3-next" else "float32")
    assert kw["tensor_parallel_size"] == 2 and kw["distributed_executor_backend"] == "mp"
    # GraniteMoeHybrid's CPU Mamba2 prefill: one block per step, or vLLM fails in mamba_mixer2
    assert (kw["max_num_batched_tokens"] == 64) == (name == "granite-hybrid")
    assert kw["max_model_len"] % 64 == 0 and kw["max_model_len"] >= 100 + 1
    assert spec["manager_kv_bytes"] == spec["manager_kv_tokens"] * kind.kv_bytes_per_token()
    assert spec.get("hybrid", False) == kind.hybrid  # the manager gets the state pool's flags


def test_tp_1_asks_for_no_parallel_executor(tmp_path):
    spec = bench_vllm.instance_spec(_args("--block-size", "32"), vllm_model.MODELS["llama"], str(tmp_path),
                                    _workload())
    kw = vllm_instance.engine_kwargs(spec)
    assert "tensor_parallel_size" not in kw and "distributed_executor_backend" not in kw


def test_kv_bytes_per_token_count_attention_layers_only():
    m = vllm_model.MODELS
    assert m["llama"].kv_bytes_per_token() == 2 * 4 * 2 * 64 * 4           # K,V x layers x heads x dim x fp32
    assert m["llama-8b-ratio"].kv_bytes_per_token() == 2 * 2 * 1 * 64 * 4
    assert m["qwen3-next"].kv_bytes_per_token() == 2 * 1 * 2 * 64 * 2      # 1 of 4 layers, bf16
    assert m["granite-hybrid"].kv_bytes_per_token() == 2 * 1 * 2 * 64 * 4  # 1 of 4 layers (head 256/4)


def test_the_ratio_model_matches_llama3_8b_flops_per_kv_byte_within_10_percent():
    s = LLAMA3_8B
    per_layer = s["hidden"] * s["head_dim"] * (2 * s["heads"] + 2 * s["kv_heads"]) + 3 * s["hidden"] * s["inter"]
    flops_8b = 2 * (s["layers"] * per_layer + s["hidden"] * s["vocab"])
    kv_8b = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 2           # bf16
    assert kv_8b == 131072
    ratio = vllm_model.MODELS["llama-8b-ratio"]
    r8b = flops_8b / kv_8b
    rt = 2 * ratio.matmul_params() / ratio.kv_bytes_per_token()
    assert abs(rt / r8b - 1) < 0.10, (rt, r8b)
    tiny = vllm_model.MODELS["llama"]
    assert 2 * tiny.matmul_params() / tiny.kv_bytes_per_token() < r8b / 50   # why the ratio model exists
    with pytest.raises(NotImplementedError):
        vllm_model.MODELS["qwen3-next"].matmul_params()


def test_the_dry_run_records_the_model_and_the_ranks(tmp_path, capsys):
    out = tmp_path / "doc.json"
    assert bench_vllm.main(["--dry-run", "--model", "qwen3-next", "--tp", "2", "--sessions", "3", "--turns", "2",
                            "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"]["name"] == "qwen3-next" and doc["model"]["tp"] == 2 and doc["model"]["hybrid"]
    assert doc["model"]["dtype"] == "bfloat16" and doc["results"] == {}
    assert doc["workload"]["block_size"] == 256                # a hybrid's default (vLLM's align mode)
    assert bench_vllm.main(["--dry-run", "--sessions", "3", "--turns", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["workload"]["block_size"] == 32


@pytest.mark.parametrize("name", ["llama-8b-ratio", "qwen3-next", "granite-hybrid"])
def test_the_written_model_has_the_kinds_shape(name, tmp_path):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    kind = vllm_model.MODELS[name]
    path = vllm_model.make_model(str(tmp_path), kind)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["dtype"] == kind.dtype
    assert {k: cfg[k] for k in kind.fields} == kind.fields
    model = AutoModelForCausalLM.from_pretrained(path)
    assert next(model.parameters()).dtype == getattr(torch, kind.dtype)
    if name == "llama-8b-ratio":
        total = sum(p.numel() for p in model.parameters() if p.dim() == 2)
        embed = kind.fields["vocab_size"] * kind.fields["hidden_size"]
        assert total - embed == kind.matmul_params()
    mtime = (tmp_path / "config.json").stat().st_mtime_ns
    vllm_model.make_model(path, kind)                       # the same kind again: not rewritten
    assert (tmp_path / "config.json").stat().st_mtime_ns == mtime


def test_the_radixkv_configuration_runs_every_kind():
    pytest.importorskip("vllm.config")  # a bare "vllm" may be tests/vllm, a namespace package
    for name, kind in vllm_model.MODELS.items():  # hybrids too: RadixKVConnector is a SupportsHMA
        assert bench_vllm.refusal("radixkv", kind) is None, name
        assert bench_vllm.refusal("local", kind) is None
