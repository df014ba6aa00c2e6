"""Device kernels: each written once in torch (the reference, used on CPU) and once in Triton
(used on CUDA; tested on CPU under ``TRITON_INTERPRET=1`` against the torch reference)."""
