"""Hit-rate studies of prefix caches: traces, synthetic workloads, a block-level simulator
with pluggable eviction policies, the offline (Belady) bound and the replay CLI.

* :mod:`radixkv.bench.traces`           Mooncake JSONL loading, pseudo-tokens, block view
* :mod:`radixkv.bench.workloads`        seeded synthetic request streams (``--workload``)
* :mod:`radixkv.bench.blocksim`         leaf-only block simulator (RadixCache policy names)
* :mod:`radixkv.bench.block_policy`     the simulator's policy interface; ``TreePolicy`` runs
                                        the RadixCache's own policy objects on blocks
* :mod:`radixkv.bench.belady`           farthest-next-use offline bound
* :mod:`radixkv.bench.hitrate`          replay driver, engine adapters, ``bench hitrate`` CLI
* :mod:`radixkv.bench.radix_engine`     the real RadixCache as a replay engine (``--engine radix``)
* :mod:`radixkv.bench.hybrid_hitrate`   KV + Mamba-state replay through the MambaRadixCache
* :mod:`radixkv.bench.hybrid_report`    ``bench hitrate --hybrid``: grid, JSON, tables, plot
* :mod:`radixkv.bench.cluster`          N managers behind a KV-aware router (``bench cluster``)
* :mod:`radixkv.bench.router_index`     the router's KV prefix index (Dynamo's, or a Python one)
* :mod:`radixkv.bench.state_router`     a router index crediting only state-backed prefixes (hybrid)
* :mod:`radixkv.bench.cli`              ``radixkv bench``: hitrate and cluster (the rest: benchmarks/)

Block-level policy research the RadixCache does not run (queue baselines, history
policies, odlru, oracles) is in ``benchmarks/policy_research`` of a source checkout
(``benchmarks/bench_policies.py``).
"""
