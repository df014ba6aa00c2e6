"""The mooncake:// storage backend against a real ``mooncake_master`` on loopback (TCP).

The fault tests start their own master, the others share one per module, each with its own
keys (``tests/storage/conftest.py``); without Mooncake they skip, naming what to install.
Pages are seeded random bytes; a read is checked bit-equal.
"""
import contextlib
import hashlib
import itertools
import multiprocessing as mp
import sys
import time

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from tooling.mooncake_master import mooncake_missing

from radixkv.contracts import StorageBackend
from radixkv.errors import InvalidArgumentError, LengthMismatchError, MissingDependencyError
from radixkv.storage.keys import layout_fingerprint, page_keys, storage_seed
from radixkv.storage.mooncake import INSTALL_HINT, MooncakeConfig, MooncakeStorage
from radixkv.storage.url import open_storage

PB = 4096  # page bytes
PAGE = 4  # tokens per page
CONNECT_S = 60.0  # the most a test waits for a (re)connection; never a pass/fail timing


def _keys(n: int, fingerprint: str = "A", first_token: int = 0, ns: bytes = b"ns") -> list[str]:
    tokens = np.arange(first_token, first_token + n * PAGE, dtype=np.int32)
    return page_keys(tokens, PAGE, storage_seed(ns, layout_fingerprint(layout=fingerprint)))


@pytest.fixture
def ns(request) -> bytes:
    """A namespace of the test's own: tests that share a master never share keys."""
    return request.node.name.encode()


def _pages(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, PB), dtype=torch.uint8, generator=g)


def _open(url: str, rows: int = 300) -> tuple[MooncakeStorage, torch.Tensor]:
    """A backend opened as a manager opens one (``open_storage``) and its registered buffer."""
    backend = open_storage(url, page_bytes=PB)
    assert isinstance(backend, MooncakeStorage)
    buf = torch.zeros((rows, PB), dtype=torch.uint8)
    backend.register_buffer(buf)
    return backend, buf


@contextlib.contextmanager
def _connected(url: str, rows: int = 300):
    """A connected backend and its registered buffer; its invariants are checked at the end."""
    backend, buf = _open(url, rows)
    try:
        assert backend.wait_connected(CONNECT_S)
        yield backend, buf
        backend.check_invariants()
    finally:
        backend.close()


def _need_mooncake() -> None:
    why = mooncake_missing()
    if why is not None:
        pytest.skip(why)


def _url(master, **params) -> str:
    return master.url(segment_bytes="32MiB", buffer_bytes="8MiB", **params)


@pytest.fixture(scope="module")
def raw_store(shared_mooncake):
    """A plain ``MooncakeDistributedStore`` on the shared master: the store's own view."""
    from mooncake.store import MooncakeDistributedStore
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", f"http://127.0.0.1:{shared_mooncake.metadata_port}/metadata", 16 << 20,
                     8 << 20, "tcp", "", f"127.0.0.1:{shared_mooncake.rpc_port}") == 0
    yield raw
    raw.close()


# ----------------------------------------------------------------------------- URL


def test_url_parameters_and_defaults():
    cfg = MooncakeConfig.from_url("mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata"
                                  "&segment_bytes=1GiB&buffer_bytes=268435456&protocol=rdma"
                                  "&rdma_devices=mlx5_0&soft_pin_ttl_ms=60000&replicas=2&verify=checksum")
    assert (cfg.master, cfg.metadata, cfg.segment_bytes, cfg.buffer_bytes) == (
        "10.0.0.5:50051", "http://10.0.0.5:8080/metadata", 1 << 30, 256 << 20)
    assert (cfg.protocol, cfg.rdma_devices, cfg.soft_pin_ttl_ms, cfg.replicas, cfg.verify) == (
        "rdma", "mlx5_0", 60000, 2, "checksum")
    local = MooncakeConfig.from_url("mooncake://127.0.0.1:50051")
    assert (local.metadata, local.local_host, local.verify) == ("http://127.0.0.1:8080/metadata", "127.0.0.1",
                                                                "length")


@pytest.mark.parametrize("url", ["mooncake://h:1?segmnt_bytes=1", "mooncake://h:1?segment_bytes=lots",
                                 "mooncake://h:1?verify=none", "mooncake://h:1?replicas=0", "file:///x",
                                 "mooncake://h", "mooncake://h:1?retry_max_ms=-1", "mooncake://h:1?segment_bytes=4MiB"])
def test_bad_url_raises(url):
    with pytest.raises(InvalidArgumentError):
        MooncakeConfig.from_url(url)


