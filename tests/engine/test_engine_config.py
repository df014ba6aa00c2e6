"""EngineConfig: defaults, validation naming the field, plain-data and file round trips."""
import json

import pytest

from radixkv.engine.config import ADMISSION_POLICIES, EngineConfig
from radixkv.errors import InvalidArgumentError


def test_defaults_start_a_small_kv_only_engine():
    c = EngineConfig()
    assert c.device == "cpu" and c.layer_types == "FF" and not c.is_hybrid
    assert c.full_layer_ids == (0, 1) and c.kda_layer_ids == ()
    assert c.kv_tokens % c.page_size == 0 and c.admission_policy in ADMISSION_POLICIES


def test_hybrid_shapes():
    c = EngineConfig(layer_types="KKKF" * 2, kda_num_heads=4, kda_head_dim=8, conv_kernel=3)
    assert c.is_hybrid and c.num_layers == 8
    assert c.full_layer_ids == (3, 7) and c.kda_layer_ids == (0, 1, 2, 4, 5, 6)
    assert c.conv_state_shape == (2, 3 * 4 * 8) and c.temporal_state_shape == (4, 8, 8)


@pytest.mark.parametrize("field,value", [
    ("device", "tpu"), ("device", 0), ("device", "cuda:x"),
    ("kv_tokens", 0), ("kv_tokens", 4.0), ("kv_tokens", True), ("kv_tokens", 100),  # 100 % 16
    ("page_size", 0), ("layer_types", ""), ("layer_types", "KK"), ("layer_types", "FXF"),
    ("head_num", 0), ("head_dim", -1), ("kv_dtype", "int32"), ("kv_dtype", "nope"), ("kv_dtype", 5),
    ("conv_kernel", 1), ("kda_num_heads", 0), ("kda_head_dim", 0), ("state_dtype", "int8"),
    ("state_slots", 0), ("request_rows", 0), ("max_context_len", 0), ("eviction_policy", "random"),
    ("admission_policy", "sometimes"), ("enable_kv_events", 1), ("lease_ttl_s", 0),
    ("lease_ttl_s", float("inf")), ("lease_ttl_s", "30"), ("max_sessions", 0),
    ("max_requests_per_session", 0), ("checks", "yes"), ("kv_lora_rank", -1), ("qk_rope_head_dim", 2),
])
def test_bad_field_is_named(field, value):
    kwargs = {field: value}
    if field == "kv_tokens" and value == 100:
        kwargs["page_size"] = 16
    with pytest.raises(InvalidArgumentError, match=field):
        EngineConfig(**kwargs)


def test_mla_needs_one_latent_head_of_the_latent_width():
    c = EngineConfig(head_num=1, head_dim=576, kv_lora_rank=512, qk_rope_head_dim=64)
    assert c.is_mla and EngineConfig.from_dict(c.to_dict()) == c
    with pytest.raises(InvalidArgumentError, match="head_num 2, head_dim 576"):
        EngineConfig(head_num=2, head_dim=576, kv_lora_rank=512, qk_rope_head_dim=64)


def test_dict_round_trip_and_unknown_fields():
    c = EngineConfig(page_size=16, kv_tokens=512, layer_types="KF", enable_kv_events=True, lease_ttl_s=5)
    d = c.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert EngineConfig.from_dict(d) == c and isinstance(c.lease_ttl_s, float)
    with pytest.raises(InvalidArgumentError, match="kv_tokenz"):
        EngineConfig.from_dict({"kv_tokenz": 3})
    with pytest.raises(InvalidArgumentError):
        EngineConfig.from_dict([("kv_tokens", 3)])


def test_replace_validates():
    c = EngineConfig()
    assert c.replace(kv_tokens=64).kv_tokens == 64
    with pytest.raises(InvalidArgumentError, match="page_size"):
        c.replace(page_size=0)
    with pytest.raises(InvalidArgumentError, match="bogus"):
        c.replace(bogus=1)


def test_from_json_and_toml_files(tmp_path):
    j = tmp_path / "engine.json"
    j.write_text(json.dumps({"kv_tokens": 1024, "page_size": 16, "eviction_policy": "lfu"}))
    assert EngineConfig.from_file(j) == EngineConfig(kv_tokens=1024, page_size=16, eviction_policy="lfu")
    t = tmp_path / "engine.toml"
    t.write_text('[engine]\nkv_tokens = 2048\nlayer_types = "KKKFKKKF"\nenable_kv_events = true\n'
                 'lease_ttl_s = 2.5\n')
    c = EngineConfig.from_file(str(t))
    assert (c.kv_tokens, c.layer_types, c.enable_kv_events, c.lease_ttl_s) == (2048, "KKKFKKKF", True, 2.5)
    flat = tmp_path / "flat.toml"
    flat.write_text("request_rows = 3\n")
    assert EngineConfig.from_file(flat).request_rows == 3


@pytest.mark.parametrize("name,text", [
    ("bad.json", "{not json"), ("bad.toml", "kv_tokens = = 3"), ("engine.yaml", "kv_tokens: 3"),
    ("wrong.json", '{"kv_tokens": "many"}'), ("list.json", "[1, 2]"),
])
def test_bad_files(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(InvalidArgumentError):
        EngineConfig.from_file(p)
    with pytest.raises(InvalidArgumentError):
        EngineConfig.from_file(tmp_path / "missing.json")


def test_frozen():
    with pytest.raises(Exception):  # noqa: B017
        EngineConfig().kv_tokens = 5


def test_host_tier_with_an_mla_pool_is_accepted():
    c = EngineConfig(kv_tokens=64, head_num=1, head_dim=576, kv_lora_rank=512, qk_rope_head_dim=64,
                     host_kv_tokens=64)
    assert c.is_mla and c.host_kv_tokens == 64
