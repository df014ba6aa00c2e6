"""What the vLLM end-to-end tests (``tests/vllm``) share: a manager on a private Unix socket,
the connector's ``kv_transfer_config``, and waits on the manager (sessions, settled requests,
a prompt held in the tree). Imports vLLM nowhere (the engines run in their own processes)."""
import contextlib
import os
import random
import secrets
import time

import numpy as np
from process_group import members
from vllm_harness import ManagerProcess
from vllm_model import TinyLlama, make_tiny_llama

from radixkv.engine.protocol import MatchQuery

__all__ = ["tokens", "tiny_llama", "tiny_deepseek_v2", "make_manager", "connector_config", "running",
           "wait_for_sessions", "settled", "holds"]


def tokens(seed, n):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 512) for _ in range(n)]


def tiny_llama(root, kv_heads):
    """A 2-layer Llama with random fp32 weights under ``root`` (head_dim 64, 2 attention heads,
    ``kv_heads`` KV heads; init range 0.2, so the greedy output depends on the whole prompt)."""
    return make_tiny_llama(str(root / "model"), TinyLlama(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=1024, initializer_range=0.2))


def tiny_deepseek_v2(root):
    """A 2-layer DeepSeek-V2 (MLA: kv_lora_rank 512 + qk_rope_head_dim 64 = 576, the only latent
    width vLLM's CPU MLA kernel takes; dense MLPs) with random fp32 weights under ``root``."""
    import json

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = str(root / "model")
    cfg = DeepseekV2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=512,
                           qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2,
                           n_routed_experts=4, moe_intermediate_size=64, num_experts_per_tok=2,
                           max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=False,
                           bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    with open(f"{path}/config.json", encoding="utf-8") as f:
        data = json.load(f)
    data["dtype"] = "float32"
    with open(f"{path}/config.json", "w", encoding="utf-8") as f:
        json.dump(data, f)
    return path


def make_manager(root, serve_args):
    """A ``ManagerProcess`` (not started) on a socket and token file under ``root`` (a fresh
    temporary directory); ``serve_args``: ``radixkv serve`` flags (model config, pool size)."""
    token_file = str(root / "token")
    with open(token_file, "w") as f:
        f.write(secrets.token_urlsafe(24))
    os.chmod(token_file, 0o600)
    sock = root / "mgr"
    sock.mkdir(mode=0o700)
    shm = root / "shm"
    shm.mkdir()
    return ManagerProcess(f"unix://{sock}/s.sock", token_file, str(shm), serve_args)


def connector_config(manager, namespace, **extra):
    """``kv_transfer_config`` kwargs of ``RadixKVConnector`` on ``manager`` (fast reconnects)."""
    cfg = {"address": manager.address, "token_file": manager.token_file, "retry_interval_s": 0.5,
           "connect_timeout_s": 1.0, "namespace": namespace, **extra}
    return dict(kv_connector="RadixKVConnector", kv_connector_module_path="radixkv.integrations.vllm",
                kv_role="kv_both", kv_connector_extra_config=cfg)


@contextlib.contextmanager
def running(engines, manager, start_manager=False):
    """For a module fixture: wait until ``engines`` (name -> ``EngineProcess``) are up
    (``start_manager``: then start ``manager``, which they reach in the background), and until
    each scheduler holds a session; yield; stop them all and check no engine process is left."""
    try:
        for e in engines.values():
            e.wait_ready()
        if start_manager:
            manager.start()
        wait_for_sessions(manager, sum(1 for e in engines.values() if "kv_transfer_config" in e.kwargs))
        yield
    finally:
        for e in engines.values():
            e.stop()
        manager.stop()
        left = {name: members(e.proc.pid) for name, e in engines.items()}
        assert not any(left.values()), f"engine processes left behind after stop: {left}"


def wait_for_sessions(manager, n, timeout_s=120.0):
    """Until ``n`` engine schedulers hold a session (they reconnect in the background)."""
    c = manager.client()
    deadline = time.monotonic() + timeout_s
    try:
        while c.stats().sessions < n:
            assert time.monotonic() < deadline, "the engines did not reconnect to the manager"
            time.sleep(0.2)
    finally:
        c.close()


def settled(manager, timeout_s=30.0):
    """Wait until the manager holds no live request: the engines' commits and releases are
    sent from a background thread after the step, so another engine sees them a moment
    after vLLM returned the output (with ``timeout_s``: a lost commit fails the test)."""
    deadline = time.monotonic() + timeout_s
    while (st := manager.client().stats()).requests and time.monotonic() < deadline:
        time.sleep(0.01)
    return st


def holds(manager, prompt, n, namespace, timeout_s=60.0):
    """Wait until the manager's tree holds ``n`` tokens of ``prompt`` in ``namespace`` (a
    deferred save lands after vLLM returned the output); a timeout fails the test."""
    c = manager.client()
    session = c.attach("probe").session
    try:
        q = MatchQuery(np.asarray(prompt, np.int32), f"vllm|{namespace}")
        deadline = time.monotonic() + timeout_s
        while c.match(session, [q])[0].prefix_len < n:
            assert time.monotonic() < deadline, f"the manager does not hold {n} tokens of the prompt"
            time.sleep(0.01)
    finally:
        c.detach(session)
        c.close()
