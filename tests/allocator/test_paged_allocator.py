"""PagedTokenToKVPoolAllocator: unit tests for every method and bad input, and state
machines (page sizes 1, 4, 16; need_sort on/off) driving alloc / alloc_extend /
alloc_decode / free / free groups / backup-restore against a plain-list model."""
import numpy as np
import pytest
import torch
from allocator_model import FreeListModel, FreeListRules, assert_unchanged, state_of
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixkv.allocator import (
    AllocatorStats,
    FreeGroupError,
    PagedTokenToKVPoolAllocator,
)
from radixkv.errors import (
    AlignmentError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    LengthMismatchError,
)


def T(x, device="cpu", dtype=torch.int64):
    return torch.tensor(x, dtype=dtype, device=device)


@pytest.fixture(params=["sorted", "runs"])
def free_path(request):
    """Frees of few slots sort them; large ones dedupe runs. Drive both on small data."""
    return request.param


def make(*args, free_path="sorted", **kw):
    a = PagedTokenToKVPoolAllocator(*args, **kw)
    if free_path == "runs":
        a._small_free = 0
    return a


# ------------------------------------------------------------------------------- units
def test_construction(device):
    kv = object()
    a = PagedTokenToKVPoolAllocator(70, 16, device, kvcache=kv)
    assert (a.size, a.page_size, a.num_pages) == (64, 16, 4)
    assert a.device == device and a.get_kvcache() is kv
    assert a.available_size() == 64
    assert a.stats() == AllocatorStats(64, 16, 4, 64, 4, 0, 0, 0)
    a.check_invariants()
    with pytest.raises(InvalidArgumentError):
        PagedTokenToKVPoolAllocator(64, 0)


def test_alloc_whole_pages(device):
    a = PagedTokenToKVPoolAllocator(32, 4, device)
    x = a.alloc(8)
    assert x.dtype == torch.int64 and x.device.type == device.type
    assert x.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert a.available_size() == 24
    before = state_of(a)
    with pytest.raises(AlignmentError):
        a.alloc(6)
    with pytest.raises(InvalidArgumentError):
        a.alloc(-4)
    assert a.alloc(28) is None
    assert_unchanged(a, before)
    assert a.alloc(0).numel() == 0
    a.check_invariants()


def test_free_frees_whole_pages(device, free_path):
    a = make(32, 4, device, free_path=free_path)
    x = a.alloc(12)  # pages 1, 2, 3
    a.free(x[[5, 1, 2]].to(torch.int32))  # slots of pages 2 and 1
    assert a.free_pages.tolist() == [4, 5, 6, 7, 8, 1, 2]
    assert a.is_free(T([4, 7, 8, 11, 12], device)).tolist() == [True, True, True, True, False]
    a.check_invariants()


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize(
    "slots, err, named",
    [
        ([2], InvalidIndexError, "[2]"),  # a slot of reserved page 0
        ([8, 36], InvalidIndexError, "[36]"),  # beyond page 8 (slots 32..35)
        ([8, 12], DoubleFreeError, "[3]"),  # page 3 was freed before
        ([8, 28], DoubleFreeError, "[7]"),  # page 7 never allocated
        ([8, 9, 8], DoubleFreeError, "[8]"),  # slot repeated in the call
        ([8, 9, 9], DoubleFreeError, "[9]"),  # repeated back to back
        # runs of consecutive slots (the per-run checks of free_runs, then the exact path)
        (list(range(4, 16)), DoubleFreeError, "[3]"),  # a run over freed page 3
        (list(range(16, 24)) + list(range(4, 18)), DoubleFreeError, "[16, 17]"),  # overlap
        (list(range(0, 8)), InvalidIndexError, "[0, 1, 2, 3]"),  # reaches page 0
        (list(range(16, 37)), InvalidIndexError, "[36]"),  # reaches past the last page
    ],
)
def test_free_bad_indices_leave_state_unchanged(device, need_sort, slots, err, named, free_path):
    a = make(32, 4, device, need_sort=need_sort, free_path=free_path)
    a.alloc(20)  # pages 1..5
    a.free(T([12], device))  # page 3
    before = state_of(a)
    with pytest.raises(err) as e:
        a.free(T(slots, device))
    assert named in str(e.value)
    assert_unchanged(a, before)
    a.check_invariants()
    assert a.alloc(8) is not None


