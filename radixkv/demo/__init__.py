"""``radixkv demo``: the main job, end to end (a cache manager and worker processes running
the reference hybrid model over a bundled trace, every logit checked).

* :mod:`~radixkv.demo.job`: the parent side: start the manager, spawn the workers, show
  progress, report, check the manager's invariants; ``--embedded`` and ``--walkthrough``;
* :mod:`~radixkv.demo.workers`: the worker side: the model through the cache-engine
  protocol, checked against a from-scratch forward.
"""
