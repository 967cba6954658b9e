"""SGLang 0.5.23, on the real ``allocator/base.py``, ``token.py`` and ``paged.py`` from the wheel in
KVGUARD_ENGINE_CACHE, and ``ReqToTokenPool`` from ``memory_pool.py`` (that class only: the file
needs Triton at import; its memory saver is a no-op). The paged allocator runs its torch
fallbacks (``alloc_extend_naive``/``alloc_decode_naive``), with the platform saying no Triton.

sglang#36739 fixed free groups; its test runs the 0.5.23 allocator with free groups as they were
before the fix (a flag beside the pending list, the list never cleared), release path unchanged.
"""

import types

import pytest
import torch

import kvguard
from kvguard.guard import step_aside_when
from kvguard.adapters.sglang import PAGED_ALLOCATOR, REQ_TO_TOKEN_POOL, SPECS, TOKEN_ALLOCATOR

from . import engines


@pytest.fixture(scope="module")
def sg():
    with engines.loaded("sglang") as ns:
        yield ns


def token_allocator(sg, size=8, cls=None):
    cls = cls or sg.TokenToKVPoolAllocator
    return cls(size=size, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)


def paged_allocator(sg, size=32, page_size=4):
    return sg.PagedTokenToKVPoolAllocator(size=size, page_size=page_size, dtype=torch.float16,
                                          device="cpu", kvcache=None, need_sort=False)


def free_list(a):
    return a.free_pages.tolist(), a.release_pages.tolist(), a.available_size()


def test_the_builtin_specs_are_found_for_the_real_classes(sg):
    registry = kvguard.registry
    assert registry.spec_for(sg.TokenToKVPoolAllocator) is SPECS[TOKEN_ALLOCATOR]
    assert registry.spec_for(sg.PagedTokenToKVPoolAllocator) is SPECS[PAGED_ALLOCATOR]
    assert registry.spec_for(sg.ReqToTokenPool) is SPECS[REQ_TO_TOKEN_POOL]
    kvguard.instrument()
    for a in (token_allocator(sg), paged_allocator(sg),
              sg.ReqToTokenPool(size=4, max_context_len=8, device="cpu",
                                enable_memory_saver=False)):
        g = kvguard.guard_of(a)
        assert g is not None and g.ledger().learn is False and g.live == {}


def test_token_allocator_frees_int32_views_of_req_to_token(sg):
    a = token_allocator(sg)
    g = kvguard.guard(a)
    req_to_token = torch.zeros((2, 8), dtype=torch.int32)
    req_to_token[1, :3] = a.alloc(3)
    a.free(req_to_token[1, :2])
    a.free(req_to_token[1, 2:3])
    assert g.violations == [] and g.live == {} and g.check() == {None: (0, 0)}
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(req_to_token[1, :1])


def test_unguarded_a_bool_mask_frees_padding_slot_0(sg):
    """The control: ``torch.cat`` promotes the mask to 0/1."""
    a = token_allocator(sg)
    a.alloc(4)
    a.free(torch.tensor([True, False, True, False]))
    assert a.free_pages.tolist() == [5, 6, 7, 8, 1, 0, 1, 0]
    assert a.alloc(8).tolist().count(1) == 2  # slot 1 handed out twice, padding slot 0 too


def test_regression_sglang_bool_tensor_free(sg):
    """A bool mask passed to ``free()`` (the ids it selects were meant): caught at the call."""
    a = token_allocator(sg)
    g = kvguard.guard(a)
    ids = a.alloc(4)
    mask = ids > 2
    before = free_list(a)
    with pytest.raises(kvguard.BoolIdError) as info:
        a.free(mask)
    assert free_list(a) == before and sorted(g.live) == [1, 2, 3, 4]
    assert "mask.nonzero()" in info.value.violation.message
    a.free(ids[mask])  # what was meant
    assert sorted(g.live) == [1, 2]


