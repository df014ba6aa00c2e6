"""Hit-rate studies of prefix caches: traces, synthetic workloads, a block-level simulator
with pluggable eviction policies, the offline (Belady) bound and the replay CLI.

* :mod:`radixkv.bench.traces`           Mooncake JSONL loading, pseudo-tokens, block view
* :mod:`radixkv.bench.workloads`        seeded synthetic request streams (``--workload``)
* :mod:`radixkv.bench.blocksim`         leaf-only block simulator and its policy registry
* :mod:`radixkv.bench.block_policy`     the simulator's policy interface, LRU / FIFO / LFU
* :mod:`radixkv.bench.queue_policies`   queue machinery (per-queue leaf heaps, ghosts)
* :mod:`radixkv.bench.queue_baselines`  SLRU, 2Q, S3-FIFO, ARC, W-TinyLFU
* :mod:`radixkv.bench.history_policies` research candidates LRU-2, probation, aplru
* :mod:`radixkv.bench.overdue_policy`   research candidate odlru (expiring bonus; not better)
* :mod:`radixkv.bench.policy_research`  registers (and re-exports) all of the above
* :mod:`radixkv.bench.belady`           farthest-next-use offline bound
* :mod:`radixkv.bench.hitrate`          replay driver, engine adapters, ``bench hitrate`` CLI
* :mod:`radixkv.bench.radix_engine`     the real RadixCache as a replay engine (``--engine radix``)
* :mod:`radixkv.bench.hybrid_hitrate`   KV + Mamba-state replay through the MambaRadixCache
* :mod:`radixkv.bench.hybrid_report`    ``bench hitrate --hybrid``: grid, JSON, tables, plot
* :mod:`radixkv.bench.cluster`          N managers behind a KV-aware router (``bench cluster``)
* :mod:`radixkv.bench.cli`              ``radixkv bench``: one front door for every benchmark
"""
