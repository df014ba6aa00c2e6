"""open_storage: file:// and mooncake:// URLs, and every bad URL a clear InvalidArgumentError."""
import importlib
import sys
import types

import pytest
import torch

from radixkv.errors import InvalidArgumentError, MissingDependencyError
from radixkv.storage.file import FileStorage
from radixkv.storage.url import open_storage


def test_file_url(tmp_path):
    s = open_storage(f"file://{tmp_path}/a%20b", page_bytes=64)
    assert isinstance(s, FileStorage) and s.root == tmp_path / "a b" and s.page_bytes == 64
    assert not s.fsync and s.delete_corrupt
    assert s.batch_set(["k"], torch.ones(1, 64, dtype=torch.uint8)) == [True]
    s2 = open_storage(f"file://localhost{tmp_path}/a%20b?fsync=1&delete_corrupt=false&threads=2", page_bytes=64)
    assert isinstance(s2, FileStorage) and s2.fsync and not s2.delete_corrupt and s2.threads == 2
    assert s2.batch_exists(["k"]) == 1


@pytest.mark.parametrize("url, says", [
    ("", "non-empty"),
    ("/just/a/path", "unknown scheme ''"),
    ("s3://bucket/x", "unknown scheme 's3'"),
    ("file://relative/dir", "three slashes"),
    ("file:///", "absolute"),
    ("file:///d?fsync=maybe", "fsync='maybe'"),
    ("file:///d?size=3", "unknown option"),
    ("file:///d?fsync=1&fsync=0", "given twice"),
    ("file:///d?threads=0", "threads='0'"),
    ("file:///d?threads=two", "threads='two'"),
    ("file:///d?fsync", "bad query"),
    ("file:///d#frag", "fragment"),
    ("mooncake://host?metadata=http://m/metadata", "HOST:PORT"),
    ("mooncake://host:0?metadata=http://m", "HOST:PORT"),
    ("mooncake://host:99999?metadata=http://m", "HOST:PORT"),
    ("mooncake://:50051?metadata=http://m", "HOST:PORT"),
    ("mooncake://host:50051", "metadata"),
    ("mooncake://host:50051/x?metadata=http://m", "no path"),
])
def test_bad_urls_say_what_is_wrong(url, says):
    with pytest.raises(InvalidArgumentError) as e:
        open_storage(url, page_bytes=64)
    assert says in str(e.value)


def test_not_a_string():
    with pytest.raises(InvalidArgumentError):
        open_storage(None, page_bytes=64)  # type: ignore[arg-type]


def test_bad_page_bytes(tmp_path):
    with pytest.raises(InvalidArgumentError):
        open_storage(f"file://{tmp_path}", page_bytes=0)


def _without_mooncake_module(monkeypatch):
    """Make ``radixkv.storage.mooncake`` unimportable (whether or not this build has it)."""
    monkeypatch.setitem(sys.modules, "radixkv.storage.mooncake", None)


def test_mooncake_backend_absent(monkeypatch):
    _without_mooncake_module(monkeypatch)
    with pytest.raises(MissingDependencyError, match="no Mooncake backend"):
        open_storage("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata", page_bytes=64)


def _fake_backend_module(monkeypatch, cls):
    mod = types.ModuleType("radixkv.storage.mooncake")
    mod.MooncakeStorage = cls
    monkeypatch.setitem(sys.modules, "radixkv.storage.mooncake", mod)


def test_mooncake_client_missing_names_the_extra(monkeypatch):
    class NeedsClient:
        def __init__(self, **kw):
            importlib.import_module("mooncake_client_that_is_not_installed")

    _fake_backend_module(monkeypatch, NeedsClient)
    with pytest.raises(MissingDependencyError, match=r"radixkv\[mooncake\]") as e:
        open_storage("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata", page_bytes=64)
    assert isinstance(e.value, ImportError) and e.value.code == "FAILED_PRECONDITION"


def test_mooncake_url_reaches_the_backend(monkeypatch):
    seen = {}

    class Recorder:
        name = "mooncake"

        def __init__(self, **kw):
            seen.update(kw)

    _fake_backend_module(monkeypatch, Recorder)
    url = "mooncake://10.0.0.1:50051?metadata=http%3A%2F%2F10.0.0.1%3A8080%2Fmetadata&protocol=tcp"
    assert isinstance(open_storage(url, page_bytes=4096), Recorder)
    assert seen == {"master_address": "10.0.0.1:50051", "metadata_url": "http://10.0.0.1:8080/metadata",
                    "page_bytes": 4096, "protocol": "tcp"}