@pytest.mark.parametrize("kind, bad", [
    ("foreign-id", lambda ids: torch.tensor([0])),                  # padding slot
    ("invalid-id", lambda ids: torch.tensor([9])),                  # past the pool
    ("duplicate-id", lambda ids: torch.cat([ids[:1], ids[:1]])),    # token free never dedups
    ("invalid-id", lambda ids: ids.float()),
    ("invalid-id", lambda ids: ids.reshape(1, -1)),
])
def test_token_allocator_rejects_bad_ids_with_nothing_changed(sg, kind, bad):
    a = token_allocator(sg)
    g = kvguard.guard(a)
    ids = a.alloc(3)
    before = free_list(a)
    with pytest.raises(kvguard.KVGuardError) as info:
        a.free(bad(ids))
    assert info.value.kind == kind and free_list(a) == before
    assert sorted(g.live) == ids.tolist()


def test_deferred_frees_are_checked_at_the_deferred_call(sg):
    a = token_allocator(sg)
    g = kvguard.guard(a)
    x = a.alloc(3)
    a.free_group_begin()
    a.free(x[:2])
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(x[1:2])  # would be released twice when the group ends
    a.free(x[2:])
    assert a.available_size() == 5  # nothing released yet
    a.free_group_end()
    a.free_group_end()  # since sglang#36739, a second end frees nothing
    assert a.available_size() == 8 and g.live == {} and len(g.violations) == 1


def test_check_agrees_inside_an_open_free_group(sg):
    """Frees deferred by ``free_group_begin()`` are given up by the caller (the ledger counts
    them at the deferred call) but still off the free list (``available_size()`` counts them
    at ``free_group_end()``): ``check()`` counts them as free on both sides."""
    a = token_allocator(sg)
    g = kvguard.guard(a)
    x = a.alloc(5)
    a.free_group_begin()
    a.free(x[:2])
    a.free(x[2:3])
    assert a.available_size() == 3  # nothing released yet
    assert g.check() == {None: (-2, -2)}
    a.free_group_end()
    assert a.available_size() == 6 and g.check() == {None: (-2, -2)}
    a.free_group_begin()
    a.free_group_end()  # an empty group
    assert g.check() == {None: (-2, -2)}


def test_check_agrees_inside_a_free_group_before_the_36739_fix(sg):
    """Before sglang#36739 the pending list outlived the group: only an open group's frees are
    deferred ones."""
    a = token_allocator(sg, cls=before_fix_36739(sg.TokenToKVPoolAllocator))
    g = kvguard.guard(a)
    x = a.alloc(4)
    a.free_group_begin()
    a.free(x[:3])
    assert g.check() == {None: (-1, -1)}
    a.free_group_end()  # the stale list stays behind, closed
    assert a.free_group and g.check() == {None: (-1, -1)}


