"""What the manager and its workers share on the wire (imports neither side).

* ``_gen``        the generated protobuf/gRPC modules (``make proto`` regenerates them)
* ``codec``       numpy arrays and protocol NamedTuples <-> messages
* ``events``      the event stream's messages (numbered events, state events, gap markers)
* ``errors``      ``radixkv.errors`` <-> gRPC status codes, in one place
* ``auth``        the auth token: where it comes from and how it travels
* ``shm``         shared pool buffers: descriptors, created by the manager, mapped by workers
* ``step``        the Step stream's method table and error form
* ``request_id``  the idempotency key a call may carry
* ``transport``   message size limit, ``unix:`` addresses, PEM files
"""
