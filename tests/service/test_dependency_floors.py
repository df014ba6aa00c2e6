"""pyproject.toml's protobuf and grpcio floors are the versions the committed generated code
demands: ``*_pb2.py`` refuses a protobuf runtime older than the protobuf it was generated with
(``ValidateProtobufRuntimeVersion``; an older major is refused outright), ``*_pb2_grpc.py``
refuses a grpcio older than the grpcio-tools that generated it (docs/packaging.md)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "service" / "wire" / "_gen"


def _floors() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    deps = text[text.index("dependencies = ["):text.index("]", text.index("dependencies = ["))]
    return dict(re.findall(r'"([\w-]+)>=([\d.]+)"', deps))


def test_floors_equal_the_generated_code_versions():
    pb = (GEN / "cache_manager_pb2.py").read_text()
    grpc_gen = (GEN / "cache_manager_pb2_grpc.py").read_text()
    protobuf_gen = re.search(r"# Protobuf Python Version: ([\d.]+)", pb).group(1)
    grpc_tools = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_gen).group(1)
    floors = _floors()
    assert floors["protobuf"] == protobuf_gen
    assert floors["grpcio"] == grpc_tools
    for extra in ("grpcio-health-checking", "grpcio-reflection"):
        assert floors[extra] == grpc_tools
