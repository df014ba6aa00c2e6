"""FileStorage (2 threads) against a dict model: set / get / exists / corrupt / delete everything /
reopen, with the counters checked after every step."""
import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixkv.storage.file import FileStorage

PB = 64
KEYS = [f"key-{i}" for i in range(10)]
# unique keys per batch: a batch of 8+ is split over the store's threads, and two threads racing
# on one key would make the winner (set) or the corrupt count (get) a matter of timing
keys_st = st.lists(st.sampled_from(KEYS), min_size=0, max_size=10, unique=True)


class FileStorageMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="rkv-fsm-")
        self.store = FileStorage(self.dir, page_bytes=PB, threads=2)
        self.model: dict[str, bytes] = {}      # key -> the page a read must return
        self.bad_same_size: set[str] = set()   # corrupt files that still have the right size
        self.bad_other_size: set[str] = set()
        self.want = dict(hits=0, misses=0, corrupt=0, writes=0)

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(keys=keys_st, data=st.data())
    def set(self, keys, data):
        rows = [data.draw(st.binary(min_size=PB, max_size=PB)) for _ in keys]
        src = torch.tensor([list(r) for r in rows], dtype=torch.uint8).view(len(keys), PB)
        assert self.store.batch_set(keys, src) == [True] * len(keys)
        for k, r in zip(keys, rows):
            self.model[k] = r
            self.bad_same_size.discard(k)
            self.bad_other_size.discard(k)
        self.want["writes"] += len(keys)

    @rule(keys=keys_st)
    def get(self, keys):
        dst = torch.zeros(len(keys), PB, dtype=torch.uint8)
        got = self.store.batch_get(keys, dst)
        for i, k in enumerate(keys):
            if k in self.bad_same_size or k in self.bad_other_size:
                assert not got[i]
                self.want["corrupt"] += 1
                self.bad_same_size.discard(k)  # deleted when found
                self.bad_other_size.discard(k)
                self.model.pop(k, None)
            if k in self.model:
                assert got[i] and bytes(dst[i].tolist()) == self.model[k]
                self.want["hits"] += 1
            else:
                assert not got[i]
                self.want["misses"] += 1

    @rule(keys=keys_st)
    def exists(self, keys):
        n = 0
        for k in keys:
            if k not in self.model and k not in self.bad_same_size:
                break
            if k in self.bad_other_size:
                break
            n += 1
        assert self.store.batch_exists(keys) == n

    @rule(key=st.sampled_from(KEYS), mode=st.sampled_from(["flip", "truncate", "append", "zero_trailer"]),
          at=st.integers(0, 10**6))
    def corrupt(self, key, mode, at):
        if key not in self.model:
            return
        p = self.store.path_of(key)
        b = bytearray(p.read_bytes())
        if mode == "flip":
            b[at % len(b)] ^= 1 << (at % 8)
        elif mode == "truncate":
            b = b[: at % len(b)]
        elif mode == "append":
            b += b"x"
        else:
            b[-40:] = bytes(40)  # the trailer
        p.write_bytes(bytes(b))
        del self.model[key]
        (self.bad_same_size if mode in ("flip", "zero_trailer") else self.bad_other_size).add(key)

    @rule()
    def delete_everything(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        self.model.clear()
        self.bad_same_size.clear()
        self.bad_other_size.clear()

    @rule()
    def reopen(self):
        self.store.close()
        self.store = FileStorage(self.dir, page_bytes=PB, threads=2)
        self.want = dict.fromkeys(self.want, 0)

    @invariant()
    def counters_match(self):
        s = self.store.stats()
        assert (s.hits, s.misses, s.corrupt, s.writes) == tuple(self.want.values())
        assert s.write_errors == s.read_errors == 0
        assert s.bytes_read == s.hits * PB and s.bytes_written == s.writes * PB
        self.store.check_invariants()


TestFileStorageMachine = FileStorageMachine.TestCase
