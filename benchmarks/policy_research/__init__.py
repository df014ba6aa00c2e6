"""Block-level eviction-policy research for the simulator of :mod:`radixkv.bench.blocksim`
(leaf-only eviction): policies the RadixCache does not run, the oracles, and their registry.

* queue baselines ``slru``, ``2q``, ``s3fifo``, ``arc``, ``wtinylfu``:
  :mod:`policy_research.queue_baselines` (machinery: :mod:`policy_research.queue_policies`);
* research candidates ``lru2``, ``probation``, ``aplru`` (the design the RadixCache's
  ``aplru`` was ported from): :mod:`policy_research.history_policies`;
* ``odlru`` (aplru with bonuses that expire when a block is overdue; tried, not better):
  :mod:`policy_research.overdue_policy`;
* the oracles ``oracle-reuse`` / ``oracle-popularity`` (they read the trace's future):
  :mod:`policy_research.oracles`.

:data:`RESEARCH_POLICIES` names them, in this one place; :func:`make_block_policy` looks a
name up there first, then among the RadixCache's policies that the simulator runs (lru,
lfu, fifo, ...). So here ``slru`` and ``aplru`` are the block-level designs of the tables
in ``docs/hitrate.md``, not the RadixCache's policies of the same names.

Import this package with ``benchmarks/`` on ``sys.path`` (``benchmarks/bench_policies.py``
and the tests do). See ``docs/hitrate.md`` for the hit rates and the research notes.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from policy_research.history_policies import LRU2, AdaptiveProbationLRU, Probation
from policy_research.overdue_policy import OverdueAPLRU
from policy_research.queue_baselines import ARC, S3FIFO, SLRU, TwoQ, WTinyLFU
from policy_research.queue_policies import Ghost, QueuePolicy
from radixkv.bench.block_policy import BlockPolicy
from radixkv.bench.blocksim import available_policies, make_policy

__all__ = ["Ghost", "QueuePolicy", "SLRU", "TwoQ", "S3FIFO", "ARC", "WTinyLFU",
           "LRU2", "Probation", "AdaptiveProbationLRU", "OverdueAPLRU",
           "RESEARCH_POLICIES", "make_block_policy", "available_block_policies"]

#: name -> zero-argument factory of a block-level research policy (read-only).
RESEARCH_POLICIES: Mapping[str, Callable[[], BlockPolicy]] = MappingProxyType({
    cls.name: cls
    for cls in (SLRU, TwoQ, S3FIFO, ARC, WTinyLFU, LRU2, Probation, AdaptiveProbationLRU, OverdueAPLRU)
})


def make_block_policy(policy: str | BlockPolicy) -> BlockPolicy:
    """A fresh simulator policy: a research policy by name, else the RadixCache policy of
    that name run on blocks (:func:`radixkv.bench.blocksim.make_policy`).

    Raises:
        InvalidArgumentError: a name that is neither.
    """
    if isinstance(policy, str):
        factory = RESEARCH_POLICIES.get(policy.strip().lower())
        if factory is not None:
            return factory()
    return make_policy(policy)


def available_block_policies() -> list[str]:
    """Every name :func:`make_block_policy` accepts, sorted."""
    return sorted(set(RESEARCH_POLICIES) | set(available_policies()))
