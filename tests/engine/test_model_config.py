"""``--model-config``: a Hugging Face config.json -> the manager's KV shape."""
import json

import pytest
import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.model_config import engine_fields_from_model_dir, kv_shape_from_hf_config
from radixkv.errors import InvalidArgumentError

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "hidden_size": 256, "dtype": "bfloat16"}


def test_llama_gqa_shape():
    assert kv_shape_from_hf_config(LLAMA) == {"layer_types": "FFF", "head_num": 2, "head_dim": 64,
                                              "kv_dtype": "bfloat16"}


def test_defaults_explicit_head_dim_and_old_dtype_key():
    cfg = {"num_hidden_layers": 1, "num_attention_heads": 2, "hidden_size": 100, "head_dim": 64,
           "torch_dtype": "float16"}
    assert kv_shape_from_hf_config(cfg) == {"layer_types": "F", "head_num": 2, "head_dim": 64, "kv_dtype": "float16"}
    no_dtype = {k: v for k, v in LLAMA.items() if k != "dtype"}
    assert kv_shape_from_hf_config(no_dtype)["kv_dtype"] == "float32"


def test_multimodal_text_config_is_read():
    cfg = {"architectures": ["X"], "text_config": {k: v for k, v in LLAMA.items() if k != "dtype"},
           "torch_dtype": "bfloat16"}
    assert kv_shape_from_hf_config(cfg) == kv_shape_from_hf_config(LLAMA)


@pytest.mark.parametrize("extra", [
    {"layer_types": ["full_attention", "linear_attention", "full_attention"]},
    {"layers_block_type": ["attention", "mamba", "attention"]},
    {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
    {"layer_types": ["full_attention", "linear_attention"]},  # 2 types for 3 layers
    {"layer_types": ["full_attention", "linear_attention", "full_attention"], "kv_lora_rank": 512,
     "qk_rope_head_dim": 64, "linear_num_value_heads": 4},
    {"hybrid_override_pattern": "M-M*"},
    {"kv_lora_rank": 512},  # MLA without qk_rope_head_dim
])
def test_hybrid_and_incomplete_mla_models_are_refused(extra):
    with pytest.raises(InvalidArgumentError):
        kv_shape_from_hf_config({**LLAMA, **extra})


DEEPSEEK_V2 = {"architectures": ["DeepseekV2ForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 4, "hidden_size": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "qk_nope_head_dim": 32, "v_head_dim": 32, "dtype": "float32"}


def test_mla_model_gives_an_mla_pool_of_one_latent_head():
    fields = kv_shape_from_hf_config(DEEPSEEK_V2)
    assert fields == {"layer_types": "FF", "head_num": 1, "head_dim": 576, "kv_dtype": "float32",
                      "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    cfg = EngineConfig(page_size=16, kv_tokens=64, **fields)
    assert cfg.is_mla and not EngineConfig().is_mla


@pytest.mark.parametrize("bad", [{"num_hidden_layers": 0}, {"num_attention_heads": "4"},
                                 {"hidden_size": 250}, {"dtype": "int8"}])
def test_bad_values_name_the_key(bad):
    with pytest.raises(InvalidArgumentError):
        kv_shape_from_hf_config({**LLAMA, **bad})


def test_model_dir_and_serve_flag(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert engine_fields_from_model_dir(tmp_path)["head_num"] == 2
    with pytest.raises(InvalidArgumentError):
        engine_fields_from_model_dir(tmp_path / "missing")
    import argparse

    from radixkv.service.server.cli import add_serve_arguments, engine_config_from_args

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--model-config", str(tmp_path), "--page-size", "16", "--kv-tokens", "1024", "--kv-dtype", "float32"])
    cfg = engine_config_from_args(args)
    assert isinstance(cfg, EngineConfig)
    assert (cfg.layer_types, cfg.head_num, cfg.head_dim, cfg.page_size, cfg.kv_dtype) == ("FFF", 2, 64, 16, "float32")


# The tiny hybrids of ``radixkv bench vllm --model`` (benchmarks/vllm_model.py). vLLM 0.32.0's CPU
# build allocates for them (MambaSpec of each recurrent layer, seen in ``register_kv_caches``'s
# kv_cache_config; tests/vllm/test_vllm_hybrid.py checks it against vLLM): Qwen3-Next conv (3, 512)
# bf16 and temporal (4, 64, 64) (bf16, or float32 where the CPU has AVX512-BF16); GraniteMoeHybrid
# conv (3, 640) and temporal (8, 64, 64), both float32.
QWEN3_NEXT = {"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "hidden_size": 256, "dtype": "bfloat16",
              "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
              "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_num_key_heads": 2,
              "linear_num_value_heads": 4}
GRANITE_HYBRID = {"model_type": "granitemoehybrid", "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "hidden_size": 256, "dtype": "float32",
                  "layer_types": ["linear_attention"] * 3 + ["full_attention"], "mamba_n_heads": 8,
                  "mamba_d_head": 64, "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2}


@pytest.mark.parametrize("cfg,conv,temporal", [(QWEN3_NEXT, (3, 512), (4, 64, 64)),
                                               (GRANITE_HYBRID, (3, 640), (8, 64, 64))])
def test_hybrid_models_give_the_state_shapes_vllm_allocates(cfg, conv, temporal):
    fields = kv_shape_from_hf_config(cfg)
    assert fields == {"layer_types": "KKKF", "head_num": 2, "head_dim": 64, "kv_dtype": cfg["dtype"],
                      "conv_state_dims": conv, "temporal_state_dims": temporal, "state_dtype": cfg["dtype"]}
    ec = EngineConfig(page_size=256, kv_tokens=1024, state_slots=4, **fields)
    assert (ec.conv_state_shape, ec.temporal_state_shape, ec.temporal_dtype) == (conv, temporal, cfg["dtype"])
    assert ec.is_hybrid and ec.kda_layer_ids == (0, 1, 2) and ec.full_layer_ids == (3,)
    assert EngineConfig.from_dict(json.loads(json.dumps(ec.to_dict()))) == ec
    from radixkv.engine.layout import build_mamba_pool

    pool = build_mamba_pool(ec.replace(temporal_state_dtype="float32"))
    assert tuple(pool.conv_state.shape) == (3, 5) + conv and str(pool.conv_state.dtype) == f"torch.{cfg['dtype']}"
    assert tuple(pool.temporal_state.shape) == (3, 5) + temporal and pool.temporal_state.dtype == torch.float32


@pytest.mark.parametrize("bad", [{"conv_state_dims": (3, 512)},
                                 {"conv_state_dims": (3, 0), "temporal_state_dims": (1,)},
                                 {"conv_state_dims": "3,512", "temporal_state_dims": (1,)},
                                 {"temporal_state_dtype": "int8"}])
def test_bad_state_dims_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        EngineConfig(layer_types="KF", **bad)


def test_hybrid_serve_flags_override_the_state(tmp_path):
    import argparse

    from radixkv.service.server.cli import add_serve_arguments, engine_config_from_args

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT))
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        ["--model-config", str(tmp_path), "--page-size", "256", "--kv-tokens", "1024",
         "--temporal-state-dtype", "float32", "--conv-state-dims", "3,600"])
    cfg = engine_config_from_args(args)
    assert (cfg.layer_types, cfg.conv_state_shape, cfg.temporal_state_shape) == ("KKKF", (3, 600), (4, 64, 64))
    assert (cfg.state_dtype, cfg.temporal_dtype) == ("bfloat16", "float32")
