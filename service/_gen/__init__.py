"""Code generated from proto/radixkv/v1 (see radixkv.service.protogen)."""
