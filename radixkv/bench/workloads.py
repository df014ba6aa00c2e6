"""Seeded synthetic request streams with the prefix structures LLM serving sees.

Each generator returns a :class:`Workload`: prompts as int32 token arrays (random ids in
``[1, vocab)``) plus output lengths, fully determined by ``seed``
(``numpy.random.default_rng``). Registry :data:`WORKLOADS` (``--workload NAME``):

* ``system-prompt``   a few shared system prompts (Zipf popularity) + a user message;
* ``multi-turn``      interleaved chats: each turn's prompt is the previous prompt + the
  previous answer + a new user message;
* ``few-shot``        task prefixes of k examples (Zipf over tasks) + a query;
* ``tree-of-thought`` problems expanded breadth-first: each node's prompt extends its
  parent's with one thought (branching ``b``, depth ``d``);
* ``agent``           concurrent agent loops: system + task, then (action, tool output)
  steps appended until the task ends.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from radixkv.errors import InvalidArgumentError

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.traces import BlockTrace

#: A length range ``(lo, hi)`` in tokens, both ends included.
LenRange = tuple[int, int]

__all__ = ["Workload", "WORKLOADS", "make_workload", "unique_prefix_tokens", "random_block_trace",
           "system_prompt", "multi_turn", "few_shot", "tree_of_thought", "agent"]

VOCAB = 32000


class Workload(NamedTuple):
    """A generated stream: ``requests[i]`` (int32 prompt) and ``output_lens[i]``."""

    name: str
    seed: int
    requests: list[np.ndarray]
    output_lens: np.ndarray

    @property
    def prompt_tokens(self) -> int:
        return int(sum(len(r) for r in self.requests))

    @property
    def unique_tokens(self) -> int:
        return unique_prefix_tokens(self.requests)


def unique_prefix_tokens(requests: Sequence[np.ndarray]) -> int:
    """Distinct prompt prefixes = nodes of the token trie = sum over the lexicographically
    sorted prompts of ``len - lcp(previous)``. O(total tokens) numpy + one sort of keys.

    Raises:
        InvalidArgumentError: a token outside ``[0, 2**31)`` (the sort key needs it).
    """
    keys = []
    for i, r in enumerate(requests):
        if len(r) and int(r.min()) < 0:
            raise InvalidArgumentError(f"request {i} has negative token ids")
        keys.append((r.astype(">i4").tobytes(), i))
    keys.sort()
    total = 0
    prev: np.ndarray | None = None
    for _, i in keys:
        cur = requests[i]
        if prev is None:
            total += len(cur)
        else:
            m = min(len(cur), len(prev))
            diff = np.flatnonzero(cur[:m] != prev[:m])
            lcp = int(diff[0]) if len(diff) else m
            total += len(cur) - lcp
        prev = cur
    return total


def _toks(rng: np.random.Generator, lo: int, hi: int) -> np.ndarray:
    return rng.integers(1, VOCAB, size=int(rng.integers(lo, hi + 1)), dtype=np.int32)


def _zipf_choice(rng: np.random.Generator, n: int, a: float, size: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** a
    return rng.choice(n, size=size, p=w / w.sum())


def _check(n_requests: int) -> int:
    if int(n_requests) < 1:
        raise InvalidArgumentError(f"n_requests must be >= 1, got {n_requests}")
    return int(n_requests)


def system_prompt(n_requests: int = 2000, seed: int = 0, n_prompts: int = 4, system_len: LenRange = (512, 2048),
                  user_len: LenRange = (16, 512), output_len: LenRange = (16, 512), zipf_a: float = 1.0) -> Workload:
    """Requests = one of ``n_prompts`` system prompts (Zipf popularity) + a fresh message."""
    n = _check(n_requests)
    rng = np.random.default_rng(seed)
    systems = [_toks(rng, *system_len) for _ in range(n_prompts)]
    pick = _zipf_choice(rng, n_prompts, zipf_a, size=n)
    reqs = [np.concatenate([systems[p], _toks(rng, *user_len)]) for p in pick]
    outs = rng.integers(output_len[0], output_len[1] + 1, size=n)
    return Workload("system-prompt", seed, reqs, outs.astype(np.int64))


def multi_turn(n_requests: int = 2000, seed: int = 0, system_len: LenRange = (256, 1024),
               user_len: LenRange = (16, 512), output_len: LenRange = (32, 512), mean_turns: float = 5.0,
               active: int = 32) -> Workload:
    """Interleaved chats: about ``active`` conversations in flight; each step continues a
    random one (prompt = previous prompt + previous answer + new message) or, when it ends
    (probability ``1/mean_turns`` per turn), a new one starts with the shared system prompt."""
    n = _check(n_requests)
    rng = np.random.default_rng(seed)
    system = _toks(rng, *system_len)
    convs: list[np.ndarray | None] = [None] * active
    reqs, outs = [], []
    for _ in range(n):
        c = int(rng.integers(active))
        if convs[c] is None or rng.random() < 1.0 / mean_turns:
            prompt = np.concatenate([system, _toks(rng, *user_len)])
        else:
            prompt = np.concatenate([convs[c], _toks(rng, *user_len)])
        out = _toks(rng, *output_len)
        reqs.append(prompt)
        outs.append(len(out))
        convs[c] = np.concatenate([prompt, out])
    return Workload("multi-turn", seed, reqs, np.asarray(outs, np.int64))


def few_shot(n_requests: int = 2000, seed: int = 0, n_tasks: int = 24, shots: int = 8,
             shot_len: LenRange = (64, 256), query_len: LenRange = (16, 128), output_len: LenRange = (8, 128),
             zipf_a: float = 1.1) -> Workload:
    """Requests = a task's instruction + ``shots`` examples (task by Zipf) + a query."""
    n = _check(n_requests)
    rng = np.random.default_rng(seed)
    prefixes = [np.concatenate([_toks(rng, 32, 128)] + [_toks(rng, *shot_len) for _ in range(shots)])
                for _ in range(n_tasks)]
    pick = _zipf_choice(rng, n_tasks, zipf_a, size=n)
    reqs = [np.concatenate([prefixes[t], _toks(rng, *query_len)]) for t in pick]
    outs = rng.integers(output_len[0], output_len[1] + 1, size=n)
    return Workload("few-shot", seed, reqs, outs.astype(np.int64))


