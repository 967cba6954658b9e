"""The adapter wrappers (kvguard.adapters.methods) on a small allocator built for the purpose.

``Batched`` hands ids out and takes them back through two methods each (like LMCache's
allocate/batched_allocate), has a reset (like Hugging Face's CachePool) and SGLang-style free
groups, so every installer is exercised without an engine.
"""

import pytest

import kvguard
from kvguard.adapters.methods import adapter, allocating, checking, freeing, resetting, settled


class Batched:
    def __init__(self, n):
        self.n = n
        self.free_ids = list(range(n))
        self.group = None

    def allocate(self, k):
        out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
        return out

    def allocate_pairs(self, k):
        """Hands out k ids as the doubled values the ledger does not track (2*id)."""
        return [2 * b for b in self.allocate(k)]

    def free(self, ids):
        if self.group is not None:
            self.group.extend(ids)
        else:
            self.free_ids.extend(ids)

    def free_many(self, ids, note=None):
        self.free_ids.extend(ids)

    def release(self, ids):
        """Frees through the spec's own free(): bookkeeping stays there."""
        self.free(list(ids))

    def begin(self):
        self.group = []

    def end(self):
        pending, self.group = self.group, None
        if pending:
            self.free(pending)

    def reset(self):
        self.free_ids = list(range(self.n))

    def num_free(self):
        return len(self.free_ids)


SPEC = kvguard.AllocatorSpec(
    size="n", free_count="num_free",
    adapter=adapter(allocating("allocate_pairs", lambda a, ids: [b // 2 for b in ids]),
                    freeing("free_many"), checking("release"), resetting("reset"),
                    settled("end", lambda a: a.group is not None)),
)


def test_extra_methods_share_the_guards_ledger():
    a = Batched(8)
    g = kvguard.guard(a, SPEC)
    x = a.allocate(2)
    y = a.allocate_pairs(2)
    assert sorted(g.live) == [0, 1, 2, 3]
    a.free_many(x)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        a.free_many([x[0]])
    assert info.value.violation.method == "free_many"
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(x[:1])
    a.free_many(ids=[b // 2 for b in y])
    assert g.live == {} and g.check() == {None: (0, 0)}
    assert g.stats.alloc_calls == 2 and g.stats.free_calls == 2


def test_a_converted_allocation_that_hands_out_a_live_id_is_shared_block():
    a = Batched(4)
    g = kvguard.guard(a, SPEC)
    a.allocate(1)
    a.free_ids.insert(0, 0)  # the allocator's free list is corrupt: 0 is live and listed free
    with pytest.raises(kvguard.KVGuardError) as info:
        a.allocate_pairs(1)
    assert info.value.kind == "shared-block" and info.value.violation.method == "allocate_pairs"
    assert g.violations[-1].block_ids == (0,)


def test_checking_names_a_malformed_argument_and_leaves_the_bookkeeping_to_free():
    a = Batched(4)
    g = kvguard.guard(a, SPEC)
    x = a.allocate(2)
    with pytest.raises(kvguard.BoolIdError):
        a.release([True])
    assert a.num_free() == 2
    a.release(x)  # the inner free() is checked and counted
    assert g.live == {} and g.stats.free_calls == 1
    with pytest.raises(kvguard.DoubleFreeError):
        a.release(x)


def test_reset_empties_the_ledger():
    a = Batched(4)
    g = kvguard.guard(a, SPEC)
    a.allocate(3)
    a.reset()
    assert g.live == {}
    assert a.allocate(4) == [0, 1, 2, 3]  # handed out again: not mistaken for a shared block
    assert g.violations == [] and g.history[-2][-1] == "reset"


def test_settled_group_end_releases_what_was_checked_at_the_deferred_calls():
    a = Batched(4)
    g = kvguard.guard(a, SPEC)
    x = a.allocate(2)
    a.begin()
    a.free(x[:1])
    with pytest.raises(kvguard.DoubleFreeError):  # caught at the deferred call itself
        a.free(x[:1])
    a.free(x[1:])
    a.end()
    assert g.violations[-1].kind == "double-free" and len(g.violations) == 1
    assert sorted(a.free_ids) == [0, 1, 2, 3] and g.check() == {None: (0, 0)}


class Leaky(Batched):
    """Free groups as SGLang had them before sglang#36739: a flag says whether frees are
    deferred, and the pending list is never cleared, so a second end() frees it again."""

    deferring = False

    def begin(self):
        self.deferring, self.group = True, []

    def free(self, ids):
        (self.group if self.deferring else self.free_ids).extend(ids)

    def end(self):
        self.deferring = False
        if self.group:
            self.free(self.group)


LEAKY_SPEC = SPEC.replace(adapter=adapter(settled("end", lambda a: a.deferring)))


def test_settled_method_without_an_open_group_is_checked():
    a = Leaky(4)
    g = kvguard.guard(a, LEAKY_SPEC)
    x = a.allocate(2)
    a.begin()
    a.free(x)
    a.end()
    assert g.violations == [] and g.live == {}
    with pytest.raises(kvguard.DoubleFreeError) as info:
        a.end()  # no open group: its inner free() is an ordinary, checked call
    assert info.value.block_ids == tuple(x) and sorted(a.free_ids) == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["log", "repair"])
def test_extra_free_in_log_and_repair_modes(mode):
    a = Batched(4)
    g = kvguard.guard(a, SPEC, on_violation=mode)
    x = a.allocate(2)
    a.free_many([x[0], x[0], x[1]])
    assert g.violations[0].kind == "duplicate-id"
    expected = [2, 3, x[0], x[0], x[1]] if mode == "log" else [2, 3, x[0], x[1]]
    assert a.free_ids == expected
    a.release([False])
    assert g.violations[-1].kind == "bool-id"
    assert a.free_ids[-1] is (False if mode == "log" else x[1])


def test_unguard_restores_every_wrapped_method():
    a = Batched(4)
    g = kvguard.guard(a, SPEC)
    assert "free_many" in vars(a) and "reset" in vars(a)
    g.unguard()
    assert not {"allocate", "free", "allocate_pairs", "free_many", "release", "reset",
                "end"} & set(vars(a))
    a.free_many([0])  # plain method again


def test_methods_the_instance_lacks_are_left_alone():
    class Older:
        def __init__(self):
            self.n = 4

        def allocate(self, k):
            return list(range(k))

        def free(self, ids):
            pass
    g = kvguard.guard(Older(), kvguard.AllocatorSpec(adapter=adapter(freeing("free_many"))))
    assert "free_many" not in vars(g.allocator)


def test_a_failing_adapter_leaves_the_allocator_unguarded():
    def broken(guard):
        raise RuntimeError("adapter bug")
    a = Batched(4)
    with pytest.raises(RuntimeError):
        kvguard.guard(a, kvguard.AllocatorSpec(adapter=broken))
    assert kvguard.guard_of(a) is None and "free" not in vars(a)


def test_spec_validates_adapter_and_dotted_id_attr():
    with pytest.raises(TypeError):
        kvguard.AllocatorSpec(adapter="not callable")
    with pytest.raises(TypeError):
        kvguard.AllocatorSpec(id_attr="meta..address")
    assert kvguard.AllocatorSpec(id_attr="meta.address").id_attr == "meta.address"
