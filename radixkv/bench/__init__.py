"""Hit-rate studies of prefix caches: traces, synthetic workloads, a block-level simulator
with pluggable eviction policies, the offline (Belady) bound and the replay CLI.

* :mod:`radixkv.bench.traces`           Mooncake JSONL loading, pseudo-tokens, block view
* :mod:`radixkv.bench.workloads`        seeded synthetic request streams (``--workload``)
* :mod:`radixkv.bench.blocksim`         leaf-only block simulator, LRU / FIFO / LFU
* :mod:`radixkv.bench.policy_research`  SLRU, 2Q, S3-FIFO, ARC, W-TinyLFU, research candidates
* :mod:`radixkv.bench.belady`           farthest-next-use offline bound
* :mod:`radixkv.bench.hitrate`          replay driver, engine adapters, ``bench hitrate`` CLI
* :mod:`radixkv.bench.radix_engine`     the real RadixCache as a replay engine (``--engine radix``)
* :mod:`radixkv.bench.cluster`          N managers behind a KV-aware router (``bench cluster``)
* :mod:`radixkv.bench.cli`              ``radixkv bench``: one front door for every benchmark
"""
