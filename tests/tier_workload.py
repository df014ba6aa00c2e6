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
