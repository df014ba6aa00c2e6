"""Package map: ``radixkv/`` installs as ``radixkv`` and ``service/`` as ``radixkv.service``.

Everything else is declared in pyproject.toml.
"""
from setuptools import find_packages, setup

_lib = [p for p in find_packages(include=["radixkv", "radixkv.*"])]
_svc = ["radixkv.service"] + [
    "radixkv.service." + p for p in find_packages(where="service")
]

setup(
    packages=_lib + _svc,
    package_dir={"radixkv": "radixkv", "radixkv.service": "service"},
    package_data={"radixkv": ["data/**/*", "py.typed"], "radixkv.service": ["*.proto"]},
)
