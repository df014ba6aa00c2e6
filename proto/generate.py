"""Regenerate the committed gRPC code in ``service/wire/_gen/`` from ``proto/radixkv/v1/*.proto``.

The generated modules are committed (so an installed radixkv needs ``grpcio`` and
``protobuf`` only, not ``grpcio-tools``); ``tests/service/test_proto_gen.py`` regenerates them
into a temporary directory and fails when the committed copies differ (stale).

Run ``make proto`` (``python proto/generate.py``) after editing a ``.proto`` file. A dev tool:
it is not part of the installed package.

Generation: ``grpc_tools.protoc -I proto --python_out --pyi_out --grpc_python_out
--mypy_grpc_out`` (the last, mypy-protobuf's plugin, types the stub: ``*_pb2_grpc.pyi``), then
one rewrite: the ``*_pb2_grpc`` modules import their ``*_pb2`` module by the proto path
(``from radixkv.v1 import ...``); it is made a relative import (``from . import ...``)
so the code lives in the ``radixkv.service.wire._gen`` package while the descriptors keep their
proto file names (``radixkv/v1/cache_manager.proto``), which reflection serves.
"""
from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
GEN_DIR = REPO_ROOT / "service" / "wire" / "_gen"
PROTO_FILES = ("radixkv/v1/cache_manager.proto",)

_HEADER = "# Generated from proto/{src} by `make proto` (proto/generate.py). Do not edit.\n"


def generate() -> dict[str, str]:
    """Generate every module; returns ``{file name in _gen/: text}``.

    Raises:
        RuntimeError: ``grpc_tools`` is missing or ``protoc`` failed.
    """
    try:
        import grpc_tools
        from grpc_tools import protoc  # dev dependency (grpcio-tools)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("regenerating the gRPC code needs grpcio-tools") from e
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    plugin = _mypy_grpc_plugin()
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for src in PROTO_FILES:
            rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
                              f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                              f"--plugin=protoc-gen-mypy_grpc={plugin}", f"--mypy_grpc_out={tmp}",
                              str(PROTO_ROOT / src)])
            if rc != 0:
                raise RuntimeError(f"protoc failed on {src} (exit {rc})")
            stem = Path(src).with_suffix("")
            pkg = ".".join(stem.parent.parts)  # radixkv.v1
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
                path = Path(tmp) / (str(stem) + suffix)
                text = path.read_text()
                if suffix.startswith("_pb2_grpc"):
                    text = re.sub(rf"^from {re.escape(pkg)} import ", "from . import ", text, flags=re.M)
                out[stem.name + suffix] = _HEADER.format(src=src) + text
    return out


def _mypy_grpc_plugin() -> str:
    """mypy-protobuf's ``protoc-gen-mypy_grpc``: beside this interpreter (a virtualenv's
    ``bin/``, which need not be on ``PATH``), else on ``PATH``."""
    beside = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    found = str(beside) if beside.exists() else shutil.which("protoc-gen-mypy_grpc")
    if found is None:
        raise RuntimeError("regenerating the gRPC code needs mypy-protobuf (protoc-gen-mypy_grpc)")
    return found


def write(target: Path = GEN_DIR) -> list[str]:
    """Write the generated modules (and the package ``__init__``) into ``target``; returns
    their names."""
    target.mkdir(parents=True, exist_ok=True)
    modules = generate()
    for name, text in modules.items():
        (target / name).write_text(text)
    init = target / "__init__.py"
    if not init.exists():
        init.write_text('"""Code generated from proto/radixkv/v1 (see proto/generate.py, `make proto`)."""\n')
    return sorted(modules)


def main() -> int:
    names = write()
    print(f"regenerated {', '.join(names)} in {GEN_DIR.relative_to(REPO_ROOT)}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
