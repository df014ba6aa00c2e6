"""EnginePools and WorkerBuffers: planned layouts equal built ones, the layout is plain
data, pools live in given buffers, and workers' views alias the engine's memory (KV-only
and hybrid), with global layer ids routed like HybridLinearKVPool."""
import json

import pytest
import torch

from radixkv.engine.buffers import WorkerBuffers, attach_buffers
from radixkv.engine.config import EngineConfig
from radixkv.engine.layout import plan_arenas
from radixkv.engine.pools import EnginePools, build_tree
from radixkv.errors import AlignmentError, InvalidArgumentError, InvalidIndexError
from radixkv.memory import HybridReqToTokenPool, ReqToTokenPool

HYBRID = EngineConfig(layer_types="KKF", kda_num_heads=2, kda_head_dim=4, state_slots=5, request_rows=3,
                      max_context_len=16, kv_tokens=64, page_size=4, head_num=2, head_dim=4)
PLAIN = EngineConfig(kv_tokens=64, request_rows=3, max_context_len=16, head_num=2, head_dim=4, kv_dtype="float16")


@pytest.mark.parametrize("cfg", [PLAIN, HYBRID], ids=["kv-only", "hybrid"])
def test_pools_match_plan_and_layout_is_plain_data(cfg):
    pools = EnginePools(cfg)
    plans = plan_arenas(cfg)
    assert {n: a.layout for n, a in pools.arenas().items()} == plans
    lay = pools.layout()
    assert json.loads(json.dumps(lay)) == lay
    assert set(lay["pools"]) == set(plans) and lay["config"] == cfg.to_dict()
    assert all(p["mapping"]["mode"] == "embedded" for p in lay["pools"].values())
    assert lay["layers"]["full"] == list(cfg.full_layer_ids)
    pools.check_invariants([])
    if cfg.is_hybrid:
        assert isinstance(pools.req_to_token_pool, HybridReqToTokenPool) and pools.mamba_pool.size == 5
    else:
        assert type(pools.req_to_token_pool) is ReqToTokenPool and pools.mamba_pool is None
    lay2 = pools.layout({"kv": {"mode": "shm", "path": "x"}})
    assert lay2["pools"]["kv"]["mapping"] == {"mode": "shm", "path": "x"}
    with pytest.raises(InvalidArgumentError):
        pools.layout({"nope": {}})


def aligned_zeros(nbytes, alignment=256):
    raw = torch.zeros(nbytes + alignment, dtype=torch.uint8)
    start = (-raw.data_ptr()) % alignment
    return raw[start:start + nbytes]


def test_pools_over_given_buffers():
    plans = plan_arenas(PLAIN)
    bufs = {n: aligned_zeros(p.total_bytes) for n, p in plans.items()}
    pools = EnginePools(PLAIN, buffers=bufs)
    pools.kv_pool.set_kv_buffer(1, torch.tensor([3]), torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0))
    spec = plans["kv"].spec("v.1")
    v = bufs["kv"][spec.offset:spec.offset + spec.nbytes].view(torch.float16).view(spec.shape)
    assert float(v[3].sum()) == 16.0
    with pytest.raises(InvalidArgumentError, match="unknown pools"):
        EnginePools(PLAIN, buffers={"mamba": bufs["kv"]})
    with pytest.raises(InvalidArgumentError):
        EnginePools(PLAIN, buffers={"kv": bufs["kv"][:-512]})  # too small
    with pytest.raises(AlignmentError):
        EnginePools(PLAIN, buffers={"kv": aligned_zeros(plans["kv"].total_bytes + 8)[1:]})


def test_attach_embedded_and_from_bytes_alias_the_same_memory():
    pools = EnginePools(PLAIN)
    lay = pools.layout()
    w1 = attach_buffers(lay)
    w2 = attach_buffers(json.loads(json.dumps(lay)), pools.buffers())
    w1.set_kv_buffer(0, torch.tensor([5, 9]), torch.full((2, 2, 4), 3.0), torch.full((2, 2, 4), 4.0))
    k, v = w2.get_kv_buffer(0)
    assert float(k[9, 1, 3]) == 3.0 and float(v[5, 0, 0]) == 4.0
    assert k.data_ptr() == pools.kv_pool.k_buffer[0].data_ptr()
    pools.req_to_token_pool.req_to_token[2, 7] = 42
    assert int(w1.req_to_token[2, 7]) == int(w2.req_to_token[2, 7]) == 42
    for w in (w1, w2, pools.worker_buffers()):
        w.check_invariants()
        with pytest.raises(InvalidArgumentError):
            w.mamba2_layer_cache(0)
        with pytest.raises(InvalidIndexError):
            w.get_kv_buffer(2)


def test_attach_rejects_mismatches():
    pools = EnginePools(PLAIN)
    lay = pools.layout()
    for bad in ({}, {"format": "other"}, dict(lay, pools={})):
        with pytest.raises(InvalidArgumentError):
            attach_buffers(bad)
    other = json.loads(json.dumps(lay))
    other["config"]["head_dim"] = 8  # the arenas no longer match the config
    with pytest.raises(InvalidArgumentError):
        attach_buffers(other, pools.buffers())
    shm = json.loads(json.dumps(lay))
    shm["pools"]["kv"]["mapping"] = {"mode": "shm", "path": "/dev/shm/x"}
    with pytest.raises(InvalidArgumentError, match="no buffer"):
        attach_buffers(shm)
    gone = json.loads(json.dumps(lay))
    for p in gone["pools"].values():
        p["mapping"]["key"] = "embedded-0"
    with pytest.raises(InvalidArgumentError, match="not in this process"):
        attach_buffers(gone)
    with pytest.raises(InvalidArgumentError):
        attach_buffers(lay, {"kv": "not a tensor", "req_to_token": pools.buffers()["req_to_token"]})


def test_hybrid_worker_buffers_route_global_layer_ids():
    pools = EnginePools(HYBRID)
    w = attach_buffers(pools.layout())
    k, v = w.get_kv_buffer(2)  # the one full layer
    assert tuple(k.shape) == (64 + 4, 2, 4)
    for lid in (0, 1):
        c = w.mamba2_layer_cache(lid)
        assert tuple(c.conv[0].shape) == (6,) + HYBRID.conv_state_shape
        assert tuple(c.temporal.shape) == (6,) + HYBRID.temporal_state_shape
    c = w.mamba2_layer_cache(1)
    c.temporal[3].fill_(7.0)
    assert float(pools.mamba_pool.temporal_state[1, 3].mean()) == 7.0
    with pytest.raises(InvalidArgumentError):
        w.get_kv_buffer(0)
    with pytest.raises(InvalidArgumentError):
        w.mamba2_layer_cache(2)
    with pytest.raises(InvalidIndexError):
        w.get_kv_buffer(3)
    w.check_invariants()
    assert isinstance(pools.worker_buffers(), WorkerBuffers)


def test_tree_follows_the_config():
    pools = EnginePools(PLAIN.replace(eviction_policy="lfu", admission_policy="none", enable_kv_events=True))
    tree = build_tree(pools)
    assert tree.disable and tree.kv_events is not None and tree.page_size == 1
    assert type(tree.policy).__name__.lower().startswith("lfu")


def test_cuda_device_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(InvalidArgumentError, match="CUDA"):
        EnginePools(PLAIN.replace(device="cuda:0"))


def test_model_cache_over_worker_buffers():
    from radixkv.reference.model import ModelCache

    w = EnginePools(HYBRID).worker_buffers()
    mc = ModelCache.over(w)
    assert isinstance(mc, ModelCache) and mc.kv_pool is w and mc.req_to_token is w.req_to_token