def test_check_agrees_inside_a_free_group_of_the_paged_allocator(sg):
    """The paged allocator's deferred frees reach the ledger when the group ends: both sides
    count them then."""
    p = paged_allocator(sg)
    g = kvguard.guard(p)
    tokens = p.alloc(12)
    p.free_group_begin()
    p.free(tokens[:4])
    p.free_page_ids(tokens[4:5] // 4)
    assert g.check() == {None: (-3, -3)} and len(g.live) == 3
    p.free_group_end()
    assert g.check() == {None: (-1, -1)} and len(g.live) == 1


def resize_config(tokens):
    """What ``resize()`` reads of SGLang's ``ModelRunner`` config."""
    return types.SimpleNamespace(max_total_num_tokens=tokens)


def test_resize_grows_the_ledger_with_the_pool(sg):
    a = token_allocator(sg, size=8)
    g = kvguard.guard(a)
    old = a.alloc(3)
    a.resize(resize_config(16))
    assert g.ledger().size == a.size + 1 == 17 and g.live == {}
    assert g.check() == {None: (0, 0)}  # counted from the rebuilt pool
    x = a.alloc(16)  # ids 9..16 exist now
    assert sorted(g.live) == list(range(1, 17)) and g.violations == []
    a.free(x)
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(old[:1])  # held across the resize, which gave it back
    assert g.check() == {None: (0, 0)}


def test_resize_shrinks_the_ledger_and_ids_past_it_are_out_of_range(sg):
    a = token_allocator(sg, size=16)
    g = kvguard.guard(a)
    x = a.alloc(16)
    a.resize(resize_config(8))
    assert g.ledger().size == 9 and len(g.ledger()) == 9 and g.live == {}
    before = free_list(a)
    with pytest.raises(kvguard.InvalidIdError) as info:
        a.free(x[-2:])  # slots 15 and 16 no longer exist
    assert "outside the pool [0, 9)" in info.value.violation.message
    assert free_list(a) == before
    y = a.alloc(8)
    a.free(y)
    assert g.check() == {None: (0, 0)} and g.violations[1:] == []


def test_resize_of_the_paged_allocator_follows_its_pages(sg):
    p = paged_allocator(sg, size=32, page_size=4)
    g = kvguard.guard(p)
    p.alloc(8)
    p.resize(resize_config(64))
    assert g.ledger().size == p.num_pages + 1 == 17 and g.live == {}
    tokens = p.alloc(64)
    assert len(g.live) == 16 and g.violations == []
    p.free(tokens)
    assert g.check() == {None: (0, 0)}


def before_fix_36739(base):
    class FreeGroupsBeforeFix(base):
        """``free_group_begin``/``end`` as before sglang#36739: a flag says whether frees are
        deferred, and ``free_group`` is never cleared. Releases go through 0.5.23's own
        ``free()``, which releases when ``free_group`` is None."""

        is_not_in_free_group = True

        def free_group_begin(self):
            self.is_not_in_free_group = False
            self.free_group = []

        def free_group_end(self):
            self.is_not_in_free_group = True
            if self.free_group:
                self.free(torch.cat(self.free_group))

        def free(self, free_index):
            if not self.is_not_in_free_group:
                self.free_group.append(free_index.clone())
                return
            group, self.free_group = self.free_group, None
            try:
                super().free(free_index)
            finally:
                self.free_group = group
    return FreeGroupsBeforeFix


def test_unguarded_a_second_free_group_end_frees_the_group_again(sg):
    """The control for sglang#36739."""
    a = token_allocator(sg, cls=before_fix_36739(sg.TokenToKVPoolAllocator))
    x = a.alloc(2)
    a.free_group_begin()
    a.free(x)
    a.free_group_end()
    a.free_group_end()
    assert a.available_size() == 10 > a.size


def test_regression_sglang_36739_second_free_group_end(sg):
    """sglang#36739: ``free_group_end()`` cleared the flag but left the list, so calling it
    twice released the same slots again. Caught at the second call."""
    a = token_allocator(sg, cls=before_fix_36739(sg.TokenToKVPoolAllocator))
    g = kvguard.guard(a)
    x = a.alloc(2)
    a.free_group_begin()
    a.free(x)
    a.free_group_end()
    assert g.violations == [] and a.available_size() == 8
    with pytest.raises(kvguard.DoubleFreeError) as info:
        a.free_group_end()
    assert info.value.block_ids == tuple(x.tolist()) and a.available_size() == 8
    assert "free_group_end" in [f["function"].rpartition(".")[2]
                                for f in info.value.violation.to_dict()["call_stack"]]


def test_class_level_calls_with_overrides_that_call_super(sg):
    """While instrumented, class-level calls reach the instance's guard (see kvguard.registry),
    also where a subclass overrides a guarded method and calls ``super()``, and where a wrapper
    forwards without holding the guard's lock (``checking``, ``settled``): those inner calls
    run the engine's function and never come back to the wrapper."""
    kvguard.instrument()
    token = sg.TokenToKVPoolAllocator
    base = token_allocator(sg)
    sub = token_allocator(sg, cls=before_fix_36739(token))
    paged = paged_allocator(sg)
    gb, gs, gp = (kvguard.guard_of(a) for a in (base, sub, paged))
    x = sub.alloc(2)
    sub.free(x)  # the override calls super().free(): the base function, counted once
    assert gs.live == {} and gs.stats.free_calls == 1 and sub.available_size() == 8
    y = base.alloc(2)
    token.free(base, y)
    with pytest.raises(kvguard.DoubleFreeError):
        token.free(base, y[:1])
    z = sub.alloc(1)
    type(sub).free(sub, z)
    with pytest.raises(kvguard.DoubleFreeError):
        type(sub).free(sub, z)
    assert (base.available_size(), sub.available_size()) == (8, 8)
    sub.free_group_begin()
    type(sub).free(sub, sub.alloc(1))
    type(sub).free_group_end(sub)
    token.free_group_begin(base)
    token.free(base, base.alloc(1))
    token.free_group_end(base)
    assert gb.live == {} and gs.live == {} and gb.check() == gs.check() == {None: (0, 0)}

    tokens = sg.PagedTokenToKVPoolAllocator.alloc(paged, 8)
    assert len(gp.live) == 2
    paged.free_group_begin()
    sg.PagedTokenToKVPoolAllocator.free(paged, tokens[:4])
    sg.PagedTokenToKVPoolAllocator.free_group_end(paged)  # super() into the base's end
    with pytest.raises(kvguard.BoolIdError):
        sg.PagedTokenToKVPoolAllocator.free(paged, tokens > 0)
    with pytest.raises(kvguard.DoubleFreeError):
        sg.PagedTokenToKVPoolAllocator.free(paged, tokens[:1])
    assert len(gp.live) == 1 and gp.check() == {None: (-1, -1)}
    assert len(gb.violations) + len(gs.violations) + len(gp.violations) == 4


def test_clear_returns_every_slot(sg):
    a = token_allocator(sg)
    g = kvguard.guard(a)
    a.alloc(5)
    a.clear()
    assert g.live == {}
    a.free(a.alloc(8))
    assert g.violations == [] and g.check() == {None: (0, 0)}


def test_paged_allocator_is_tracked_by_page(sg):
    p = paged_allocator(sg)
    g = kvguard.guard(p)
    tokens = p.alloc(8)  # two pages of four slots
    pages = sorted(set((tokens // 4).tolist()))
    assert sorted(g.live) == pages
    p.free(torch.cat([tokens, tokens]))  # within one call: SGLang de-duplicates pages itself
    assert g.violations == [] and g.live == {} and g.check() == {None: (0, 0)}


def test_paged_allocator_catches_a_page_freed_in_two_calls(sg):
    p = paged_allocator(sg)
    g = kvguard.guard(p)
    tokens = p.alloc(8)
    p.free(tokens[:3])
    before = p.free_pages.tolist()
    with pytest.raises(kvguard.DoubleFreeError) as info:
        p.free(tokens[3:5])  # slot 3 is on the first page, freed already
    assert info.value.block_ids == (int(tokens[0]) // 4,) and p.free_pages.tolist() == before
    with pytest.raises(kvguard.DuplicateIdError):
        p.free_page_ids(torch.tensor([int(tokens[4]) // 4] * 2))  # "no page twice, no dedup"
    assert sorted(g.live) == [int(tokens[4]) // 4]


def test_paged_allocator_names_a_bool_mask_before_it_becomes_page_0(sg):
    p = paged_allocator(sg)
    g = kvguard.guard(p)
    tokens = p.alloc(4)
    before = p.free_pages.tolist()
    with pytest.raises(kvguard.BoolIdError):
        p.free(tokens > 0)
    assert p.free_pages.tolist() == before and g.violations[0].method == "free"


def test_paged_extend_and_decode_hand_out_new_pages_only(sg):
    p = paged_allocator(sg)
    g = kvguard.guard(p)
    zero = torch.tensor([0])
    out = p.alloc_extend(zero, zero, torch.tensor([6]), torch.tensor([6]), torch.tensor([-1]),
                         extend_num_tokens=6)
    assert sorted(g.live) == sorted(set((out // 4).tolist()))  # 6 slots: two pages
    last = out[-1:]
    d = p.alloc_decode(torch.tensor([7]), torch.tensor([7]), last)  # slot 7 of page 2
    assert len(g.live) == 2 and int(d) // 4 == int(last) // 4
    d = p.alloc_decode(torch.tensor([9]), torch.tensor([9]), d + 1)  # slot 9: a new page
    assert len(g.live) == 3 and int(d) % 4 == 0
    p.free_group_begin()
    p.free(torch.cat([out, d]))
    assert len(g.live) == 3  # deferred: checked when the group releases it
    p.free_group_end()
    assert g.live == {} and g.violations == [] and g.check() == {None: (0, 0)}


def test_regression_sglang_36739_on_the_paged_allocator(sg):
    p = paged_allocator(sg)
    p.__class__ = before_fix_36739(sg.PagedTokenToKVPoolAllocator)
    p.free_page_ids_group = []
    g = kvguard.guard(p)
    tokens = p.alloc(4)
    p.free_group_begin()
    p.free(tokens)
    p.free_group_end()
    with pytest.raises(kvguard.DoubleFreeError):
        p.free_group_end()
    assert g.stats.violations == {"double-free": 1}


def test_req_to_token_rows(sg):
    rows = sg.ReqToTokenPool(size=4, max_context_len=8, device="cpu", enable_memory_saver=False)
    g = kvguard.guard(rows)
    got = rows.alloc_rows(2)
    with pytest.raises(kvguard.ForeignIdError):
        rows.free_rows([0])  # the padding row
    with pytest.raises(kvguard.DuplicateIdError):
        rows.free_rows([got[0], got[0]])
    assert rows.free_slots == [1, 2]
    rows.free_rows(got)
    with pytest.raises(kvguard.DoubleFreeError):
        rows.free_rows(got[:1])
    assert g.check() == {None: (0, 0)}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_slots_views_groups_and_pages(sg):
    a = sg.TokenToKVPoolAllocator(size=64, dtype=torch.float16, device="cuda", kvcache=None,
                                  need_sort=False)
    x = a.alloc(8)
    g = kvguard.guard(a)  # attached while busy: the live slots come from the CUDA free list
    assert x.is_cuda and sorted(g.live) == x.tolist()
    req_to_token = torch.zeros((2, 16), dtype=torch.int32, device="cuda")
    req_to_token[1, :8] = x
    a.free(req_to_token[1, :4])
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(req_to_token[1, :1])
    with pytest.raises(kvguard.BoolIdError):
        a.free(x > 4)
    a.free_group_begin()
    a.free(req_to_token[1, 4:8])
    a.free_group_end()
    assert g.live == {} and g.check() == {None: (8, 8)}
    p = sg.PagedTokenToKVPoolAllocator(size=256, page_size=16, dtype=torch.float16,
                                       device="cuda", kvcache=None, need_sort=False)
    gp = kvguard.guard(p)
    tokens = p.alloc(32)
    zero = torch.zeros(1, dtype=torch.int64, device="cuda")
    out = p.alloc_extend(zero, zero.cpu(), torch.tensor([20], device="cuda"), torch.tensor([20]),
                         torch.tensor([-1], device="cuda"), extend_num_tokens=20)
    assert len(gp.live) == 4
    p.free(torch.cat([tokens, tokens]))
    with pytest.raises(kvguard.DoubleFreeError):
        p.free(tokens[:1])
    p.free(out)
    assert gp.live == {} and gp.check() == {None: (0, 0)}


def debug_paged_allocator(sg, monkeypatch):
    """The paged allocator as SGLang's ``TestPagedAllocatorDebugModeCPU`` builds it: debug mode
    (``SGLANG_DEBUG_MEMORY_POOL=1``) checks the free list for a page twice after every free."""
    monkeypatch.setenv("SGLANG_DEBUG_MEMORY_POOL", "1")
    return sg.PagedTokenToKVPoolAllocator(size=64, page_size=4, dtype=torch.int64, device="cpu",
                                          kvcache=None, need_sort=False)


def test_stepping_aside_lets_the_debug_check_see_a_double_free(sg, monkeypatch):
    """A guard told to step aside (as the plugin does inside ``assertRaises(AssertionError)``)
    records the double free and lets it reach SGLang, whose debug-mode check raises. The ledger
    then follows the allocator: the page is free in both, and ``check()`` agrees from here."""
    a = debug_paged_allocator(sg, monkeypatch)
    assert a.debug_mode
    g = kvguard.guard(a)
    out = a.alloc(4)
    a.free(out)
    asked = []
    remove = step_aside_when(lambda error: asked.append(error) or True)
    try:
        with pytest.raises(AssertionError):
            a.free(out)  # SGLang's own: the page is on its free list twice now
    finally:
        remove()
    assert asked == [kvguard.DoubleFreeError]
    (v,) = g.violations
    assert v.kind == "double-free" and v.extra["stepped_aside"] is True
    page = out[0].item() // 4
    assert a.free_pages.tolist().count(page) == 2 and page not in g.live
    assert g.check()[None][0] == g.check()[None][1]
    assert g.live == {}
    first = a.alloc(4)  # the ledger goes on from the allocator as it is now: corrupt
    assert first[0].item() // 4 == page and sorted(g.live) == [page]
    with pytest.raises(kvguard.SharedBlockError):
        a.alloc(4)  # the page's second copy on the free list


def test_without_stepping_aside_the_guard_raises_first(sg, monkeypatch):
    a = debug_paged_allocator(sg, monkeypatch)
    kvguard.guard(a)
    out = a.alloc(4)
    a.free(out)
    before = a.free_pages.tolist(), a.available_size()
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(out)
    assert (a.free_pages.tolist(), a.available_size()) == before


class _KV:
    """What ``ReqToTokenPool`` reads of a request's ``kv`` record (a small stand-in for SGLang's
    ``Req``, whose module imports the scheduler's world)."""

    def __init__(self):
        self.req_pool_idx = None
        self.kv_allocated_len = 0

    @property
    def holds_kv(self):
        return self.req_pool_idx is not None


def _req(rid):
    import types
    return types.SimpleNamespace(rid=rid, kv=_KV())


def test_a_late_free_of_an_aborted_requests_row_is_stale(sg):
    """The overlap loop's shape: an abort frees R's row while R's batch is in flight; Q is given
    the same row; R's late result frees it again (with the row index R kept)."""
    kvguard.instrument()
    try:
        pool = sg.ReqToTokenPool(size=1, max_context_len=8, device="cpu",
                                 enable_memory_saver=False)
        g = kvguard.guard_of(pool)
        r, q = _req("R"), _req("Q")
        (row,) = pool.alloc([r])
        kept = r.kv.req_pool_idx
        pool.free(r)                            # the abort
        assert pool.alloc([q]) == [row]         # Q is handed R's row
        r.kv.req_pool_idx = kept                # R's in-flight result still names it
        with pytest.raises(kvguard.StaleFreeError):
            pool.free(r)
        assert pool.free_slots == [] and g.live[row].holder == "Q"
        pool.free(q)
        assert [v.kind for v in g.violations] == ["stale-free"] and g.live == {}
    finally:
        kvguard.uninstrument()
