"""Hit-rate studies of prefix caches: traces, synthetic workloads, a block-level simulator
with pluggable eviction policies, the offline (Belady) bound and the replay CLI.

``traces`` (Mooncake JSONL), ``workloads`` (seeded synthetic streams), ``blocksim`` and
``block_policy`` (the leaf-only block simulator and its policies), ``belady`` (the offline
bound), ``hitrate`` (replay driver and ``bench hitrate``), ``radix_engine`` (the real
RadixCache as a replay engine), ``hybrid_hitrate`` / ``hybrid_report`` (KV + state replay,
``--hybrid``), ``cluster`` (``bench cluster``), ``cli`` (``radixkv bench``). Policy research
the RadixCache does not run is in ``benchmarks/policy_research`` of a source checkout. The
map and how each replay works: ``docs/hitrate.md``, "Inside the replays".
"""
