"""The RadixCache's eviction policies, one module per concept:

* :mod:`~radixkv.cache.policies.base`   the interface (:class:`EvictionPolicy`, its contract)
  and the classic policies lru, lfu, fifo, filo, mru, priority;
* :mod:`~radixkv.cache.policies.slru`   segmented LRU with a ghost of evicted signatures;
* :mod:`~radixkv.cache.policies.aplru`  adaptive-probation LRU (the research policy's port).

Importing a module here registers nothing: :mod:`radixkv.cache.eviction` names every
built-in policy in one table.
"""
