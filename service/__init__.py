"""radixkv.service: the gRPC cache manager and its worker client (installed as ``radixkv.service``).

Three subpackages, and the direction between them shows in the imports:

* :mod:`radixkv.service.wire`   what both ends share: the generated messages, their conversion
  to and from the engine's types, the error mapping, the auth token, the shared-memory
  descriptors, the Step stream's message forms. Imports neither side.
* :mod:`radixkv.service.server` the cache manager (``radixkv serve``): server, servicer, event
  hub, quarantine, reply cache, metrics. Imports ``wire`` and the engine, never ``client``.
* :mod:`radixkv.service.client` the worker's side (``connect()``, ``RemoteCacheEngine``).
  Imports ``wire`` only: importing it loads no server, engine, tree or metrics code.
"""
