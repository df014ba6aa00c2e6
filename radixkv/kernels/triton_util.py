"""Whether Triton is importable, and whether a given device should use the Triton path.

Triton reads ``TRITON_INTERPRET`` when a kernel is *decorated*, so tests that run Triton
kernels on CPU set ``TRITON_INTERPRET=1`` before importing radixkv (see tests/conftest.py).
"""
from __future__ import annotations

import os

import torch

# ``triton`` and ``tl`` are re-exported for the kernel modules (None without Triton). Triton
# ships no type information, so mypy sees both as ``Any`` (pyproject.toml).
__all__ = ["HAS_TRITON", "interpret_mode", "tl", "triton", "triton_runnable", "use_triton"]

try:  # triton is an optional dependency outside Linux x86_64
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the platform
    triton = None
    tl = None
    HAS_TRITON = False


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device | str) -> bool:
    """Default dispatch: the Triton path on CUDA (when Triton is present), torch elsewhere."""
    return HAS_TRITON and torch.device(device).type == "cuda"


def triton_runnable(device: torch.device | str) -> bool:
    """True when a Triton kernel can be launched on tensors of ``device`` at all
    (on CUDA, or anywhere under the interpreter)."""
    if not HAS_TRITON:
        return False
    return torch.device(device).type == "cuda" or interpret_mode()
