"""radixkv.service: the gRPC cache manager and its worker client (installed as ``radixkv.service``)."""
