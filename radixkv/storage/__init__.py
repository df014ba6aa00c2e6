"""The storage tier (L3): page keys and the backends behind ``radixkv.contracts.StorageBackend``.

Bookkeeping-free: a backend stores and returns whole pages by key; which pages go where is the
tier controller's business. Imports only ``errors``, ``validation`` and ``contracts``.
"""
from radixkv.storage.keys import STORAGE_KEY_VERSION, layout_fingerprint, page_keys, storage_seed

__all__ = ["STORAGE_KEY_VERSION", "layout_fingerprint", "page_keys", "storage_seed"]