def test_free_accepts_any_slot_order_and_split_runs(device, free_path):
    a = make(32, 4, device, free_path=free_path)
    x = a.alloc(12)  # pages 1, 2, 3 = slots 4..15
    a.free(T([8, 4, 9, 5], device))  # pages 2 and 1 each in two ascending runs
    assert a.free_pages.tolist() == [4, 5, 6, 7, 8, 1, 2]
    a.check_invariants()
    before = state_of(a)
    with pytest.raises(DoubleFreeError, match=r"slots repeated in one free call: \[13\]"):
        a.free(T([13, 12, 13], device))  # non-adjacent repeat
    assert_unchanged(a, before)
    a.free(T([15, 14, 13, 12], device))  # descending run
    assert a.free_pages.tolist()[-1] == 3
    a.check_invariants()
    assert x.numel() == 12


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("group", [False, True])
def test_free_of_a_partial_page_the_one_page_path(device, need_sort, group):
    """A request's unaligned tail: a few ascending slots of one page (the host fast path on
    CPU) frees the page once, wherever frees go (ring, release list, open group); a second
    free of any slot of that page, a repeated slot or a slot of page 0 is refused unchanged."""
    a = make(32, 4, device, need_sort=need_sort)
    x = a.alloc(12)  # pages 1, 2, 3
    if group:
        a.free_group_begin()
    a.free(x[4:7])  # slots 8, 9, 10 of page 2
    if group:
        a.free_group_end()
    assert a.available_size() == 6 * 4 and bool(a.is_free(T([11], device))[0])
    a.check_invariants()
    before = state_of(a)
    for slots, err in (([11], DoubleFreeError), ([9, 10], DoubleFreeError), ([13, 13], DoubleFreeError),
                       ([2, 3], InvalidIndexError)):
        with pytest.raises(err):
            a.free(T(slots, device))
        assert_unchanged(a, before)
    a.free(T([12, 13], device))  # page 3: ascending, one page
    assert a.available_size() == 7 * 4
    a.check_invariants()


def test_free_non_power_of_two_page_size(free_path):
    a = make(30, 3, free_path=free_path)
    x = a.alloc(9)  # pages 1..3 = slots 3..11
    a.free(x[3:7])  # slots 6..9: pages 2 and 3
    assert a.free_pages.tolist()[-2:] == [2, 3]
    with pytest.raises(InvalidIndexError):
        a.free(T([2]))
    a.check_invariants()


def test_free_wrong_dtype():
    a = PagedTokenToKVPoolAllocator(32, 4)
    a.alloc(8)
    before = state_of(a)
    for bad in (torch.tensor([4.0]), torch.tensor([True]), [4]):
        with pytest.raises(InvalidArgumentError):
            a.free(bad)
    assert_unchanged(a, before)


def test_alloc_extend_fills_the_prefix_page_then_fresh_pages(device):
    a = PagedTokenToKVPoolAllocator(64, 4, device)
    first = a.alloc_extend(T([0, 0], device), T([3, 6], device), T([-1, 0], device), 9)
    assert first.tolist() == [4, 5, 6, 8, 9, 10, 11, 12, 13]
    # request 0 grows 3 -> 7 (slot 7, then page 4); request 1 grows 6 -> 6 (nothing)
    out = a.alloc_extend(T([3, 6], device), T([7, 6], device), T([6, 13], device), 4)
    assert out.tolist() == [7, 16, 17, 18]
    assert a.stats().used_pages == 4
    a.check_invariants()


def test_alloc_extend_ignores_last_loc_without_prefix():
    a = PagedTokenToKVPoolAllocator(64, 4)
    out = a.alloc_extend(T([0]), T([2]), T([999]), 2)
    assert out.tolist() == [4, 5]


def test_alloc_extend_out_of_pages_returns_none_unchanged(device):
    for need_sort in (False, True):
        a = PagedTokenToKVPoolAllocator(16, 4, device, need_sort=need_sort)
        x = a.alloc(12)
        a.free(x[:4])  # one page pending (need_sort) or free
        if need_sort:  # as the seed, a short call merges release_pages before failing
            assert a.alloc_extend(T([0], device), T([9], device), T([-1], device), 9) is None
            assert a.release_pages.tolist() == [] and a.free_pages.tolist() == [1, 4]
        before = state_of(a)
        assert a.alloc_extend(T([0], device), T([9], device), T([-1], device), 9) is None
        assert_unchanged(a, before)
        assert a.alloc_decode(T([1, 1, 1], device), T([0, 0, 0], device)) is None
        assert_unchanged(a, before)


