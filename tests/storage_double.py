"""An in-memory StorageBackend for tests (the test double of the storage tier)."""
from __future__ import annotations

import threading
import time
from typing import TypeVar

import torch

_S = TypeVar("_S")


def stored(store: _S, n: int, page_bytes: int) -> tuple[_S, list[str], torch.Tensor]:
    """``store`` holding pages ``k0``..``k{n-1}`` of known bytes: (store, keys, rows)."""
    keys = [f"k{i}" for i in range(n)]
    rows = torch.arange(n * page_bytes, dtype=torch.int64).remainder(251).to(torch.uint8).view(n, page_bytes)
    store.batch_set(keys, rows)  # type: ignore[attr-defined]
    return store, keys, rows


class DictStorage:
    """An in-memory StorageBackend (the test double): a dict of page bytes, with a switch
    that makes every call block until released (a dead backend) and a ``delay`` in seconds
    every read call sleeps first (a slow one)."""

    name = "memory"

    def __init__(self) -> None:
        self.pages: dict[str, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0
        self.delay = 0.0

    def register_buffer(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer

    def batch_exists(self, keys) -> int:
        self.calls += 1
        self.gate.wait()
        if self.delay:
            time.sleep(self.delay)
        n = 0
        for k in keys:
            if k not in self.pages:
                break
            n += 1
        return n

    def batch_get(self, keys, dst: torch.Tensor) -> list[bool]:
        self.gate.wait()
        if self.delay:
            time.sleep(self.delay)
        out = []
        for i, k in enumerate(keys):
            b = self.pages.get(k)
            if b is None:
                out.append(False)
                continue
            dst[i].copy_(torch.frombuffer(bytearray(b), dtype=torch.uint8))
            out.append(True)
        return out

    def batch_set(self, keys, src: torch.Tensor) -> list[bool]:
        self.gate.wait()
        for i, k in enumerate(keys):
            self.pages[k] = src[i].numpy().tobytes()
        return [True] * len(keys)

    def close(self) -> None:
        self.gate.set()


class ScatterDictStorage(DictStorage):
    """:class:`DictStorage` that also reads a page into its own list of buffers (a
    ``ScatterStorageBackend``, as the file tier is), so the tier takes its direct path."""

    scatter_reads = True

    def __init__(self) -> None:
        super().__init__()
        self.get_gate = threading.Event()  # cleared: reads into buffers block (after batch_exists)
        self.get_gate.set()

    def batch_get(self, keys, dst) -> list[bool]:
        if isinstance(dst, torch.Tensor):
            return super().batch_get(keys, dst)
        self.gate.wait()
        self.get_gate.wait()
        out = []
        for k, bufs in zip(keys, dst):
            b = self.pages.get(k)
            if b is None:
                out.append(False)
                continue
            at = 0
            for buf in bufs:  # a tensor or a writable byte memoryview (HostKVPool.page_buffers)
                flat = torch.frombuffer(buf, dtype=torch.uint8) if isinstance(buf, memoryview) else buf.view(-1)
                flat.copy_(torch.frombuffer(bytearray(b[at:at + flat.numel()]), dtype=torch.uint8))
                at += flat.numel()
            out.append(True)
        return out
