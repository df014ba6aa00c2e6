"""Hybrid models (GraniteMoeHybrid: Mamba2 + attention, fp32; Qwen3-Next: gated delta net +
attention, bf16) shared between two vLLM engines through ``RadixKVConnector`` (``SupportsHMA``):
attention KV and the recurrent state at whole blocks. Per model, two engines on one manager
(``radixkv serve --model-config``, page 256 = vLLM's block size in ``mamba_cache_mode="align"``,
the temporal state dtype vLLM allocates), vLLM's own prefix caching on (align mode needs it;
GraniteMoeHybrid: ``max_num_batched_tokens`` = the block size, its CPU Mamba2 kernel).
Engine ``a`` computes a prompt, then repeats it: that second run is vLLM's own prefix caching
inside one process (the reference). Engine ``b`` repeats it through the manager: its reused
tokens equal ``a``'s own reuse and its greedy tokens equal ``a``'s token for token. A tiny model
with random fp32 weights (init range 0.2, so the output depends on the whole prompt) is made at
test time. Also checked: the shapes vLLM allocates equal ``--model-config``'s, a prompt
whose state the manager does not hold gets no hit past the last state it has, and the manager
SIGKILLed between requests then restarted (both engines serve token for token, then share
through the new manager), and a state load that fails (the load is asynchronous to vLLM on a
hybrid model, so its failure is a failed receive of the request: vLLM recomputes it).
"""
import dataclasses
import os

import pytest
from tooling.vllm_cluster import connector_config, make_manager, running, settled, tokens, wait_for_sessions
from tooling.vllm_cluster import holds as holds_in
from vllm_harness import EngineProcess
from vllm_model import MODELS, make_model

BLOCK = 256
NAMESPACE = "tiny-granite-hybrid"
MAX_TOKENS = 8
#: what vLLM's own prefix caching reuses of a prompt sharing 300 tokens with one it computed in
#: 256-token chunks (measured; the manager keeps a state at each request's last whole block only)
OWN_PARTIAL_REUSE = 0
KINDS = {name: dataclasses.replace(MODELS[name], fields={**MODELS[name].fields, "vocab_size": 512,
                                                        "initializer_range": 0.2})
         for name in ("granite-hybrid", "qwen3-next")}


