"""The storage queue's conservation law (``StorageController.check_invariants``): every page
queued is written, failed or pending, also while the worker is between the pages of a batch."""
import threading

import pytest
import torch
from storage_double import DictStorage

from radixkv.errors import InvariantError
from radixkv.storage.tier_controller import StorageController


class _FailingHalf(DictStorage):
    """Fails every other page of each write."""

    def batch_set(self, keys, src):
        ok = super().batch_set(keys, src)
        return [f and i % 2 == 0 for i, f in enumerate(ok)]


def test_queue_law_holds_while_writing_and_names_a_break():
    store = _FailingHalf()
    store.gate.clear()  # every call blocks: the queue fills
    ctl = StorageController(store, 16, batch_pages=4, max_pending_pages=64)
    try:
        for i in range(5):
            assert ctl.backup([f"k{i}-{j}" for j in range(6)], torch.zeros((6, 16), dtype=torch.uint8))
        ctl.check_invariants()
        assert (ctl.stats.queued, ctl.stats.pending) == (30, 30)
        checks = []
        stop = threading.Event()

        def audit():  # the law holds at any moment the worker may be in
            while not stop.is_set():
                ctl.check_invariants()
                checks.append(1)

        t = threading.Thread(target=audit)
        t.start()
        store.gate.set()
        assert ctl.drain(30)
        stop.set()
        t.join(30)
        ctl.check_invariants()
        assert checks and (ctl.stats.written, ctl.stats.write_failed, ctl.stats.pending) == (15, 15, 0)
        ctl.stats.written -= 1  # a lost page
        with pytest.raises(InvariantError, match="queued 30 != written 14"):
            ctl.check_invariants()
        ctl.stats.written += 1
    finally:
        ctl.close(1.0)
