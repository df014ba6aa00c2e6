"""MLA through the connector's halves, against an MLA manager (``MLATokenToKVPool``), without
vLLM: the latent rows (one per token and layer, no V) go from one engine's paged cache, in vLLM's
CPU MLA layout ``[blocks, 1, block_size, width]``, to another's, bit for bit, at any TP size
(every rank holds the whole latent; rank 0 saves it)."""
import pytest
import torch
from tooling.vllm_fake import BS, KEY, LATENT, MLA_SHAPE, SHAPE, Engine, idle

from radixkv.integrations.vllm.layout import LayoutMismatchError, manager_kv_shape, paged_kv_views
from radixkv.integrations.vllm.link import ManagerLink
from radixkv.integrations.vllm.scheduler_side import ScheduledReq
from radixkv.integrations.vllm.worker_side import WorkerSide


@pytest.mark.parametrize("tp_save, tp_load, by_views", [(1, 1, False), (2, 1, False), (1, 2, False), (1, 1, True)])
def test_an_engine_loads_the_latents_another_saved(mla_manager, tp_save, tp_load, by_views):
    a = Engine(mla_manager.cfg, seed=40 + tp_save, tp=tp_save, mla=True)
    b = Engine(mla_manager.cfg, seed=50 + tp_load, tp=tp_load, mla=True)
    if by_views:  # the slower path (layouts whose parts are not whole rows of the layer tensor)
        b.worker._geometry = None
    start = 3000 + 100 * tp_save + 10 * tp_load + 1000 * by_views
    prompt = list(range(start, start + 14))
    assert a.sched.num_new_matched_tokens("r", prompt, 0, KEY) == 0
    a.step([ScheduledReq("r", 0, len(prompt))], {"r": [5, 2, 9, 1]})
    assert a.workers[0].counters["saved_tokens"] == 12
    a.sched.finished("r")
    a.sched.flush()
    assert b.sched.num_new_matched_tokens("s", prompt, 0, KEY) == 12
    b.sched.after_alloc("s", 12)
    plan, failed = b.step([ScheduledReq("s", 12, 2)], {"s": [3, 11, 0, 6]})
    assert not failed and [(op.start, op.end) for op in plan.loads] == [(0, 12)]
    (want,) = a.token_kv([5, 2, 9, 1], 12)
    assert want.shape == (2, 12, 1, LATENT)
    for rank in range(tp_load):  # every rank holds the latent
        (got,) = b.rank_kv(rank, [3, 11, 0, 6], 12)
        assert torch.equal(got, want)
    b.sched.finished("s")
    assert idle(mla_manager, a, b) == (0, 0)
    a.close()
    b.close()


@pytest.mark.parametrize("mla_engine", [True, False])
def test_mla_and_mha_never_share_a_manager(manager, mla_manager, mla_engine):
    assert manager_kv_shape(mla_manager.config.to_dict()) == MLA_SHAPE
    assert manager_kv_shape(manager.config.to_dict()) == SHAPE
    srv, shape = (manager, MLA_SHAPE) if mla_engine else (mla_manager, SHAPE)
    w = WorkerSide(ManagerLink(srv.cfg, "w", keepalive=False, background=False), shape)
    kv = torch.zeros(4, 1, BS, LATENT) if mla_engine else torch.zeros(4, SHAPE.kv_heads, BS, 2 * SHAPE.head_dim)
    with pytest.raises(LayoutMismatchError, match="MLA latent"):
        w.register([(f"l{i}", kv.clone()) for i in range(shape.layers)])


def test_mla_views_alias_the_cpu_mla_cache():
    kv = torch.arange(3 * BS * LATENT, dtype=torch.float32).view(3, 1, BS, LATENT)
    (lat,) = paged_kv_views(kv, BS, 1, LATENT, latent=True)
    assert lat.shape == (3, BS, 1, LATENT) and torch.equal(lat[2, 1, 0], kv[2, 0, 1])
    lat[1, 3, 0] = -1.0
    assert (kv[1, 0, 3] == -1).all()
    (flat,) = paged_kv_views(kv.view(3, BS, LATENT), BS, 1, LATENT, latent=True)  # GPU MLA backends
    assert torch.equal(flat, lat)
    with pytest.raises(LayoutMismatchError, match="MLA latent"):
        paged_kv_views(kv, BS, 2, LATENT, latent=True)