def tree_of_thought(n_requests: int = 2000, seed: int = 0, branching: int = 3, depth: int = 4,
                    problem_len: LenRange = (256, 1024), thought_len: LenRange = (32, 256),
                    output_len: LenRange = (32, 256)) -> Workload:
    """Problems expanded breadth-first to ``depth``: a node's prompt is its parent's plus one
    thought; a new problem starts when the previous tree is complete."""
    n = _check(n_requests)
    rng = np.random.default_rng(seed)
    reqs: list[np.ndarray] = []
    while len(reqs) < n:
        level = [_toks(rng, *problem_len)]
        reqs.append(level[0])
        for _ in range(depth):
            nxt = []
            for node in level:
                for _ in range(branching):
                    child = np.concatenate([node, _toks(rng, *thought_len)])
                    nxt.append(child)
                    reqs.append(child)
            level = nxt
    reqs = reqs[:n]
    outs = rng.integers(output_len[0], output_len[1] + 1, size=n)
    return Workload("tree-of-thought", seed, reqs, outs.astype(np.int64))


def agent(n_requests: int = 2000, seed: int = 0, n_agents: int = 8, system_len: LenRange = (1024, 2048),
          task_len: LenRange = (64, 512), action_len: LenRange = (16, 128), tool_len: LenRange = (64, 2048),
          mean_steps: float = 10.0) -> Workload:
    """``n_agents`` concurrent loops sharing one system prompt; each step appends the
    previous action and its tool output; a task ends with probability ``1/mean_steps``."""
    n = _check(n_requests)
    rng = np.random.default_rng(seed)
    system = _toks(rng, *system_len)
    state: list[np.ndarray | None] = [None] * n_agents
    reqs, outs = [], []
    for _ in range(n):
        a = int(rng.integers(n_agents))
        if state[a] is None or rng.random() < 1.0 / mean_steps:
            prompt = np.concatenate([system, _toks(rng, *task_len)])
        else:
            prompt = np.concatenate([state[a], _toks(rng, *tool_len)])
        action = _toks(rng, *action_len)
        reqs.append(prompt)
        outs.append(len(action))
        state[a] = np.concatenate([prompt, action])
    return Workload("agent", seed, reqs, np.asarray(outs, np.int64))


def random_block_trace(n_requests: int, n_blocks: int, seed: int = 0, block_size: int = 4,
                       partial: bool = True, zipf_a: float = 0.0) -> BlockTrace:
    """A random chained block stream (for tests and policy stress): a random tree of
    ``n_blocks`` blocks (each block's parent drawn among earlier ones or the root); every
    request is the path root -> a random block (uniform, or Zipf(``zipf_a``) when > 0).
    With ``partial`` some childless blocks are shorter than ``block_size`` (request tails).
    Returns a validated :class:`~radixkv.bench.traces.BlockTrace`."""
    from radixkv.bench.traces import BlockTrace

    _check(n_requests)
    if n_blocks < 1 or block_size < 1:
        raise InvalidArgumentError("n_blocks and block_size must be >= 1")
    rng = np.random.default_rng(seed)
    parent = np.array([int(rng.integers(-1, i)) if i else -1 for i in range(n_blocks)], dtype=np.int64)
    has_child = np.zeros(n_blocks, dtype=bool)
    has_child[parent[parent >= 0]] = True
    length = np.full(n_blocks, block_size, dtype=np.int64)
    if partial and block_size > 1:
        short = ~has_child & (rng.random(n_blocks) < 0.5)
        length[short] = rng.integers(1, block_size, size=int(short.sum()))
    if zipf_a > 0:
        ends = _zipf_choice(rng, n_blocks, zipf_a, size=n_requests)
        ends = rng.permutation(n_blocks)[ends]
    else:
        ends = rng.integers(0, n_blocks, size=n_requests)
    ids: list[int] = []
    lens: list[int] = []
    off = [0]
    for v in ends:
        path = []
        while v >= 0:
            path.append(int(v))
            v = parent[v]
        path.reverse()
        ids.extend(path)
        lens.extend(int(length[b]) for b in path)
        off.append(len(ids))
    return BlockTrace.from_chains(np.asarray(ids, np.int64), np.asarray(off, np.int64),
                                  np.asarray(lens, np.int64), block_size)


#: ``--workload`` name -> generator ``(n_requests, seed, **params) -> Workload``.
WORKLOADS: dict[str, Callable[..., Workload]] = {
    "system-prompt": system_prompt,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "tree-of-thought": tree_of_thought,
    "agent": agent,
}


def make_workload(name: str, n_requests: int | None = None, seed: int = 0, **params: object) -> Workload:
    """Generate a registered workload (``n_requests`` defaults to the generator's).

    Raises:
        InvalidArgumentError: an unknown name (the message lists the known ones).
    """
    gen = WORKLOADS.get(name)
    if gen is None:
        raise InvalidArgumentError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    if n_requests is not None:
        params["n_requests"] = n_requests
    return gen(seed=seed, **params)
