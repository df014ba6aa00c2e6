"""End to end with the reference model (full-attention layers only): a worker runs the
model through the engine's buffers; a second request that reuses a cached prefix computes
only its new tokens, reading the first request's KV rows, and gets the logits of a
from-scratch run. Chunked prefill and batched decode likewise."""
import numpy as np
import pytest
import torch
from conformance_util import Checked, toks

from radixkv.engine.protocol import DecodeItem, ExtendItem
from radixkv.reference import HybridConfig, HybridModel, ModelCache

HEADS, DIM = 2, 8


@pytest.fixture(scope="module")
def model():
    return HybridModel(HybridConfig(vocab=40, hidden=16, num_heads=HEADS, head_dim=DIM, layer_pattern="FF",
                                    dtype=torch.float32, mlp_mult=1, seed=3))


def _run_extend(model, buf, r, tokens):
    """Run the model on the tokens ``r`` asks for, reading the prefix's rows."""
    row = buf.req_to_token[r.req_pool_idx]
    prefix = row[:r.start].to(torch.int64)
    new = torch.as_tensor(r.out_cache_loc)
    return model.extend(tokens[r.start:r.seq_len], r.start, prefix, new, r.mamba_slot, ModelCache.over(buf))


@pytest.mark.parametrize("ps", [1, 4])
def test_prefix_reuse_gives_from_scratch_logits(engine_factory, model, ps):
    raw = engine_factory(page_size=ps, kv_tokens=256, head_num=HEADS, head_dim=DIM, kv_dtype="float32",
                         max_context_len=128)
    e = Checked(raw)
    info = e.attach("worker")
    s, buf = info.session, engine_factory.buffers(raw, info)
    rng = np.random.default_rng(0)
    a_tokens = toks(rng.integers(0, 40, 23))
    pos = 0
    for chunk in (9, 14):  # chunked prefill of request a
        (r,) = e.alloc_extend(s, [ExtendItem("a", a_tokens[pos:pos + chunk])])
        logits = _run_extend(model, buf, r, a_tokens)
        pos += chunk
        e.cache_unfinished(s, ["a"])
    torch.testing.assert_close(logits, model.forward_reference(a_tokens)[9:], rtol=1e-4, atol=1e-4)
    seq = a_tokens
    for t in rng.integers(0, 40, 3):  # decode a few tokens
        d = e.alloc_decode(s, [DecodeItem("a", int(t))])
        seq = np.append(seq, np.int32(t))
        out = model.decode(toks([t]), d.req_pool_indices, d.seq_lens, d.out_cache_loc, d.mamba_slots,
                           ModelCache.over(buf))
        torch.testing.assert_close(out[0], model.forward_reference(seq)[-1], rtol=1e-4, atol=1e-4)
    e.cache_finished(s, ["a"])
    # request b shares 20 tokens with a: only its new tokens are computed
    b_tokens = np.concatenate([seq[:20], toks(rng.integers(0, 40, 6))])
    (r,) = e.alloc_extend(s, [ExtendItem("b", b_tokens)])
    assert r.prefix_len == 20 - 20 % ps > 0
    logits = _run_extend(model, buf, r, b_tokens)
    torch.testing.assert_close(logits, model.forward_reference(b_tokens)[r.start:], rtol=1e-4, atol=1e-4)
    # batched decode of b and a fresh request c
    (rc,) = e.alloc_extend(s, [ExtendItem("c", b_tokens[:5])])
    _run_extend(model, buf, rc, b_tokens[:5])
    d = e.alloc_decode(s, [DecodeItem("b", 7), DecodeItem("c", 8)])
    out = model.decode(toks([7, 8]), d.req_pool_indices, d.seq_lens, d.out_cache_loc, d.mamba_slots,
                       ModelCache.over(buf))
    torch.testing.assert_close(out[0], model.forward_reference(np.append(b_tokens, 7))[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], model.forward_reference(np.append(b_tokens[:5], 8))[-1],
                               rtol=1e-4, atol=1e-4)
    e.cache_finished(s, ["b", "c"])
