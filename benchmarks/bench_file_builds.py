"""Two versions of ``radixkv/storage/file.py`` side by side: ``FileStorage.batch_get`` of each,
a plain read of the same bytes, and each layout's payload copy alone (one ``preadv`` of the
payload at its file offset, no checks), rounds interleaved in one process (docs/tiers.md, "Where
the file tier's time went"). For a change to the file tier: save the old source, then time both::

    git show REV:radixkv/storage/file.py > build/file_old.py
    python benchmarks/bench_file_builds.py build/file_old.py radixkv/storage/file.py

With ``--controllers OLD NEW`` (two ``radixkv/storage/tier_controller.py``), it times instead the
tier's whole storage -> host load through each: ``StorageController.fetch`` of the pages (the
new ``FileStorage`` beneath both), then their copy into preallocated host rows, and, for a
controller that has it, ``fetch_into`` those host rows (the read lands in them, no copy), reserved
once storage counted its pages (``into``) or, where the controller takes them, given for every
key up front (``up front``: one pass, no count). ``--splits``
times the steps of the new layout's read per page instead (``time.perf_counter_ns`` around
each), with xxh3 of the same rows after the whole batch beside it; ``--alignment`` reads one
file's pages into rows at byte offsets 0..4088 within a 4 KiB page (the kernel copy's speed).

``--storage-threads OLD [NEW]`` / ``--read-threads N`` / ``--old-file PATH``: the file tier's and
the new controller's threads, the old controller's ``file.py``.

Pages as ``bench_tiers.py`` (4 layers x 8 heads x 128 dims, fp16: 256 KiB at 16 tokens, 1 MiB at
64), one storage thread unless told, warm page cache, rows of one ``torch.zeros`` buffer per reader (as the
host tier's). The median of ``--reps`` rounds after a warm-up, wall and CPU time, minor page
faults per call; every reader's bytes checked.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import mmap
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from radixkv.storage.keys import layout_fingerprint, page_keys, storage_seed


def _module(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _payload_offset(path: str, row: np.ndarray) -> int:
    """Where ``row``'s bytes start in the file at ``path`` (the layout, found, not assumed)."""
    at = Path(path).read_bytes().find(row.tobytes())
    if at < 0:
        raise RuntimeError(f"{path} does not hold its page's bytes")
    return at


def _copy_only(paths: list[str], offset: int, rows: np.ndarray) -> None:
    for p, row in zip(paths, rows):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(row)], offset)
        finally:
            os.close(fd)


def _plain(paths: list[str], rows: np.ndarray) -> None:
    for p, row in zip(paths, rows):
        with open(p, "rb", buffering=0) as f:
            f.readinto(memoryview(row))


def _time(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, tuple[float, float, float]]:
    """Median wall, CPU seconds and minor faults of each of ``fns``, rounds interleaved."""
    for fn in fns.values():
        fn()
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            t, c = time.perf_counter() - t0, time.process_time() - c0
            runs[name].append((t, c, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0))
    return {k: tuple(statistics.median(x[i] for x in r) for i in range(3)) for k, r in runs.items()}  # type: ignore[misc]


def _pages(d: str, ps: int, most: int) -> tuple[int, list[str], torch.Tensor, list[str]]:
    """Page bytes, keys and random pages of ``ps`` tokens, the pages also written as plain files."""
    pb = 2 * 4 * ps * 8 * 128 * 2
    keys = page_keys(np.arange(most * ps, dtype=np.int32), ps,
                     storage_seed(b"", layout_fingerprint(bench="files", page_bytes=pb)))
    src = torch.randint(0, 256, (most, pb), dtype=torch.uint8, generator=torch.Generator().manual_seed(ps))
    plain = [f"{d}/plain-{pb}-{i}" for i in range(most)]
    for p, row in zip(plain, src.numpy()):
        Path(p).write_bytes(row.tobytes())
    return pb, keys, src, plain