def vllm_states(model, kind):
    """(conv shape, temporal shape, dtype names) vLLM's config and model class allocate."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_cls

    vc = EngineArgs(model=model, skip_tokenizer_init=True, dtype=kind.dtype, block_size=BLOCK,
                    enable_prefix_caching=True, max_model_len=2048).create_engine_config()
    cls = get_model_cls(vc.model_config)
    conv, temporal = cls.get_mamba_state_shape_from_config(vc)
    dtypes = [str(d).removeprefix("torch.") for d in cls.get_mamba_state_dtype_from_config(vc)]
    return tuple(conv), tuple(temporal), dtypes


@pytest.fixture(scope="module", params=sorted(KINDS))
def cluster(request, tmp_path_factory):
    kind = KINDS[request.param]
    root = tmp_path_factory.mktemp("vllm-radixkv-hybrid")
    model = make_model(str(root / "model"), kind)
    states = vllm_states(model, kind)
    manager = make_manager(root, ["--model-config", model, "--page-size", str(BLOCK), "--kv-tokens",
                                  str(16 * BLOCK), "--max-context-len", "2048", "--state-slots", "32",
                                  "--temporal-state-dtype", states[2][1], "--lease-ttl-s", "30"])
    common = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype=kind.dtype, block_size=BLOCK,
                  max_model_len=2048, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True,
                  distributed_executor_backend="uni", disable_log_stats=False,
                  seed=0, kv_transfer_config=connector_config(manager, NAMESPACE))
    if kind.batched_tokens_eq_block:
        common["max_num_batched_tokens"] = BLOCK
    fail_flag = str(root / "fail-state-loads")
    ktc = common["kv_transfer_config"]
    failing = {**ktc, "kv_connector": "StateLoadFailingRadixKVConnector",
               "kv_connector_module_path": "vllm_test_connector"}
    engines = {"a": EngineProcess("a", common),
               "b": EngineProcess("b", {**common, "kv_transfer_config": failing},
                                  env={"RADIXKV_TEST_FAIL_STATE_FLAG": fail_flag})}
    with running(engines, manager, start_manager=True):
        yield {**engines, "manager": manager, "model": model, "kind": kind, "states": states, "fail_flag": fail_flag}


def run(engine, prompt):
    [(out, cached)] = engine.generate([prompt], MAX_TOKENS)
    return out, cached


def ext_hits(engine):
    return engine.metrics().get("vllm:external_prefix_cache_hits", 0)


def test_manager_state_pool_has_the_shapes_vllm_allocates(cluster):
    from radixkv.engine.model_config import engine_fields_from_model_dir

    conv, temporal, dtypes = cluster["states"]
    f = engine_fields_from_model_dir(cluster["model"])
    assert (f["conv_state_dims"], f["temporal_state_dims"], f["layer_types"]) == (conv, temporal, "KKKF")
    assert f["state_dtype"] == dtypes[0] == cluster["kind"].dtype  # the temporal one: --temporal-state-dtype
    # and the engines attached: the connector refuses a manager whose state pool differs
    assert cluster["manager"].client().stats().sessions == 2


def test_state_and_kv_from_another_engine_equal_vllms_own_prefix_caching(cluster):
    a, b, manager = cluster["a"], cluster["b"], cluster["manager"]
    p = tokens(21, 600)  # 2 whole blocks + 88 tokens: vLLM reuses 512 of them
    variant = tokens(24, 2 * BLOCK) + p[2 * BLOCK:]  # the output depends on the reused part
    out, cached = run(a, p)
    assert cached == 0
    assert run(a, variant)[0] != out
    own_out, own_cached = run(a, p)  # vLLM's own prefix caching, inside engine a
    assert own_cached == 2 * BLOCK and own_out == out
    holds_in(manager, p, 2 * BLOCK, NAMESPACE)
    settled(manager)
    before = ext_hits(b)
    b_out, b_cached = run(b, p)
    assert (b_out, b_cached) == (own_out, own_cached)
    assert ext_hits(b) - before == own_cached


def test_no_hit_past_the_last_state_the_manager_holds(cluster):
    a, b, manager = cluster["a"], cluster["b"], cluster["manager"]
    p = tokens(22, 600)
    run(a, p)  # the manager holds KV [0, 512) and the state at 512 only
    holds_in(manager, p, 2 * BLOCK, NAMESPACE)
    settled(manager)
    q = p[:300] + tokens(23, 300)  # shares block 0's KV, but the manager has no state at 256
    before = ext_hits(b)
    out, cached = run(b, q)
    assert ext_hits(b) - before == 0 and cached == 0
    # vLLM's own prefix caching in engine a, for a prompt sharing the same 300 tokens with p
    before = ext_hits(a)
    _, own_cached = run(a, p[:300] + tokens(25, 300))
    assert ext_hits(a) - before == 0
    print(f"vLLM's own prefix caching in engine a: {own_cached} of 300 shared tokens reused")
    assert own_cached == OWN_PARTIAL_REUSE
    holds_in(manager, q, 2 * BLOCK, NAMESPACE)  # b computed q: a loads it, token for token
    settled(manager)
    assert run(a, q) == (out, 2 * BLOCK)


def test_manager_killed_between_requests_then_restarted(cluster):
    """The manager SIGKILLed: both engines keep serving (b computes, a reuses its own prefix
    cache), token for token; a manager restarted at the same address is re-attached, shares
    the state again, and is left with nothing locked and its invariants whole."""
    a, b, mgr = cluster["a"], cluster["b"], cluster["manager"]
    p = tokens(26, 600)
    out, cached = run(a, p)
    assert cached == 0
    holds_in(mgr, p, 2 * BLOCK, NAMESPACE)
    settled(mgr)
    mgr.kill()
    assert run(b, p) == (out, 0)  # computed without the manager
    assert run(a, p) == (out, 2 * BLOCK)  # vLLM's own prefix caching, as without the connector
    mgr.start()
    wait_for_sessions(mgr, 2)
    q = tokens(27, 600)
    q_out, _ = run(b, q)  # the new manager is empty: computed, and stored there
    holds_in(mgr, q, 2 * BLOCK, NAMESPACE)
    settled(mgr)
    before = ext_hits(a)
    assert run(a, q) == (q_out, 2 * BLOCK)
    assert ext_hits(a) - before == 2 * BLOCK  # KV and state from the new manager
    stats = settled(mgr)
    assert stats.requests == 0 and stats.kv_protected == 0
    mgr.client().check_invariants()


def test_a_state_load_that_fails_makes_vllm_recompute(cluster):
    """b's worker fails to load the state (its connector's fault switch): the request is
    reported a failed receive, so vLLM computes the prompt again and never runs on KV without
    its state: b's tokens equal a's, and the manager holds no lock after."""
    a, b, manager = cluster["a"], cluster["b"], cluster["manager"]
    p = tokens(28, 600)
    out, _ = run(a, p)
    holds_in(manager, p, 2 * BLOCK, NAMESPACE)
    settled(manager)
    flag = cluster["fail_flag"]
    open(flag, "w").close()
    try:
        before = ext_hits(b)
        b_out, b_cached = run(b, p)
        with open(flag) as f:
            failed = f.read().split()
    finally:
        os.unlink(flag)
    print(f"a failed state load: {len(failed)} batches, {b_cached} cached tokens, "
          f"{ext_hits(b) - before} external hits")
    assert failed, "b loaded no state: the fault was not exercised"
    assert b_out == out
    assert settled(manager).kv_protected == 0
