"""The committed generated code in service/wire/_gen/ matches the .proto files (fails when stale)."""
import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="regenerating the gRPC code needs grpcio-tools (dev extra)")


def _load_generator():
    """proto/generate.py (a dev tool, not an installed module), loaded from the checkout."""
    path = Path(__file__).resolve().parents[2] / "proto" / "generate.py"
    spec = importlib.util.spec_from_file_location("radixkv_proto_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


protogen = _load_generator()


def test_generated_code_is_fresh():
    fresh = protogen.generate()
    assert set(fresh) == {"cache_manager_pb2.py", "cache_manager_pb2.pyi", "cache_manager_pb2_grpc.py",
                          "cache_manager_pb2_grpc.pyi"}
    stale = [name for name, text in fresh.items()
             if not (protogen.GEN_DIR / name).exists() or (protogen.GEN_DIR / name).read_text() != text]
    assert not stale, f"service/wire/_gen/ is stale for {stale}: run `make proto`"


@pytest.mark.parametrize("name", ["cache_manager_pb2_grpc.py", "cache_manager_pb2_grpc.pyi"])
def test_grpc_module_imports_its_messages_relatively(name):
    text = (protogen.GEN_DIR / name).read_text()
    assert "from . import cache_manager_pb2" in text and "from radixkv.v1 import" not in text


def test_every_protocol_call_has_an_rpc():
    from radixkv.service.wire._gen import cache_manager_pb2 as pb

    methods = set(pb.DESCRIPTOR.services_by_name["CacheManager"].methods_by_name)
    want = {"Attach", "Heartbeat", "KeepAlive", "Detach", "Match", "AllocExtend", "AllocDecode",
            "CacheUnfinished", "CacheFinished", "Release", "Evict", "Stats", "Flush", "TakeEvents",
            "WatchEvents", "CheckInvariants"}
    assert want <= methods, want - methods
    assert pb.DESCRIPTOR.name == "radixkv/v1/cache_manager.proto"
    assert Path(protogen.PROTO_ROOT / pb.DESCRIPTOR.name).is_file()


def test_no_repeated_varint_arrays():
    """Token and index arrays are packed bytes fields, never repeated ints."""
    from google.protobuf.descriptor import FieldDescriptor
    from radixkv.service.wire._gen import cache_manager_pb2 as pb

    bad = []
    for msg in pb.DESCRIPTOR.message_types_by_name.values():
        for f in msg.fields:
            if f.is_repeated and f.type != FieldDescriptor.TYPE_MESSAGE \
                    and f.type != FieldDescriptor.TYPE_STRING:
                bad.append(f"{msg.name}.{f.name}")
            if f.name.endswith(("_i32", "_i64", "_u64")) and f.type != FieldDescriptor.TYPE_BYTES:
                bad.append(f"{msg.name}.{f.name}")
    assert not bad, bad


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())


def _requirement(reqs: list[str], name: str) -> str:
    from packaging.requirements import Requirement

    found = [Requirement(r) for r in reqs if Requirement(r).name == name]
    assert len(found) == 1, f"{name} must be listed once, found {found}"
    return str(found[0].specifier)


def test_generator_pin_is_the_runtime_floor():
    """The generator is pinned (its output is committed, so a newer release on the registry must
    not make a fresh clone stale), and at the grpcio floor that the generated code checks at
    import (``GRPC_GENERATED_VERSION``): a runtime the floor admits can import the code."""
    project = _pyproject()["project"]
    pin = _requirement(project["optional-dependencies"]["dev"], "grpcio-tools")
    floor = _requirement(project["dependencies"], "grpcio")
    assert pin.startswith("==") and floor.startswith(">="), (pin, floor)
    generated = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$",
                          (protogen.GEN_DIR / "cache_manager_pb2_grpc.py").read_text(), re.M)
    assert generated is not None
    assert pin[2:] == floor[2:] == generated.group(1), (pin, floor, generated.group(1))