def test_built_as_open_storage_builds_it():
    """The storage tier's URL opener passes HOST:PORT, metadata and the other parameters."""
    with pytest.raises(InvalidArgumentError):
        MooncakeStorage(master_address="127.0.0.1:1", metadata_url="http://127.0.0.1:2/metadata",
                        page_bytes=PB, segment_bytes="many")
    _need_mooncake()
    backend = MooncakeStorage(master_address="127.0.0.1:1", metadata_url="http://127.0.0.1:2/metadata",
                              page_bytes=PB, segment_bytes="16MiB", verify="checksum")
    try:
        assert (backend.config.segment_bytes, backend.config.verify, backend.name) == (16 << 20, "checksum", "mooncake")
        assert backend.batch_exists(_keys(1)) == 0 and not backend.connected  # nothing listens there
    finally:
        backend.close()


def test_without_mooncake_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as where it is missing
    with pytest.raises(MissingDependencyError, match="libibverbs1"):
        MooncakeStorage.from_url("mooncake://127.0.0.1:1", PB)


def test_skip_reason_names_what_to_install():
    assert "mooncake-transfer-engine-non-cuda==0.3.13.post1" in INSTALL_HINT
    assert "apt-get install -y libibverbs1" in INSTALL_HINT


# ----------------------------------------------------------------------------- two managers


def _manager(url: str, ns: bytes, seed: int, n: int, first_token: int, other_first: int, cmd, out) -> None:
    """One manager's storage in its own (spawned) process: write its pages, read the other's."""
    backend, buf = _open(url)
    try:
        if not backend.wait_connected(CONNECT_S):
            out.put(("error", "not connected"))
            return
        buf[:n] = _pages(n, seed)
        out.put(("written", backend.batch_set(_keys(n, first_token=first_token, ns=ns), buf[:n])))
        assert cmd.get() == "read"
        oks = backend.batch_get(_keys(n, first_token=other_first, ns=ns), buf[n:2 * n])
        out.put(("read", oks, hashlib.sha256(buf[n:2 * n].numpy().tobytes()).hexdigest()))
        assert cmd.get() == "stop"
    finally:
        backend.close()


def test_two_managers_share_pages_bit_equal(shared_mooncake, ns):
    """Two processes (spawned, as two managers): each reads what the other wrote, bit-equal."""
    ctx = mp.get_context("spawn")
    url, n = _url(shared_mooncake), 16
    spec = {"a": (1, 0, 1000), "b": (2, 1000, 0)}
    cmds = {m: ctx.Queue() for m in spec}
    outs = {m: ctx.Queue() for m in spec}
    procs = {m: ctx.Process(target=_manager, args=(url, ns, seed, n, first, other, cmds[m], outs[m]))
             for m, (seed, first, other) in spec.items()}
    for p in procs.values():
        p.start()
    try:
        for m in spec:
            assert outs[m].get(timeout=120) == ("written", [True] * n)
        for m in spec:
            cmds[m].put("read")
        got = {m: outs[m].get(timeout=120) for m in spec}
        for m, other in (("a", "b"), ("b", "a")):
            assert got[m][1] == [True] * n
            assert got[m][2] == hashlib.sha256(_pages(n, spec[other][0]).numpy().tobytes()).hexdigest()
        for m in spec:
            cmds[m].put("stop")
        for p in procs.values():
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join()


# ----------------------------------------------------------------------------- faults


def test_master_down_at_start_then_connects(mooncake_master):
    mooncake_master.kill()
    backend, buf = _open(_url(mooncake_master, retry_max_ms=300))
    try:
        assert isinstance(backend, StorageBackend)
        keys = _keys(4)
        buf[:4] = _pages(4, 7)
        assert backend.batch_set(keys, buf[:4]) == [False] * 4
        assert backend.batch_exists(keys) == 0
        assert backend.batch_get(keys, buf[4:8]) == [False] * 4
        assert not backend.connected and backend.counters.unavailable == 8
        assert backend.stats()[:6] == (0, 4, 0, 0, 0, 4)  # hits, misses, corrupt, read errors, writes, errors
        backend.check_invariants()
        mooncake_master.start()
        assert backend.wait_connected(CONNECT_S)
        assert backend.batch_set(keys, buf[:4]) == [True] * 4
        assert backend.batch_get(keys, buf[4:8]) == [True] * 4
        assert torch.equal(buf[4:8], _pages(4, 7))
        backend.check_invariants()
        mooncake_master.kill()  # and no call follows: the idle probe notices
        deadline = time.monotonic() + CONNECT_S
        while backend.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not backend.connected and backend.counters.disconnects == 1
    finally:
        backend.close()


