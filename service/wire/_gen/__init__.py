"""Code generated from proto/radixkv/v1 (see proto/generate.py, `make proto`)."""
