"""The proof of the host tiers, embedded and remote (issue 31, item 6): the reference model
(fp64) runs multi-turn conversations through the engine's buffers with a device pool too
small for them, so cached prefixes go to the host tier and come back; every extend's logits
equal the from-scratch logits within 1e-9. KV-only models with the host KV tier
(``host_kv_tokens``); hybrid models (KDA + attention) with the host state tier
(``host_state_slots``): a state demoted to host memory and loaded back must be bit-equal, or
the recurrent layers' logits drift. Page sizes 1, 16 and 64; invariants after every call."""
import numpy as np
import pytest
import torch
from conformance_util import Checked
from tier_workload import conversations

from radixkv.engine.protocol import ExtendItem
from radixkv.reference import HybridConfig, HybridModel, ModelCache

VOCAB, HEADS, DIM, TOL = 50, 2, 8, 1e-9


def _prove(engine_factory, pattern, ps, turn, **cfg):
    """Run 4 conversations of 3 turns; returns the tokens each extend reported loaded from
    the host tier."""
    model = HybridModel(HybridConfig(vocab=VOCAB, hidden=16, num_heads=HEADS, head_dim=DIM, layer_pattern=pattern,
                                     chunk_size=8, dtype=torch.float64, seed=5))
    raw = engine_factory(layer_types=pattern, head_num=HEADS, head_dim=DIM, kv_dtype="float64",
                         kda_num_heads=HEADS, kda_head_dim=DIM, conv_kernel=model.config.conv_kernel,
                         state_dtype="float64", page_size=ps, request_rows=4, max_context_len=256, **cfg)
    e = Checked(raw)
    info = e.attach("proof")
    s, buf = info.session, engine_factory.buffers(raw, info)
    mc = ModelCache.over(buf)
    loaded = 0
    for i, tokens in enumerate(conversations(np.random.default_rng(ps), 4, 3, turn, VOCAB)):
        (r,) = e.alloc_extend(s, [ExtendItem(f"r{i}", tokens)])
        row = buf.req_to_token[r.req_pool_idx, :r.seq_len].long()
        out = model.extend(tokens[r.start:], r.start, row[:r.start], row[r.start:], r.mamba_slot, mc,
                           track_slot=r.track_slot or None, track_seqlen=r.track_seqlen if r.track_slot else None)
        diff = (out - model.forward_reference(tokens)[r.start:]).abs().max().item()
        assert diff <= TOL, f"r{i}: logits differ from scratch by {diff:.3g} (prefix {r.prefix_len}, host {r.host_len})"
        loaded += r.host_len
        e.cache_finished(s, [f"r{i}"])
    return loaded


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_kv_only_logits_over_host_loads(engine_factory, ps):
    kv, turn = (256, 64) if ps == 64 else (96, 24)
    loaded = _prove(engine_factory, "FF", ps, turn, kv_tokens=kv, host_kv_tokens=1024)
    assert loaded > 0, "no KV came back from the host tier"


@pytest.mark.parametrize("ps, events", [(1, False), (16, False), (64, False), (16, True)])
def test_hybrid_logits_over_host_state_loads(engine_factory, ps, events):
    """3 device state slots per running request (its own and two track slots) plus 2 for the
    tree: the 4 conversations' states cannot all stay on the device. With KV events on, the
    recorder's live states follow the demotions and loads (checked by check_invariants)."""
    turn = 64 if ps == 64 else 16
    loaded = _prove(engine_factory, "KFK", ps, turn, kv_tokens=4096, state_slots=5, host_state_slots=16,
                    enable_kv_events=events)
    assert loaded > 0, "no state came back from the host tier"
