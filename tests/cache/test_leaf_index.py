"""LeafIndex (the trees' evictable-leaf heap) against a sorted-list model: the same front
after every step, ties broken by filing order (what the trees' eviction order relies on)."""
import bisect
import itertools

import numpy as np
import pytest

from radixkv.cache.leaf_index import _SLACK, LeafIndex
from radixkv.errors import InvariantError


class Leaf:
    def __init__(self, i):
        self.id = i
        self.skey = None


@pytest.mark.parametrize("seed", range(4))
def test_pops_in_key_then_filing_order(seed):
    rng = np.random.default_rng(seed)
    index, model, seq = LeafIndex(), [], itertools.count()  # model: sorted (key, seq, id)
    nodes = [Leaf(i) for i in range(60)]
    filed: dict[int, tuple] = {}
    for _ in range(3000):
        op = rng.random()
        node = nodes[int(rng.integers(len(nodes)))]
        if op < 0.45 and node.id not in filed:
            node.skey = int(rng.integers(0, 5))  # few keys: many ties
            filed[node.id] = entry = (node.skey, next(seq), node.id)
            bisect.insort(model, entry)
            index.add(node)
        elif op < 0.75 and node.id in filed:
            model.remove(filed.pop(node.id))
            index.remove(node)
        else:
            got = index.pop()
            want = model.pop(0) if model else None
            assert (got.id if got is not None else None) == (want[2] if want else None)
            if want:
                del filed[want[2]]
        assert len(index) == len(model)
        assert {n.id for n in index} == set(filed)
    index.check_invariants()
    assert len(index._heap) <= 2 * len(index) + _SLACK + 1  # stale entries are compacted


def test_filing_twice_raises_and_changes_nothing():
    index, node = LeafIndex(), Leaf(7)
    node.skey = 1
    index.add(node)
    with pytest.raises(InvariantError, match="7"):
        index.add(node)
    index.check_invariants()
    assert index.pop() is node and index.pop() is None


def test_check_invariants_names_a_broken_entry():
    index, nodes = LeafIndex(), [Leaf(i) for i in range(5)]
    for n in nodes:
        n.skey = n.id
        index.add(n)
    nodes[3].skey = 99  # changed behind the index's back
    with pytest.raises(InvariantError, match=r"stale key \[3\]"):
        index.check_invariants()
    nodes[3].skey = 3
    index._heap[0], index._heap[4] = index._heap[4], index._heap[0]
    with pytest.raises(InvariantError, match="heap order"):
        index.check_invariants()
