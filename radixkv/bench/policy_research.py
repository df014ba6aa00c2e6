"""Scan-resistant baselines and research candidates for :mod:`blocksim` (leaf-only
eviction): one import that registers them all with :func:`radixkv.bench.blocksim.register`
and re-exports them (``blocksim.make_policy`` imports this module).

* queue baselines ``slru``, ``2q``, ``s3fifo``, ``arc``, ``wtinylfu``:
  :mod:`radixkv.bench.queue_baselines` (machinery: :mod:`radixkv.bench.queue_policies`);
* research candidates ``lru2``, ``probation``, ``aplru`` (recommended):
  :mod:`radixkv.bench.history_policies`;
* ``odlru`` (aplru with bonuses that expire when a block is overdue; tried, not better):
  :mod:`radixkv.bench.overdue_policy`.

See ``docs/hitrate.md`` for their hit rates and the research notes.
"""
from __future__ import annotations

from radixkv.bench.block_policy import grow_array as _grow  # noqa: F401  (kept for old imports)
from radixkv.bench.blocksim import register
from radixkv.bench.history_policies import LRU2, AdaptiveProbationLRU, Probation
from radixkv.bench.overdue_policy import OverdueAPLRU
from radixkv.bench.queue_baselines import ARC, S3FIFO, SLRU, TwoQ, WTinyLFU
from radixkv.bench.queue_policies import Ghost, QueuePolicy

__all__ = ["Ghost", "QueuePolicy", "SLRU", "TwoQ", "S3FIFO", "ARC", "WTinyLFU",
           "LRU2", "Probation", "AdaptiveProbationLRU", "OverdueAPLRU"]

for _cls in (SLRU, TwoQ, S3FIFO, ARC, WTinyLFU, LRU2, Probation, AdaptiveProbationLRU, OverdueAPLRU):
    register(_cls.name, _cls)
