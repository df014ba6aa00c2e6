"""``from radixkv import RadixCache, ...``: the main public classes at the top level, loaded
lazily so that ``import radixkv`` stays cheap (no torch, no gRPC, no tree)."""
import subprocess
import sys

import pytest

import radixkv

HEAVY = ("torch", "grpc", "numpy", "radixkv.cache", "radixkv.engine", "radixkv.service", "prometheus_client")


def test_import_radixkv_is_light():
    code = ("import sys, radixkv\n"
            f"heavy = [m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r}"
            " or any(m.startswith(h + '.') for h in " + repr(HEAVY) + ")]\n"
            "print(radixkv.__version__)\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name, module", sorted(radixkv._LAZY.items()))
def test_every_public_name_resolves_to_its_layer(name, module):
    import importlib

    assert getattr(radixkv, name) is getattr(importlib.import_module(module), name)
    assert name in radixkv.__all__ and name in dir(radixkv)


def test_the_main_classes_import_from_the_top():
    from radixkv import (  # noqa: F401
        CacheEngine,
        EngineConfig,
        MambaRadixCache,
        RadixCache,
        RadixKey,
        ReqToTokenPool,
        TokenToKVPoolAllocator,
        connect,
    )

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        radixkv.Nope  # noqa: B018
