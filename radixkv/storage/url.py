"""A storage backend from its URL (``--storage URL`` / ``EngineConfig.storage``).

* ``file:///DIR[?fsync=0|1&delete_corrupt=0|1&threads=N]`` -> :class:`~radixkv.storage.file.FileStorage`
  (``DIR`` absolute, percent-decoded; ``file://localhost/DIR`` is accepted too).
* ``mooncake://HOST:PORT?metadata=URL[&NAME=VALUE...]`` -> ``radixkv.storage.mooncake.
  MooncakeStorage(master_address="HOST:PORT", metadata_url=URL, page_bytes=N, **others)``
  (the other query parameters as strings), imported only here, so that the Mooncake client
  is needed only by whoever selects it.

Bad URLs raise ``InvalidArgumentError`` saying what is wrong; a backend whose package is not
installed raises ``MissingDependencyError`` naming the extra to install.
"""
from __future__ import annotations

import importlib
from urllib.parse import parse_qsl, unquote, urlsplit

from radixkv.contracts import StorageBackend
from radixkv.errors import InvalidArgumentError, MissingDependencyError
from radixkv.storage.file import FileStorage

__all__ = ["open_storage", "STORAGE_SCHEMES", "MOONCAKE_EXTRA"]

#: The URL schemes :func:`open_storage` knows.
STORAGE_SCHEMES = ("file", "mooncake")
#: The pip extra that installs the Mooncake client.
MOONCAKE_EXTRA = "mooncake"
_FILE_OPTIONS = ("fsync", "delete_corrupt", "threads")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def open_storage(url: str, *, page_bytes: int) -> StorageBackend:
    """The backend ``url`` names, for pages of ``page_bytes`` bytes (see the module doc).

    Raises:
        InvalidArgumentError: ``url`` is malformed, its scheme unknown, an option unknown or bad.
        MissingDependencyError: the backend's package is not installed.
    """
    if not isinstance(url, str) or not url.strip():
        raise InvalidArgumentError(f"a storage URL must be a non-empty str, got {url!r}")
    try:
        parts = urlsplit(url.strip())
    except ValueError as e:
        raise InvalidArgumentError(f"storage URL {url!r}: {e}") from None
    options = _query(url, parts.query)
    if parts.fragment:
        raise InvalidArgumentError(f"storage URL {url!r}: a fragment (#...) means nothing here")
    if parts.scheme == "file":
        return _open_file(url, parts.netloc, parts.path, options, page_bytes)
    if parts.scheme == "mooncake":
        return _open_mooncake(url, parts.netloc, parts.path, options, page_bytes)
    raise InvalidArgumentError(f"storage URL {url!r}: unknown scheme {parts.scheme!r} "
                               f"(known: {', '.join(s + '://' for s in STORAGE_SCHEMES)})")


def _query(url: str, query: str) -> dict[str, str]:
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        raise InvalidArgumentError(f"storage URL {url!r}: bad query: {e}") from None
    out: dict[str, str] = {}
    for k, v in pairs:
        if k in out:
            raise InvalidArgumentError(f"storage URL {url!r}: option {k!r} given twice")
        out[k] = v
    return out


def _flag(url: str, name: str, value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise InvalidArgumentError(f"storage URL {url!r}: option {name}={value!r} is not one of 0/1/true/false")


def _open_file(url: str, netloc: str, path: str, options: dict[str, str], page_bytes: int) -> FileStorage:
    if netloc not in ("", "localhost"):
        raise InvalidArgumentError(f"storage URL {url!r}: a file URL names an absolute directory, "
                                   f"file:///DIR (three slashes), not host {netloc!r}")
    directory = unquote(path)
    if not directory.startswith("/") or directory.strip("/") == "":
        raise InvalidArgumentError(f"storage URL {url!r}: the directory must be absolute and not '/'")
    unknown = sorted(set(options) - set(_FILE_OPTIONS))
    if unknown:
        raise InvalidArgumentError(f"storage URL {url!r}: unknown option(s) {unknown} "
                                   f"(file:// takes {', '.join(_FILE_OPTIONS)})")
    threads = options.pop("threads", "1")  # the tier's controller splits a batch over its own threads
    if not threads.isdigit() or int(threads) < 1:
        raise InvalidArgumentError(f"storage URL {url!r}: option threads={threads!r} is not an int >= 1")
    flags = {k: _flag(url, k, v) for k, v in options.items()}
    return FileStorage(directory, page_bytes=page_bytes, threads=int(threads), **flags)


def _open_mooncake(url: str, netloc: str, path: str, options: dict[str, str],
                   page_bytes: int) -> StorageBackend:
    host, _, port = netloc.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"storage URL {url!r}: mooncake:// needs the master as HOST:PORT "
                                   f"(PORT 1..65535), got {netloc!r}")
    if path not in ("", "/"):
        raise InvalidArgumentError(f"storage URL {url!r}: mooncake:// takes no path, got {path!r}")
    metadata = options.pop("metadata", "")
    if not metadata:
        raise InvalidArgumentError(f"storage URL {url!r}: mooncake:// needs ?metadata=URL "
                                   "(the metadata server, e.g. http://HOST:PORT/metadata)")
    try:
        module = importlib.import_module("radixkv.storage.mooncake")
        backend: StorageBackend = module.MooncakeStorage(master_address=netloc, metadata_url=metadata,
                                                         page_bytes=page_bytes, **options)
    except MissingDependencyError:
        raise
    except ImportError as e:  # at import or, for a lazily imported client, at construction
        if e.name == "radixkv.storage.mooncake":
            raise MissingDependencyError("this radixkv build has no Mooncake backend "
                                         "(radixkv.storage.mooncake)") from e
        raise MissingDependencyError(
            f"mooncake:// needs the Mooncake client: pip install 'radixkv[{MOONCAKE_EXTRA}]' "
            f"(and, for its binaries, the system package libibverbs1); import failed: {e}") from e
    return backend
