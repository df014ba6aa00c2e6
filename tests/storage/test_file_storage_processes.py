"""FileStorage across processes (started with spawn): concurrent writers of the same keys never
expose a torn page, and a writer SIGKILLed mid-write leaves no visible page that fails its
checksum."""
import multiprocessing as mp
import os
import random
import signal
import time

import torch
from storage_util import page_of, pages_of, race_reader, race_writer, write_loop

from radixkv.storage.file import FileStorage

CTX = mp.get_context("spawn")


def test_concurrent_writers_of_the_same_keys(tmp_path):
    pb = 256 << 10
    keys = [f"race{i}" for i in range(16)]
    barrier, done, q = CTX.Barrier(3), CTX.Event(), CTX.Queue()
    procs = [CTX.Process(target=race_writer, args=(str(tmp_path), pb, keys, salt, 6, barrier)) for salt in (1, 2)]
    procs.append(CTX.Process(target=race_reader, args=(str(tmp_path), pb, keys, [1, 2], barrier, done, q)))
    for p in procs:
        p.start()
    try:
        for w in procs[:2]:
            w.join(120)
            assert w.exitcode == 0
        done.set()
        passes, hits, bad, corrupt = q.get(timeout=120)
        procs[2].join(60)
        assert procs[2].exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert passes >= 2 and hits > 0
    assert bad == 0 and corrupt == 0
    # every page is one writer's whole page
    store = FileStorage(tmp_path, page_bytes=pb)
    dst = torch.zeros(len(keys), pb, dtype=torch.uint8)
    assert store.batch_get(keys, dst) == [True] * len(keys)
    a, b = pages_of(keys, pb, 1), pages_of(keys, pb, 2)
    assert all(torch.equal(dst[i], a[i]) or torch.equal(dst[i], b[i]) for i in range(len(keys)))
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".page"]


def test_sigkill_mid_write_leaves_no_bad_page(tmp_path):
    pb = 1 << 20  # large pages: a kill usually lands inside a write
    rng = random.Random(31)
    start = 0
    for _ in range(3):
        started = CTX.Event()
        p = CTX.Process(target=write_loop, args=(str(tmp_path), pb, start, started))
        p.start()
        try:
            assert started.wait(120)
            time.sleep(rng.uniform(0.0, 0.2))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.join(60)
        assert p.exitcode == -signal.SIGKILL
        visible = [f for f in tmp_path.rglob("*.page")]
        # read back everything the writer may have written (and a margin past it)
        store = FileStorage(tmp_path, page_bytes=pb, delete_corrupt=False)
        keys = [f"k{i}" for i in range(len(visible) + 50)]
        dst = torch.zeros(1, pb, dtype=torch.uint8)
        hits = 0
        for k in keys:
            if store.batch_get([k], dst)[0]:
                hits += 1
                assert torch.equal(dst[0], page_of(k, pb))
        st = store.stats()
        assert st.corrupt == 0 and st.read_errors == 0
        assert hits == len(visible) >= start + 3  # every visible page is whole, and it got going
        temps = [f for f in tmp_path.rglob(".tmp-*")]
        assert store.sweep_temp_files(older_than_s=-1) == len(temps)  # the killed writer's leftovers
        assert not list(tmp_path.rglob(".tmp-*")) and len(list(tmp_path.rglob("*.page"))) == hits
        start = hits
