"""Package map: ``radixkv/`` installs as ``radixkv`` and ``service/`` as ``radixkv.service``,
and the optional C extension ``radixkv.cache._native`` (the RadixCache's compiled walks; the
install goes on without it when no C compiler is present, see radixkv/cache/native.py).

Everything else is declared in pyproject.toml.
"""
from pathlib import Path

from setuptools import Extension, find_packages, setup

_lib = [p for p in find_packages(include=["radixkv", "radixkv.*"])]
_svc = ["radixkv.service"] + [
    "radixkv.service." + p for p in find_packages(where="service")
]

setup(
    packages=_lib + _svc,
    package_dir={"radixkv": "radixkv", "radixkv.service": "service"},
    package_data={"radixkv": ["data/**/*", "py.typed"], "radixkv.service": ["*.proto"]},
    ext_modules=[Extension("radixkv.cache._native", ["radixkv/cache/csrc/module.c"],
                           depends=[str(p) for p in Path("radixkv/cache/csrc").glob("*.[ch]")],
                           extra_compile_args=["-O3"], optional=True)],
)
