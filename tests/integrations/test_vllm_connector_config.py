"""``kv_connector_extra_config`` -> ``ConnectorConfig``: the keys a user writes, checked."""
import pytest

from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm.config import ConnectorConfig
from radixkv.integrations.vllm.layout import KVShape, LayoutMismatchError, check_same_shape, manager_kv_shape


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
    with pytest.raises(LayoutMismatchError, match="hybrid"):
        manager_kv_shape({**cfg, "layer_types": "FKFK"})
