"""``--model-config``: a Hugging Face config.json -> the manager's KV shape."""
import json

import pytest

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
    {"hybrid_override_pattern": "M-M*"},
    {"kv_lora_rank": 512},
])
def test_hybrid_and_mla_models_are_refused(extra):
    with pytest.raises(InvalidArgumentError):
        kv_shape_from_hf_config({**LLAMA, **extra})


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
