"""Running vLLM engines re-attach to a restarted manager and share through it again.

Engines ``a`` (its engine core in its own loop: the first-block index and deferred saves) and
``b`` (in-process) hold sessions of manager M1; ``ref`` has no cache. M1 is SIGKILLed and M2
started at once at the same address, with no wait for the engines to reconnect. Then ``b``
serves three new prompts: its tokens equal ``ref``'s, and M2's tree holds each prompt's whole
blocks (its ``inserted_tokens`` counts them), so the re-attach happened by ``b``'s first
request. ``a`` then serves one of them and loads it from M2 (its index caught up with M2's
events, or asked). Last, a fresh engine ``c`` repeats one of ``b``'s prompts and reuses
exactly its whole-block tokens. Four engine starts in all.
"""
import pytest
from tooling.vllm_cluster import connector_config, make_manager, running, settled, tiny_llama, tokens, wait_for_sessions
from tooling.vllm_cluster import holds as holds_in
from vllm_harness import EngineProcess

BLOCK = 32
MAX_TOKENS = 8
NAMESPACE = "tiny-llama"
OWN_LOOP = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
PROMPT_LEN = 100  # 3 whole blocks: 96 tokens saved, 96 reused (at most n - 1 tokens are)
WHOLE = PROMPT_LEN // BLOCK * BLOCK


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-reattach")
    model = tiny_llama(root, kv_heads=1)
    manager = make_manager(root, ["--model-config", model, "--page-size", str(BLOCK), "--kv-tokens", "2048",
                                  "--max-context-len", "1024", "--lease-ttl-s", "30", "--enable-kv-events"])
    common = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=BLOCK,
                  max_model_len=1024, kv_cache_memory_bytes=32 << 20, enable_prefix_caching=False,
                  distributed_executor_backend="uni", disable_log_stats=False, seed=0)
    # the default retry interval (2 s): a re-attach must not wait for the background thread
    ktc = connector_config(manager, NAMESPACE, retry_interval_s=2.0)
    engines = {"ref": EngineProcess("ref", common),
               "a": EngineProcess("a", {**common, "kv_transfer_config": ktc}, env=OWN_LOOP),
               "b": EngineProcess("b", {**common, "kv_transfer_config": ktc})}
    with running(engines, manager, start_manager=True):
        yield {**engines, "manager": manager, "common": common, "ktc": ktc}


def run(engine, prompt):
    [(out, cached)] = engine.generate([prompt], MAX_TOKENS)
    return out, cached


def test_engines_reattach_to_a_restarted_manager_and_share_again(cluster):
    mgr, a, b, ref = cluster["manager"], cluster["a"], cluster["b"], cluster["ref"]
    p0 = tokens(40, PROMPT_LEN)
    want0, _ = run(ref, p0)
    assert run(a, p0) == (want0, 0)
    holds_in(mgr, p0, WHOLE, NAMESPACE)
    assert run(b, p0) == (want0, WHOLE)  # shared through M1
    settled(mgr)

    mgr.kill()
    mgr.start()  # M2 at the same address, new pools; the engines are not waited for
    m2 = mgr.client()
    try:
        assert m2.stats().inserted_tokens == 0
        prompts = [tokens(41 + i, PROMPT_LEN) for i in range(3)]
        for p in prompts:
            want, _ = run(ref, p)
            assert run(b, p) == (want, 0)  # M2 is empty: computed, and stored there
            holds_in(mgr, p, WHOLE, NAMESPACE)
        stats = settled(mgr)
        assert stats.inserted_tokens == 3 * WHOLE
        # a loads one of them from M2 (its index, reset for M2, caught up or answered "ask")
        want, _ = run(ref, prompts[1])
        assert run(a, prompts[1]) == (want, WHOLE)
        wait_for_sessions(mgr, 2)
        assert settled(mgr).kv_protected == 0  # nothing left locked
    finally:
        m2.close()

    c = EngineProcess("c", {**cluster["common"], "kv_transfer_config": cluster["ktc"]})
    try:
        c.wait_ready()
        wait_for_sessions(mgr, 3)
        want, _ = run(ref, prompts[2])
        assert run(c, prompts[2]) == (want, WHOLE)  # exactly b's whole blocks, from M2
    finally:
        c.stop()
