"""Helpers for the storage tests: deterministic pages, real small / read-only mounts, and the
functions spawned processes run (importable by name, as ``spawn`` needs)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Iterator

import numpy as np
import torch

from radixkv.storage.file import FileStorage


def page_of(key: str, page_bytes: int, salt: int = 0) -> torch.Tensor:
    """The bytes a test writes under ``key`` (a function of key and salt only)."""
    seed = int.from_bytes(key.encode()[:8].ljust(8, b"\0"), "little") ^ (salt * 0x9E3779B9)
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, page_bytes, dtype=np.uint8))


def pages_of(keys: list[str], page_bytes: int, salt: int = 0) -> torch.Tensor:
    if not keys:
        return torch.empty(0, page_bytes, dtype=torch.uint8)
    return torch.stack([page_of(k, page_bytes, salt) for k in keys])


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def tmpfs(size: str) -> Iterator[str | None]:
    """A fresh tmpfs of ``size`` mounted on a temp dir (``None`` where mounting is not allowed)."""
    d = tempfile.mkdtemp(prefix="rkv-tmpfs-")
    mounted = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", d)
    try:
        yield d if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", d], capture_output=True)
        os.rmdir(d)


def remount_read_only(d: str) -> bool:
    return _mount("-o", "remount,ro", d)


# ------------------------------------------------------------------ spawned processes


def write_loop(root: str, page_bytes: int, start: int, started: object) -> None:
    """Write pages ``k{start}``, ``k{start+1}``, ... forever (until killed), one per call."""
    s = FileStorage(root, page_bytes=page_bytes)
    i = start
    while True:
        key = f"k{i}"
        s.batch_set([key], page_of(key, page_bytes).view(1, -1))
        if i == start + 2:
            started.set()  # type: ignore[attr-defined]
        i += 1


def race_writer(root: str, page_bytes: int, keys: list[str], salt: int, rounds: int, barrier: object) -> None:
    """Write ``keys`` with payloads of ``salt``, ``rounds`` times, starting with the others."""
    s = FileStorage(root, page_bytes=page_bytes)
    src = pages_of(keys, page_bytes, salt)
    barrier.wait()  # type: ignore[attr-defined]
    for _ in range(rounds):
        assert all(s.batch_set(keys, src))


def race_reader(root: str, page_bytes: int, keys: list[str], salts: list[int], barrier: object,
                done: object, q: object) -> None:
    """Read ``keys`` in a loop from when the writers start until ``done`` is set (then once
    more); report (passes, hits, pages that are no writer's whole page, corrupt files seen)."""
    s = FileStorage(root, page_bytes=page_bytes, delete_corrupt=False)
    want = [pages_of(keys, page_bytes, salt) for salt in salts]
    dst = torch.empty(len(keys), page_bytes, dtype=torch.uint8)
    passes = hits = bad = 0
    barrier.wait()  # type: ignore[attr-defined]
    last = False
    while not last:
        last = done.is_set()  # type: ignore[attr-defined]
        passes += 1
        for i, ok in enumerate(s.batch_get(keys, dst)):
            if ok:
                hits += 1
                bad += not any(torch.equal(dst[i], w[i]) for w in want)
    q.put((passes, hits, bad, s.stats().corrupt))  # type: ignore[attr-defined]