def _measured(fns: dict[str, Callable[[], Any]], dst: dict[str, torch.Tensor], src: torch.Tensor, n: int,
              reps: int) -> str:
    """Time ``fns`` (the first is the plain read), check every ``dst``'s bytes, one line of ratios."""
    t = _time(fns, reps)
    for name, got in dst.items():
        if not torch.equal(got[:n], src[:n]):
            raise RuntimeError(f"{name} read wrong bytes at batch {n}")
    base, base_cpu = t["plain"][0], t["plain"][1]
    return "; ".join(f"{k} {src[:n].numel() / v[0] / 1e9:.2f} GB/s {base / v[0]:.2f}x "
                     f"(cpu {base_cpu / max(v[1], 1e-9):.2f}x, {v[2]:.0f} flt)" for k, v in t.items())


def _page_size(mods: dict[str, ModuleType], d: str, ps: int, batches: list[int], reps: int) -> None:
    """Write the pages in each layout and as plain files, then time every reader per batch."""
    pb, keys, src, plain = _pages(d, ps, max(batches))
    stores, files = {}, {}
    for name, mod in mods.items():
        stores[name] = mod.FileStorage(Path(d) / f"{name}-{pb}", page_bytes=pb, threads=1)
        if not all(stores[name].batch_set(keys, src)):
            raise RuntimeError("could not write the pages")
        files[name] = [str(stores[name].path_of(k)) for k in keys]
    offsets = {name: _payload_offset(files[name][0], src[0].numpy()) for name in mods}
    dst = {name: torch.zeros_like(src) for name in ("plain", *mods, *(f"{m} copy" for m in mods))}
    for n in batches:
        fns: dict[str, Callable[[], Any]] = {"plain": partial(_plain, plain[:n], dst["plain"].numpy()[:n])}
        for name in mods:
            fns[name] = partial(stores[name].batch_get, keys[:n], dst[name][:n])
            fns[f"{name} copy"] = partial(_copy_only, files[name][:n], offsets[name], dst[f"{name} copy"].numpy()[:n])
        print(f"page {ps} ({pb >> 10} KiB, payload at {offsets['old']} / {offsets['new']}) batch {n}: "
              f"{_measured(fns, dst, src, n, reps)}", flush=True)


def _controller(mod: ModuleType, store: Any, pb: int, read_threads: int) -> Any:
    """``mod``'s controller over ``store``, with ``read_threads`` where it takes them."""
    kw = {"read_threads": read_threads} if "read_threads" in inspect.signature(mod.StorageController).parameters else {}
    return mod.StorageController(store, pb, timeout_s=60.0, batch_pages=128, **kw)


