"""Package map: ``radixkv/`` installs as ``radixkv``, ``service/`` as ``radixkv.service``, the
wire schema ``proto/radixkv/v1/*.proto`` as data of ``radixkv.proto`` (for clients in other
languages: ``importlib.resources.files("radixkv.proto")``), and the optional C extension
``radixkv.cache._native`` (the RadixCache's compiled walks; the install goes on without it when
no C compiler is present, see radixkv/cache/native.py) and likewise ``radixkv.allocator._native``
(the KV allocators' checked free, see radixkv/allocator/native.py), ``radixkv.memory._native``
(the host tier's page copies on the CPU, see radixkv/memory/native.py), ``radixkv.storage._native``
(the file tier's page reads, see radixkv/storage/native.py), and
``radixkv.service.wire._sigbus`` (repairs a pool file shrunk under a process, see
service/wire/shm.py).

Everything else is declared in pyproject.toml.
"""
import platform
from pathlib import Path

from setuptools import Extension, find_packages, setup

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")  # xxh3's runtime dispatch
_lib = [p for p in find_packages(include=["radixkv", "radixkv.*"])]
_svc = ["radixkv.service"] + [
    "radixkv.service." + p for p in find_packages(where="service")
]

setup(
    packages=_lib + _svc + ["radixkv.proto"],
    package_dir={"radixkv": "radixkv", "radixkv.service": "service", "radixkv.proto": "proto/radixkv/v1"},
    package_data={"radixkv": ["data/**/*", "py.typed"], "radixkv.proto": ["*.proto"],
                  "radixkv.service.wire._gen": ["*.pyi"]},
    ext_modules=[Extension("radixkv.cache._native", ["radixkv/cache/csrc/module.c"],
                           depends=[str(p) for p in Path("radixkv/cache/csrc").glob("*.[ch]")],
                           extra_compile_args=["-O3"], optional=True),
                 Extension("radixkv.allocator._native", ["radixkv/allocator/csrc/free.c"],
                           extra_compile_args=["-O3"], optional=True),
                 Extension("radixkv.memory._native", ["radixkv/memory/csrc/pagecopy.c"],
                           extra_compile_args=["-O3"], optional=True),
                 Extension("radixkv.storage._native",
                           ["radixkv/storage/csrc/pageread.c", "radixkv/storage/csrc/xxhash.c"]
                           + (["radixkv/storage/csrc/xxh_x86dispatch.c"] if _X86 else []),
                           define_macros=[("XXHASH_X86_DISPATCH", "1")] if _X86 else [],
                           depends=[str(p) for p in Path("radixkv/storage/csrc").glob("*.h")],
                           extra_compile_args=["-O3"], optional=True),
                 Extension("radixkv.service.wire._sigbus", ["service/wire/csrc/sigbus.c"], optional=True)],
)
