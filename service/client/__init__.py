"""The worker's side: ``connect()`` a cache manager and use it as a ``RemoteCacheEngine``.

Imports :mod:`radixkv.service.wire` only (never the server, the embedded engine, the trees
or prometheus_client), so a worker process stays light; ``tests/service/test_light_client.py``
checks it.
"""
from radixkv.service.client.remote import RemoteCacheEngine, connect

__all__ = ["RemoteCacheEngine", "connect"]
