"""What the vLLM end-to-end tests (``tests/vllm``) share: a manager on a private Unix socket,
the connector's ``kv_transfer_config``, and waits on the manager (sessions, settled requests,
a prompt held in the tree). Imports vLLM nowhere (the engines run in their own processes)."""
import os
import random
import secrets
import time

import numpy as np
from vllm_harness import ManagerProcess
from vllm_model import TinyLlama, make_tiny_llama

from radixkv.engine.protocol import MatchQuery

__all__ = ["tokens", "tiny_llama", "make_manager", "connector_config", "wait_for_sessions", "settled", "holds"]


def tokens(seed, n):
    rnd = random.Random(seed)
    return [rnd.randrange(3, 512) for _ in range(n)]


def tiny_llama(root, kv_heads):
    """A 2-layer Llama with random fp32 weights under ``root`` (head_dim 64, 2 attention heads,
    ``kv_heads`` KV heads; init range 0.2, so the greedy output depends on the whole prompt)."""
    return make_tiny_llama(str(root / "model"), TinyLlama(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=1024, initializer_range=0.2))


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
