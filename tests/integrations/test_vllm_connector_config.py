"""``kv_connector_extra_config`` -> ``ConnectorConfig``: the keys a user writes, checked."""
import pytest
import torch

from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm.config import ConnectorConfig
from radixkv.integrations.vllm.layout import (
    KVShape,
    LayoutMismatchError,
    StateShape,
    check_same_shape,
    manager_kv_shape,
    state_page_views,
)


def test_the_documented_keys():
    c = ConnectorConfig.from_extra({"address": "unix:///run/radixkv-manager/s.sock",
                                    "token_file": "/run/radixkv-manager/token", "namespace": "llama-8b",
                                    "retry_interval_s": 1})
    assert c.address.startswith("unix://") and c.namespace == "llama-8b" and c.retry_interval_s == 1.0
    assert c.recompute_load_failures is True and c.connect_timeout_s == 2.0
    assert c.defer_miss_saves == "auto" and c.copy_threads == 1
    assert ConnectorConfig.from_extra({"address": "x:1", "defer_miss_saves": False}).defer_miss_saves is False


@pytest.mark.parametrize("extra, word", [
    (None, "address"), ({}, "address"), ({"address": ""}, "address"),
    ({"address": "x:1", "adress": "y"}, "adress"),
    ({"address": "x:1", "call_timeout_s": 0}, "call_timeout_s"),
    ({"address": "x:1", "retry_interval_s": float("nan")}, "retry_interval_s"),
    ({"address": "x:1", "namespace": 3}, "namespace"),
    ({"address": "x:1", "recompute_load_failures": "yes"}, "recompute_load_failures"),
    ({"address": "x:1", "defer_miss_saves": "yes"}, "defer_miss_saves"),
    ({"address": "x:1", "defer_miss_saves": 1}, "defer_miss_saves"),
    ({"address": "x:1", "mla_on_cpu": 1}, "mla_on_cpu"), ({"address": "x:1", "copy_threads": -1}, "copy_threads"),
    ({"address": "x:1", "copy_threads": 1.5}, "copy_threads"),
])
def test_bad_configs_name_the_key(extra, word):
    with pytest.raises(InvalidArgumentError, match=word):
        ConnectorConfig.from_extra(extra)


def test_manager_shape_and_refusals():
    cfg = {"layer_types": "FFFF", "head_num": 8, "head_dim": 128, "kv_dtype": "bfloat16", "page_size": 16}
    shape = manager_kv_shape(cfg)
    assert shape == KVShape(4, 8, 128, "bfloat16", 16)
    check_same_shape(shape, shape)
    with pytest.raises(LayoutMismatchError, match="page_size=32.*page_size=16"):
        check_same_shape(shape._replace(page_size=32), shape)
    hybrid = manager_kv_shape({**cfg, "layer_types": "FKFK", "conv_state_dims": [3, 512],
                               "temporal_state_dims": [4, 64, 64], "state_dtype": "bfloat16",
                               "temporal_state_dtype": "float32"})
    assert hybrid == KVShape(2, 8, 128, "bfloat16", 16, state=StateShape("FKFK", (3, 512), (4, 64, 64), "bfloat16",
                                                                          "float32"))
    with pytest.raises(LayoutMismatchError, match="layer_types=FKFK"):  # a KV-only engine, a hybrid manager
        check_same_shape(shape._replace(layers=2), hybrid)


def test_state_page_views_alias_vllms_raw_pages():
    st = StateShape("KF", (3, 4), (2, 2, 2), "bfloat16", "float32")
    raw = torch.zeros(5, 1, 1, 64, dtype=torch.int8)  # 24 + 32 bytes of state in a 64-byte page
    conv, temporal = state_page_views(raw, st)
    assert conv.shape == (5, 24) and temporal.shape == (5, 32)
    temporal[2] = 7
    assert raw[2, 0, 0, 24:56].eq(7).all() and raw[2, 0, 0, :24].eq(0).all() and raw[2, 0, 0, 56:].eq(0).all()
    with pytest.raises(LayoutMismatchError, match="raw pages"):
        state_page_views(torch.zeros(5, 1, 1, 40, dtype=torch.int8), st)