def test_master_killed_mid_run_and_restarted(mooncake_master):
    with _connected(_url(mooncake_master)) as (backend, buf):
        keys = _keys(8)
        buf[:8] = _pages(8, 3)
        assert backend.batch_set(keys, buf[:8]) == [True] * 8
        mooncake_master.kill()
        assert backend.batch_get(keys, buf[8:16]) == [False] * 8
        assert backend.batch_set(keys, buf[:8]) == [False] * 8
        assert backend.batch_exists(keys) == 0
        st = backend.stats()
        assert not backend.connected and backend.counters.disconnects == 1
        assert st.misses == 8 and st.write_errors == 8  # the failed RPC, or the idle probe first:
        assert st.read_errors + backend.counters.unavailable >= 8  # either way counted
        mooncake_master.start()
        assert backend.wait_connected(CONNECT_S)
        buf[8:16] = 0
        old = backend.batch_get(keys, buf[8:16])  # the restarted master lost its metadata
        for i, ok in enumerate(old):
            assert not ok or torch.equal(buf[8 + i], buf[i])
        assert backend.batch_set(keys, buf[:8]) == [True] * 8
        assert backend.batch_get(keys, buf[16:24]) == [True] * 8
        assert torch.equal(buf[16:24], buf[:8])
        assert backend.counters.connects == 2


def test_page_removed_between_exists_and_get_is_a_miss(shared_mooncake, raw_store, ns):
    with _connected(_url(shared_mooncake)) as (backend, buf):
        keys = _keys(8, ns=ns)
        buf[:8] = _pages(8, 5)
        assert backend.batch_set(keys, buf[:8]) == [True] * 8
        assert backend.batch_exists(keys) == 8
        assert raw_store.remove(backend.store_key(keys[3]), True) == 0  # the store evicts page 3
        oks = backend.batch_get(keys, buf[8:16])
        assert oks == [True] * 3 + [False] + [True] * 4
        assert torch.equal(buf[8:11], buf[:3]) and torch.equal(buf[12:16], buf[4:8])
        assert backend.batch_exists(keys) == 3


def test_store_eviction_under_pressure_never_returns_wrong_bytes(mooncake_master):
    """1.5x the segment's capacity written: the store evicts (or refuses) pages; every page
    read back is bit-equal and some written pages are gone."""
    n = 6000  # 4 KiB pages against a 16 MiB segment
    with _connected(mooncake_master.url(segment_bytes="16MiB", buffer_bytes="8MiB"), rows=n) as (backend, buf):
        keys, pages = _keys(n), _pages(n, 13)
        buf.copy_(pages)
        wrote = [ok for s in range(0, n, 128) for ok in backend.batch_set(keys[s:s + 128], buf[s:s + 128])]
        buf.zero_()
        got = [ok for s in range(0, n, 128) for ok in backend.batch_get(keys[s:s + 128], buf[s:s + 128])]
        hits = np.flatnonzero(got)
        assert torch.equal(buf[hits], pages[hits])
        assert any(w and not g for w, g in zip(wrote, got))  # written, then evicted: a miss
        assert backend.stats().corrupt == 0


def test_corrupt_page_is_a_miss_with_checksums(shared_mooncake, raw_store, ns):
    with _connected(_url(shared_mooncake, verify="checksum")) as (backend, buf):
        keys = _keys(2, ns=ns)
        buf[:2] = _pages(2, 9)
        assert backend.batch_set(keys, buf[:2]) == [True, True]
        name = backend.store_key(keys[1])
        blob = bytearray(raw_store.get(name))
        blob[-1] ^= 0xFF  # one payload bit pattern changed, header intact
        assert raw_store.remove(name, True) == 0 and raw_store.put(name, bytes(blob)) == 0
        assert backend.batch_get(keys, buf[2:4]) == [True, False]
        assert backend.stats().corrupt == 1


