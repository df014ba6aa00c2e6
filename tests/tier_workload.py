"""Workloads of the tier tests (engine and conformance): multi-turn conversations whose
prefixes come back after other conversations pushed them out of the device pool."""
import numpy as np


def conversations(rng, n_conv, turns, turn_len, vocab):
    """``n_conv`` conversations, each turn the previous prompt plus ``turn_len`` random tokens
    (int32 in ``0..vocab-1``), in round-robin order: a turn's prefix was cached ``n_conv``
    requests earlier."""
    convs = [rng.integers(0, vocab, turn_len).astype(np.int32) for _ in range(n_conv)]
    order = []
    for _ in range(turns):
        for c in range(n_conv):
            convs[c] = np.concatenate([convs[c], rng.integers(0, vocab, turn_len).astype(np.int32)])
            order.append(convs[c].copy())
    return order


def proof_model(pattern, vocab=50):
    """The fp64 reference model of the tier proofs (``pattern``: layer types, ``F`` / ``K``)."""
    import torch

    from radixkv.reference import HybridConfig, HybridModel

    return HybridModel(HybridConfig(vocab=vocab, hidden=16, num_heads=2, head_dim=8, layer_pattern=pattern,
                                    chunk_size=8, dtype=torch.float64, seed=5))


def proof_fields(model, ps):
    """The EngineConfig fields whose pools fit ``model`` at page size ``ps``."""
    c = model.config
    return dict(layer_types=c.layer_pattern, head_num=c.num_heads, head_dim=c.head_dim, kv_dtype="float64",
                kda_num_heads=c.num_heads, kda_head_dim=c.head_dim, conv_kernel=c.conv_kernel,
                state_dtype="float64", page_size=ps, request_rows=4, max_context_len=256)


def prove_logits(engine, session, buffers, model, ps, turn, tol=1e-9):
    """4 conversations of 3 turns through ``engine`` (embedded or remote; its invariants
    checked after every call), the model reading and writing ``buffers``: every extend's
    logits equal the from-scratch logits within ``tol``. Returns the tokens the extends
    reported loaded from the host tier."""
    from radixkv.engine.protocol import ExtendItem
    from radixkv.reference import ModelCache

    mc = ModelCache.over(buffers)
    loaded = 0
    for i, tokens in enumerate(conversations(np.random.default_rng(ps), 4, 3, turn, model.config.vocab)):
        (r,) = engine.alloc_extend(session, [ExtendItem(f"r{i}", tokens)])
        engine.check_invariants()
        row = buffers.req_to_token[r.req_pool_idx, :r.seq_len].long()
        out = model.extend(tokens[r.start:], r.start, row[:r.start], row[r.start:], r.mamba_slot, mc,
                           track_slot=r.track_slot or None, track_seqlen=r.track_seqlen if r.track_slot else None)
        diff = (out - model.forward_reference(tokens)[r.start:]).abs().max().item()
        assert diff <= tol, f"r{i}: logits differ from scratch by {diff:.3g} (prefix {r.prefix_len}, host {r.host_len})"
        loaded += r.host_len
        engine.cache_finished(session, [f"r{i}"])
        engine.check_invariants()
    return loaded
