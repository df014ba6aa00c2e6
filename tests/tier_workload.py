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
    return replay_logits(engine, session, buffers, model,
                         conversations(np.random.default_rng(ps), 4, 3, turn, model.config.vocab), tol)


def storage_restart_prompts(ps, turn, vocab=50, extra=8):
    """The prompts a restarted engine replays after ``prove_logits`` (same ``ps`` and ``turn``):
    each conversation's second turn plus ``extra`` new tokens, so its whole earlier prompt is a
    prefix the previous engine cached (and the whole prompt fits its device pool)."""
    rng = np.random.default_rng(1000 + ps)
    return [np.concatenate([t, rng.integers(0, vocab, extra).astype(np.int32)])
            for t in conversations(np.random.default_rng(ps), 4, 3, turn, vocab)[4:8]]


def replay_logits(engine, session, buffers, model, prompts, tol=1e-9, prefix="r"):
    """``prove_logits`` over the given ``prompts`` (one request each, finished at once; rids
    ``prefix`` + its index). Returns the tokens the extends reported loaded from the host tier."""
    from radixkv.engine.protocol import ExtendItem
    from radixkv.reference import ModelCache

    mc = ModelCache.over(buffers)
    loaded = 0
    for i, tokens in enumerate(prompts):
        rid = f"{prefix}{i}"
        (r,) = engine.alloc_extend(session, [ExtendItem(rid, tokens)])
        engine.check_invariants()
        row = buffers.req_to_token[r.req_pool_idx, :r.seq_len].long()
        out = model.extend(tokens[r.start:], r.start, row[:r.start], row[r.start:], r.mamba_slot, mc,
                           track_slot=r.track_slot or None, track_seqlen=r.track_seqlen if r.track_slot else None)
        diff = (out - model.forward_reference(tokens)[r.start:]).abs().max().item()
        assert diff <= tol, f"{rid}: logits differ from scratch by {diff:.3g} (prefix {r.prefix_len}, " \
            f"host {r.host_len})"
        loaded += r.host_len
        engine.cache_finished(session, [rid])
        engine.check_invariants()
    return loaded


MLA_RANK, MLA_ROPE = 6, 2


def mla_fields(ps, layers=2):
    """EngineConfig fields of a KV-only MLA model (fp64 latents of ``MLA_RANK + MLA_ROPE``)."""
    return dict(layer_types="F" * layers, head_num=1, head_dim=MLA_RANK + MLA_ROPE, kv_lora_rank=MLA_RANK,
                qk_rope_head_dim=MLA_ROPE, kv_dtype="float64", page_size=ps, request_rows=4, max_context_len=256)


def mla_latents(tokens, layers):
    """The latents a causal MLA model writes for ``tokens``: per layer and position a function
    of the whole prefix up to it (a rolling hash), fp64 ``[layers, n, 1, MLA_RANK + MLA_ROPE]``.
    A row loaded from the wrong page, or a stale or torn one, differs."""
    import torch

    acc, h = 0, np.zeros(len(tokens), np.float64)
    for i, t in enumerate(tokens):
        acc = (acc * 1000003 + int(t) + 1) % (2**31 - 1)
        h[i] = acc
    grid = h[None, :, None] * 1e-6 * np.arange(1, layers + 1)[:, None, None] + np.arange(MLA_RANK + MLA_ROPE) * 0.37
    return torch.from_numpy(np.sin(grid))[:, :, None, :]


def prove_mla_latents(engine, session, buffers, ps, turn, layers=2):
    """``prove_logits`` for an MLA model, which the reference model does not implement: 4
    conversations of 3 turns; every extend finds its cached prefix's latents (device rows,
    host loads) bit-equal to what the model wrote, then writes its own. Returns the tokens
    the extends reported loaded from the host tier."""
    import torch

    from radixkv.engine.protocol import ExtendItem

    pool = buffers.kv_pool
    loaded = 0
    for i, tokens in enumerate(conversations(np.random.default_rng(ps), 4, 3, turn, 50)):
        (r,) = engine.alloc_extend(session, [ExtendItem(f"r{i}", tokens)])
        engine.check_invariants()
        row = buffers.req_to_token[r.req_pool_idx, :r.seq_len].long()
        want = mla_latents(tokens, layers)
        for layer in range(layers):
            got = pool.kv_buffer[layer][row[:r.start]]
            assert torch.equal(got, want[layer, :r.start]), f"r{i} layer {layer}: cached latents differ " \
                f"(prefix {r.prefix_len}, host {r.host_len})"
            pool.kv_buffer[layer][row[r.start:]] = want[layer, r.start:]
        loaded += r.host_len
        engine.cache_finished(session, [f"r{i}"])
        engine.check_invariants()
    return loaded