def test_other_layout_or_page_size_is_never_loaded(shared_mooncake, ns):
    url = _url(shared_mooncake)
    backend, buf = _open(url)
    other = MooncakeStorage.from_url(url, PB // 2)  # a manager whose pages are half as large
    try:
        assert backend.wait_connected(CONNECT_S) and other.wait_connected(CONNECT_S)
        mine, foreign = _keys(4, "A", ns=ns), _keys(4, "B", ns=ns)  # same tokens, another layout
        assert set(mine).isdisjoint(foreign)
        buf[:4] = _pages(4, 11)
        assert backend.batch_set(mine, buf[:4]) == [True] * 4
        assert backend.batch_exists(foreign) == 0
        assert backend.batch_get(foreign, buf[4:8]) == [False] * 4
        # a writer with another page size under the very keys this one reads
        half = _keys(4, "A", first_token=500, ns=ns)
        assert other.batch_set(half, torch.ones((4, PB // 2), dtype=torch.uint8)) == [True] * 4
        assert backend.batch_exists(half) == 4
        assert backend.batch_get(half, buf[8:12]) == [False] * 4
        backend.check_invariants()
    finally:
        other.close()
        backend.close()


# ----------------------------------------------------------------------------- against a model


def test_state_machine_against_a_set_of_stored_pages(shared_mooncake, raw_store):
    """Random writes, reads, exists and store-side removals of 16 pages against the set of
    pages stored: a read is True exactly for stored pages, and then bit-equal."""
    pages, names = _pages(16, 21), itertools.count()
    with _connected(_url(shared_mooncake)) as (backend, buf):

        class Pages(RuleBasedStateMachine):
            def __init__(self):
                super().__init__()
                self.keys = _keys(16, ns=f"sm{next(names)}".encode())
                self.stored: set[int] = set()

            @rule(idx=st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True))
            def write(self, idx):
                buf[:len(idx)] = pages[idx]
                assert backend.batch_set([self.keys[i] for i in idx], buf[:len(idx)]) == [True] * len(idx)
                self.stored.update(idx)

            @rule(idx=st.lists(st.integers(0, 15), min_size=1, max_size=8))
            def read(self, idx):
                rows = buf[100:100 + len(idx)]
                rows.zero_()
                assert backend.batch_get([self.keys[i] for i in idx], rows) == [i in self.stored for i in idx]
                for r, i in enumerate(idx):
                    assert i not in self.stored or torch.equal(rows[r], pages[i])

            @rule(idx=st.lists(st.integers(0, 15), min_size=1, max_size=8))
            def exists(self, idx):
                lead = next((n for n, i in enumerate(idx) if i not in self.stored), len(idx))
                assert backend.batch_exists([self.keys[i] for i in idx]) == lead

            @rule(i=st.integers(0, 15))
            def store_evicts(self, i):
                raw_store.remove(backend.store_key(self.keys[i]), True)
                self.stored.discard(i)

            @invariant()
            def counters_add_up(self):
                backend.check_invariants()

        run_state_machine_as_test(Pages, settings=settings(max_examples=12, stateful_step_count=12, deadline=None))


# ----------------------------------------------------------------------------- batches


@pytest.mark.parametrize("verify", ["checksum", "length"])
def test_batches_round_trip(shared_mooncake, ns, verify):
    with _connected(_url(shared_mooncake, verify=verify), rows=600) as (backend, buf):
        start = 0
        for n in (1, 8, 64, 256):
            keys = _keys(n, first_token=start, ns=ns)
            start += n * PAGE
            pages = _pages(n, n)
            buf[:n] = pages
            assert backend.batch_set(keys, buf[:n]) == [True] * n
            assert backend.batch_set(keys, buf[:n]) == [True] * n  # already there: stored
            assert backend.batch_exists(keys) == n
            missing = _keys(1, first_token=10**6, ns=ns)
            assert backend.batch_exists(keys[: n // 2] + missing + keys[n // 2:]) == n // 2
            buf[300:300 + n] = 0
            assert backend.batch_get(keys, buf[300:300 + n]) == [True] * n  # zero-copy rows
            assert torch.equal(buf[300:300 + n], pages)
            outside = torch.zeros((n + 1, PB), dtype=torch.uint8)  # not registered: staged
            assert backend.batch_get(keys + missing, outside) == [True] * n + [False]
            assert torch.equal(outside[:n], pages) and not outside[n].any()
            twice = [keys[0], keys[-1], keys[0], missing[0], keys[-1]]  # one read per key, copied
            buf[300:305] = 0
            assert backend.batch_get(twice, buf[300:305]) == [True, True, True, False, True]
            assert torch.equal(buf[[300, 301, 302, 304]], pages[[0, n - 1, 0, n - 1]])
            assert backend.batch_set(twice[:3], buf[300:303]) == [True] * 3


def test_bad_arguments_raise_and_change_nothing():
    _need_mooncake()
    backend = MooncakeStorage.from_url("mooncake://127.0.0.1:1", PB)  # nothing listens: checks come first
    buf = torch.zeros((2, PB), dtype=torch.uint8)
    backend.register_buffer(buf)
    try:
        before = backend.stats(), backend.counters.snapshot()
        with pytest.raises(InvalidArgumentError):
            backend.batch_get(_keys(2), torch.zeros((2, PB), dtype=torch.int32))
        with pytest.raises(InvalidArgumentError):
            backend.batch_set(_keys(2), torch.zeros((2, PB + 1), dtype=torch.uint8))
        with pytest.raises(LengthMismatchError):
            backend.batch_set(_keys(3), buf[:2])
        with pytest.raises(InvalidArgumentError):
            backend.register_buffer(torch.zeros(8, dtype=torch.float32))
        with pytest.raises(InvalidArgumentError):
            MooncakeStorage.from_url("mooncake://127.0.0.1:1", 0)
        assert (backend.stats(), backend.counters.snapshot()) == before
    finally:
        backend.close()
    assert backend.batch_get(_keys(1), buf[:1]) == [False]  # closed: a miss, no error