def test_alloc_extend_need_sort_merges_only_when_short():
    a = PagedTokenToKVPoolAllocator(24, 4, need_sort=True)
    x = a.alloc(20)  # pages 1..5 used, page 6 free
    a.free(x[[16, 4]])  # pages 5, 2 pending
    out = a.alloc_extend(T([0]), T([4]), T([-1]), 4)
    assert out.tolist() == [24, 25, 26, 27]  # page 6, no merge
    assert a.release_pages.tolist() == [2, 5]
    out = a.alloc_extend(T([0]), T([5]), T([-1]), 5)  # 2 pages: merge, ascending
    assert out.tolist() == [8, 9, 10, 11, 20]
    a.check_invariants()


@pytest.mark.parametrize(
    "args, err",
    [
        (([0, 0], [2, 3], [-1], 5), LengthMismatchError),
        (([0, 0], [2, 3], [-1, -1], 6), LengthMismatchError),  # extend_num_tokens wrong
        (([3], [2], [6], -1), InvalidArgumentError),
        (([3], [2], [6], 0), InvalidArgumentError),  # seq < prefix
        (([-1], [2], [6], 3), InvalidArgumentError),
        (([3], [5], [7], 2), AlignmentError),  # slot 7 ends page 1: prefix 4, not 3
        (([3], [5], [2], 2), InvalidIndexError),  # slot 2 is in reserved page 0
        (([3], [5], [70], 2), InvalidIndexError),  # beyond the last page
        (([3], [5], [14], 2), InvalidIndexError),  # page 3 is free
    ],
)
def test_alloc_extend_bad_arguments_leave_state_unchanged(args, err):
    a = PagedTokenToKVPoolAllocator(64, 4)
    a.alloc(8)  # pages 1, 2 in use
    before = state_of(a)
    pre, seq, last, n = args
    with pytest.raises(err):
        a.alloc_extend(T(pre), T(seq), T(last), n)
    assert_unchanged(a, before)
    with pytest.raises(InvalidArgumentError):
        a.alloc_extend(torch.tensor([0.0]), T([2]), T([-1]), 2)
    assert_unchanged(a, before)


def test_alloc_decode_crosses_pages_only_at_boundaries(device):
    a = PagedTokenToKVPoolAllocator(64, 4, device)
    x = a.alloc_extend(T([0, 0], device), T([3, 4], device), T([-1, -1], device), 7)
    assert x.tolist() == [4, 5, 6, 8, 9, 10, 11]
    d = a.alloc_decode(T([4, 5], device), T([6, 11], device))
    assert d.tolist() == [7, 12]  # request 1 crossed into page 3
    d = a.alloc_decode(T([5, 6], device), d)
    assert d.tolist() == [16, 13]
    assert a.alloc_decode(T([1], device), T([-5], device)).tolist() == [20]  # no prefix
    a.check_invariants()


@pytest.mark.parametrize(
    "seq, last, err",
    [
        ([2, 3], [4], LengthMismatchError),
        ([0], [4], InvalidArgumentError),
        ([3], [4], AlignmentError),  # token 1 is not at offset 0 of its page
        ([2], [20], InvalidIndexError),  # page 5 is free
    ],
)
def test_alloc_decode_bad_arguments(seq, last, err):
    a = PagedTokenToKVPoolAllocator(64, 4)
    a.alloc(8)
    before = state_of(a)
    with pytest.raises(err):
        a.alloc_decode(T(seq), T(last))
    assert_unchanged(a, before)


def test_free_group_and_backup_restore(device):
    a = PagedTokenToKVPoolAllocator(32, 4, device, need_sort=True)
    x = a.alloc_extend(T([0, 0], device), T([5, 4], device), T([-1, -1], device), 9)
    before = state_of(a)
    s = a.backup_state()
    d = a.alloc_decode(T([6, 5], device), T([8, 7], device))
    a.free_group_begin()
    a.free(x[:5])
    with pytest.raises(DoubleFreeError):
        a.free(x[[4]])  # page 2 pending in the group
    with pytest.raises(FreeGroupError):
        a.restore_state(s)
    a.free_group_end()
    a.free(d[1:])
    a.restore_state(s)
    assert_unchanged(a, before)
    a.check_invariants()