def _controllers(mods: dict[str, ModuleType], d: str, ps: int, batches: list[int], reps: int,
                 storage_threads: tuple[int, ...] = (1,), read_threads: int = 1, old_file: str | None = None) -> None:
    """Each controller's ``fetch`` + copy into host rows (and ``fetch_into`` them where it has
    it), beside ``batch_get`` alone and a plain read."""
    from radixkv.storage.file import FileStorage

    pb, keys, src, plain = _pages(d, ps, max(batches))
    store = FileStorage(Path(d) / f"ctl-{pb}", page_bytes=pb, threads=storage_threads[0])
    if not all(store.batch_set(keys, src)):
        raise RuntimeError("could not write the pages")
    old_store = store if old_file is None else \
        _module(old_file, "radixkv_file_for_old").FileStorage(Path(d) / f"ctl-{pb}", page_bytes=pb,
                                                               threads=storage_threads[0])
    stores = {"old": old_store, "new": FileStorage(Path(d) / f"ctl-{pb}", page_bytes=pb, threads=storage_threads[-1])}
    ctls = {name: _controller(mod, stores[name], pb, read_threads) for name, mod in mods.items()}
    direct = [name for name, mod in mods.items() if hasattr(mod.StorageController, "fetch_into")]
    upfront = [name for name in direct  # a controller whose fetch_into also takes every key's buffers
               if str(inspect.signature(mods[name].StorageController.fetch_into).parameters["reserve"]
                      .annotation).endswith("| PageBuffers")]
    dst = {name: torch.zeros_like(src) for name in ("plain", "batch_get", *mods, *(f"{m} into" for m in direct),
                                                     *(f"{m} up front" for m in upfront))}

    def load(ctl: Any, n: int, host: torch.Tensor) -> None:
        rows = ctl.fetch(keys[:n])
        host[:rows.shape[0]].copy_(rows)

    def load_into(ctl: Any, n: int, host: torch.Tensor) -> None:
        flat = host.numpy().data.cast("B")  # byte views of the rows, as HostKVPool.page_buffers gives
        k, _ = ctl.fetch_into(keys[:n], lambda m: [[flat[i * pb:(i + 1) * pb]] for i in range(m)])
        if k != n:
            raise RuntimeError(f"fetch_into read {k} of {n} pages")

    def load_up_front(ctl: Any, n: int, host: torch.Tensor) -> None:
        flat = host.numpy().data.cast("B")
        k, _ = ctl.fetch_into(keys[:n], [[flat[i * pb:(i + 1) * pb]] for i in range(n)])
        if k != n:
            raise RuntimeError(f"fetch_into read {k} of {n} pages")

    for n in batches:
        fns: dict[str, Callable[[], Any]] = {"plain": partial(_plain, plain[:n], dst["plain"].numpy()[:n]),
                                             "batch_get": partial(store.batch_get, keys[:n], dst["batch_get"][:n])}
        for name in mods:
            fns[name] = partial(load, ctls[name], n, dst[name][:n])
        for name in direct:
            fns[f"{name} into"] = partial(load_into, ctls[name], n, dst[f"{name} into"][:n])
        for name in upfront:
            fns[f"{name} up front"] = partial(load_up_front, ctls[name], n, dst[f"{name} up front"][:n])
        print(f"page {ps} ({pb >> 10} KiB) batch {n}, fetch + copy into host rows: "
              f"{_measured(fns, dst, src, n, reps)}", flush=True)
    for ctl in ctls.values():
        ctl.close()


def _splits(mods: dict[str, ModuleType], d: str, ps: int, batches: list[int], reps: int) -> None:
    """Microseconds per page of each step of the new module's read (``FileStorage._read_one``'s
    steps, unrolled), medians over ``reps`` rounds; xxh3 ``later``: the same rows after the batch."""
    new = mods["new"]
    pb, keys, src, _plain_files = _pages(d, ps, max(batches))
    store = new.FileStorage(Path(d) / f"split-{pb}", page_bytes=pb, threads=1)
    store.batch_set(keys, src)
    names = [k.encode() for k in keys]
    view = torch.zeros_like(src).numpy()
    clock = time.perf_counter_ns
    for n in batches:
        steps = ("path+view", "open", "readv", "close+checks", "xxh3 now", "xxh3 later", "batch_get")
        rounds = []
        for _ in range(reps + 1):
            acc = np.zeros(len(steps))
            for i in range(n):
                t0 = clock()
                path, row, key = store._path(names[i]), memoryview(view[i]), names[i]
                t1 = clock()
                fd = os.open(path, os.O_RDONLY)
                tail = bytearray(len(key) + new._TRAILER.size + 1)
                t2 = clock()
                os.readv(fd, [row, tail])
                t3 = clock()
                os.close(fd)
                fields = new._TRAILER.unpack_from(tail, len(key))
                ok = fields[0] == new._MAGIC and tail[:len(key)] == key
                t4 = clock()
                h = new.xxhash.xxh3_64(row)
                h.update(memoryview(tail)[:len(key)])
                h.update(memoryview(tail)[len(key) + new._SUMMED:-1])
                if not ok or h.intdigest() != fields[1]:
                    raise RuntimeError("a page failed its checks")
                acc[:5] += (t1 - t0, t2 - t1, t3 - t2, t4 - t3, clock() - t4)
            t5 = clock()
            for i in range(n):
                new.xxhash.xxh3_64(memoryview(view[i])).intdigest()
            t6 = clock()
            store.batch_get(keys[:n], torch.from_numpy(view[:n]))
            acc[5:] = (t6 - t5, clock() - t6)
            rounds.append(acc / n / 1e3)
        med = np.median(np.array(rounds[1:]), axis=0)
        print(f"page {ps} ({pb >> 10} KiB) batch {n}, us per page: "
              + ", ".join(f"{k} {v:.2f}" for k, v in zip(steps, med)), flush=True)


def _alignment(mods: dict[str, ModuleType], d: str, ps: int, batches: list[int], reps: int) -> None:
    """GB/s of reading plain files (payload at offset 0) into rows at each byte offset of a page."""
    pb, _keys, src, plain = _pages(d, ps, max(batches))
    n = max(batches)
    buf = mmap.mmap(-1, n * pb + 4096)  # page-aligned
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = 1
    for off in (0, 8, 16, 32, 64, 104, 1024, 2048, 3072, 3992, 4032, 4056, 4088):
        rows = arr[off:off + n * pb].reshape(n, pb)
        t = _time({"read": partial(_copy_only, plain, 0, rows)}, reps)["read"]
        if not np.array_equal(rows, src.numpy()):
            raise RuntimeError("wrong bytes")
        print(f"page {ps} ({pb >> 10} KiB) x {n}, rows at offset {off} of a 4 KiB page: "
              f"{n * pb / t[0] / 1e9:.2f} GB/s", flush=True)
    del rows, arr
    buf.close()


def run(old_src: str, new_src: str, page_sizes: list[int], batches: list[int], reps: int,
        work_dir: str | None, mode: str = "files", storage_threads: tuple[int, ...] = (1,),
        read_threads: int = 1, old_file: str | None = None) -> None:
    mods = {"old": _module(old_src, "radixkv_file_old"), "new": _module(new_src, "radixkv_file_new")}
    print(f"load average before: {os.getloadavg()}; storage threads {storage_threads}, read threads {read_threads}")
    modes: dict[str, Callable[..., None]] = {
        "files": _page_size, "controllers": partial(_controllers, storage_threads=storage_threads,
                                                    read_threads=read_threads, old_file=old_file),
        "splits": _splits, "alignment": _alignment}
    with tempfile.TemporaryDirectory(prefix="radixkv-bench-file-", dir=work_dir) as d:
        for ps in page_sizes:
            modes[mode](mods, d, ps, batches, reps)
    print(f"load average after: {os.getloadavg()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("old", help="the old radixkv/storage/file.py (tier_controller.py with --controllers)")
    ap.add_argument("new", help="the new radixkv/storage/file.py (tier_controller.py with --controllers)")
    ap.add_argument("--controllers", dest="mode", action="store_const", const="controllers", default="files",
                    help="time two tier_controller.py instead")
    ap.add_argument("--splits", dest="mode", action="store_const", const="splits",
                    help="time the steps of the new file.py's read per page")
    ap.add_argument("--alignment", dest="mode", action="store_const", const="alignment",
                    help="time plain reads into rows at byte offsets within a page")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    ap.add_argument("--storage-threads", type=int, nargs="+", default=[1], metavar="N",
                    help="FileStorage(threads=N) under the controllers and batch_get (--controllers); a second "
                         "N: the new controller's")
    ap.add_argument("--read-threads", type=int, default=1,
                    help="StorageController(read_threads=N) where a controller takes it (--controllers)")
    ap.add_argument("--old-file", default=None, metavar="PATH",
                    help="the old controller's radixkv/storage/file.py (--controllers; default: the new one)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    run(a.old, a.new, a.page_sizes, a.batches, a.reps, a.dir, a.mode, tuple(a.storage_threads), a.read_threads,
        a.old_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