def test_clear_and_invariant_detection():
    a = PagedTokenToKVPoolAllocator(32, 4)
    a.alloc(8)
    a.clear()
    assert a.available_size() == 32 and a.free_pages.tolist() == list(range(1, 9))
    a.alloc(8)
    a._fl._not_in_use[1] = True
    with pytest.raises(InvariantError, match=r"leaked\): \[1\]"):
        a.check_invariants()


def test_checks_false_still_correct_on_good_input(free_path):
    a = make(32, 4, checks=False, free_path=free_path)
    x = a.alloc_extend(T([0]), T([6]), T([-1]), 6)
    a.free(x[[5, 0, 4, 1, 2, 3]])
    assert a.available_size() == 32
    a.check_invariants()


def test_seeded_stress_requests():
    rng = np.random.default_rng(11)
    ps = 4
    a = PagedTokenToKVPoolAllocator(400, ps, need_sort=True)
    reqs = {}
    rid = 0
    for step in range(200):
        r = rng.random()
        if reqs and r < 0.3:
            k = list(reqs)[int(rng.integers(len(reqs)))]
            a.free(T(reqs.pop(k)))
        elif reqs and r < 0.6:
            ks = list(reqs)
            seq = T([len(reqs[k]) + 1 for k in ks])
            out = a.alloc_decode(seq, T([reqs[k][-1] for k in ks]))
            if out is not None:
                for k, s in zip(ks, out.tolist()):
                    reqs[k].append(s)
        else:
            n = int(rng.integers(1, 30))
            out = a.alloc_extend(T([0]), T([n]), T([-1]), n)
            if out is not None:
                reqs[rid] = out.tolist()
                rid += 1
        slots = [s for v in reqs.values() for s in v]
        assert len(slots) == len(set(slots))
        pages = {s // ps for s in slots}
        assert a.stats().used_pages == len(pages)
        assert not a.is_free(T(slots)).any() if slots else True
        if step % 40 == 0:
            a.check_invariants()
    a.check_invariants()


# ----------------------------------------------------------------------- state machine
def expected_extend(model, pre, seq, last):
    """The slots alloc_extend must return, taking pages from the model."""
    ps = model.ps
    need = sum(-(-s // ps) - (-(-p // ps)) for p, s in zip(pre, seq))
    pages = model.alloc(need)
    if pages is None:
        return None
    out, nxt = [], 0
    for p, s, ll in zip(pre, seq, last):
        page = None
        for pos in range(p, s):
            if pos < -(-p // ps) * ps:
                out.append(ll + 1 + pos - p)
                continue
            if page is None or pos % ps == 0:
                page, nxt = pages[nxt], nxt + 1
            out.append(page * ps + pos % ps)
    return out


class PagedAllocatorMachine(FreeListRules, RuleBasedStateMachine):
    page_size = 4
    num_pages = 8

    @initialize(need_sort=st.booleans(), runs=st.booleans())
    def create(self, need_sort, runs):
        ps = self.page_size
        self.a = make(self.num_pages * ps + ps - 1, ps, need_sort=need_sort,
                      free_path="runs" if runs else "sorted")
        self.m = FreeListModel(self.num_pages, need_sort)
        self.m.ps = ps
        self.reqs = {}  # rid -> list of slots (token order)
        self.next_rid = 0
        self.freed_slots = []
        self.backups, self.stale = [], []

    def _used_pages(self):
        return {s // self.page_size for v in self.reqs.values() for s in v}

    def _extend(self, rids, pre, seq, last):
        n = sum(s - p for p, s in zip(pre, seq))
        got = self.a.alloc_extend(T(pre, dtype=torch.int32), T(seq), T(last), n)
        want = expected_extend(self.m, pre, seq, last)
        assert (None if got is None else got.tolist()) == want
        event("alloc_extend: " + ("out of pages" if want is None else "ok"))
        if want is not None:
            i = 0
            for rid, p, s in zip(rids, pre, seq):
                self.reqs.setdefault(rid, []).extend(want[i : i + s - p])
                i += s - p

    @rule(lens=st.lists(st.integers(0, 10), min_size=1, max_size=3))
    def new_requests(self, lens):
        rids = list(range(self.next_rid, self.next_rid + len(lens)))
        self.next_rid += len(lens)
        self._extend(rids, [0] * len(lens), lens, [-1] * len(lens))
        for rid in rids:
            if not self.reqs.get(rid):
                self.reqs.pop(rid, None)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def extend(self, data):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=3, unique=True))
        ext = data.draw(st.lists(st.integers(0, 9), min_size=len(rids), max_size=len(rids)))
        pre = [len(self.reqs[r]) for r in rids]
        self._extend(rids, pre, [p + e for p, e in zip(pre, ext)], [self.reqs[r][-1] for r in rids])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def decode(self, data):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=4, unique=True))
        seq = [len(self.reqs[r]) + 1 for r in rids]
        last = [self.reqs[r][-1] for r in rids]
        got = self.a.alloc_decode(T(seq), T(last, dtype=torch.int32))
        want = expected_extend(self.m, [s - 1 for s in seq], seq, last)
        assert (None if got is None else got.tolist()) == want
        if want is not None:
            for r, s in zip(rids, want):
                self.reqs[r].append(s)

    @rule(k=st.integers(0, 3))
    def alloc_pages(self, k):
        got = self.a.alloc(k * self.page_size)
        pages = self.m.alloc(k)
        if pages is None:
            assert got is None
            return
        want = [p * self.page_size + o for p in pages for o in range(self.page_size)]
        assert got.tolist() == want
        if want:
            self.reqs[self.next_rid] = want
            self.next_rid += 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        slots = self.reqs.pop(rid)
        order = data.draw(st.permutations(slots))
        self.a.free(T(order, dtype=data.draw(st.sampled_from([torch.int32, torch.int64]))))
        self.m.free(sorted({s // self.page_size for s in slots}))
        self.freed_slots.append(slots[0])

    @rule(data=st.data())
    def bad_free(self, data):
        ps, n = self.page_size, self.num_pages
        choices = [st.integers(0, ps - 1), st.integers((n + 1) * ps, (n + 2) * ps)]
        free_now = [s for s in self.freed_slots if s // ps not in self._used_pages()]
        if free_now:
            choices.append(st.sampled_from(free_now))
        slot = data.draw(st.one_of(*choices))
        ids = [slot]
        if self.reqs and data.draw(st.booleans()):
            ids = [self.reqs[sorted(self.reqs)[0]][0]] * 2  # a slot twice in one call
        before = state_of(self.a)
        with pytest.raises((InvalidIndexError, DoubleFreeError)):
            self.a.free(T(ids))
        assert_unchanged(self.a, before)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def bad_extend(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        p = len(self.reqs[rid])
        before = state_of(self.a)
        with pytest.raises((AlignmentError, LengthMismatchError, InvalidIndexError)):
            if self.page_size > 1 and data.draw(st.booleans()):  # last_loc misaligned
                self.a.alloc_extend(T([p]), T([p + 1]), T([self.reqs[rid][-1] + 1]), 1)
            else:
                self.a.alloc_extend(T([p]), T([p + 2]), T([self.reqs[rid][-1]]), 3)
        assert_unchanged(self.a, before)

    def _snapshot_extra(self):
        return {k: list(v) for k, v in self.reqs.items()}

    def _restore_extra(self, reqs):
        self.reqs = {k: list(v) for k, v in reqs.items()}

    @rule()
    def clear(self):
        self.a.clear()
        model = FreeListModel(self.num_pages, self.m.need_sort)
        model.ps = self.page_size
        self._cleared(model)
        self.reqs = {}

    @invariant()
    def matches_model(self):
        self.a.check_invariants()
        assert self.a.free_pages.tolist() == self.m.free_pages
        assert self.a.release_pages.tolist() == self.m.release
        assert self.a.available_size() == self.m.available() * self.page_size
        slots = [s for v in self.reqs.values() for s in v]
        assert len(slots) == len(set(slots))
        used = self._used_pages()
        assert self.a.stats().used_pages == len(used)
        if slots:
            assert not bool(self.a.is_free(T(slots)).any())


class PagedMachinePS1(PagedAllocatorMachine):
    page_size, num_pages = 1, 24


class PagedMachinePS16(PagedAllocatorMachine):
    page_size, num_pages = 16, 4


TestPagedMachinePS4 = PagedAllocatorMachine.TestCase
TestPagedMachinePS1 = PagedMachinePS1.TestCase
TestPagedMachinePS16 = PagedMachinePS16.TestCase

# More examples than the profile's default: these machines are cheap and the bugs they
# catch (backup lineage, merges) need longer runs. Inherits the loaded profile otherwise.
TestPagedMachinePS4.settings = settings(max_examples=150)
TestPagedMachinePS1.settings = settings(max_examples=150)
TestPagedMachinePS16.settings = settings(max_examples=150)
