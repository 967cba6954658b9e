"""Adversarial allocators and lifecycles: methods defined in unusual ways, odd return values,
re-guarding, unguarding twice, threads, copies with quarantine, settings and files.

Each case runs the same protocol in every mode: allocate, free, free again (a double free), then
``check()``. The promise: the guard either refuses to attach with a clear ``TypeError`` (and
changes nothing), or it tracks the allocator exactly: raise mode rejects the double free before
the allocator sees it, log mode forwards it, repair mode drops it, and the ledger always ends
agreeing with the allocator's own free count.
"""

import copy
import functools
import gc
import logging
import threading
import weakref

import numpy as np
import pytest

import kvguard
from kvguard import kinds
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.guard import MODES

pytestmark = pytest.mark.usefixtures("quiet_kvguard_log")


class Core:
    """An exact pool: a free set; it refuses a block it did not hand out."""

    def __init__(self, n=8):
        self.n = n
        self.free_ids = set(range(n))

    def take(self, k):
        ids = sorted(self.free_ids)[:k]
        self.free_ids.difference_update(ids)
        return ids

    def give(self, ids):
        ids = [ids] if isinstance(ids, (int, np.integer)) else list(ids)
        ids = [int(b) for b in ids]
        for b in ids:
            if b in self.free_ids:
                raise ValueError(f"block {b} is already free")
        self.free_ids.update(ids)

    def num_free(self):
        return len(self.free_ids)


SPEC = kvguard.AllocatorSpec(size="n", free_count="num_free")


def static_methods():
    class Pool(Core):
        @staticmethod
        def allocate(k):
            return Pool.instance.take(k)

        @staticmethod
        def free(ids):
            return Pool.instance.give(ids)
    Pool.instance = p = Pool()
    return p


def class_methods():
    class Pool(Core):
        @classmethod
        def allocate(cls, k):
            return cls.instance.take(k)

        @classmethod
        def free(cls, ids):
            return cls.instance.give(ids)
    Pool.instance = p = Pool()
    return p


def dunder_getattr():
    class Pool(Core):
        def __getattr__(self, name):
            if name in ("allocate", "free"):
                return self.take if name == "allocate" else self.give
            raise AttributeError(name)
    return Pool()


def partials():
    p = Core()
    p.allocate = functools.partial(Core.take, p)
    p.free = functools.partial(Core.give, p)
    return p


def callable_objects():
    class Give:
        def __init__(self, pool):
            self.pool = pool

        def __call__(self, ids):
            return self.pool.give(ids)
    p = Core()
    p.allocate, p.free = p.take, Give(p)
    return p


def slots_with_dict():
    class Pool:
        __slots__ = ("n", "free_ids", "__dict__")
        __init__, allocate, free, num_free = Core.__init__, Core.take, Core.give, Core.num_free
    return Pool()


def keyword_only():
    class Pool(Core):
        def allocate(self, k):
            return self.take(k)

        def free(self, *, ids):
            return self.give(ids)
    return Pool()


def star_args():
    class Pool(Core):
        def allocate(self, k):
            return self.take(k)

        def free(self, *ids):
            return self.give(ids)
    return Pool()


def returning(kind):
    def make():
        class Pool(Core):
            def allocate(self, k):
                ids = self.take(k)
                return {"int": lambda: ids[0], "tuple": lambda: tuple(ids),
                        "ndarray": lambda: np.array(ids, dtype=np.int32),
                        "set": lambda: set(ids), "np.int64": lambda: np.int64(ids[0]),
                        "generator": lambda: (b for b in ids)}[kind]()

            def free(self, ids):
                return self.give(ids)
        return Pool()
    return make


ODD = {
    "staticmethod": static_methods, "classmethod": class_methods, "__getattr__": dunder_getattr,
    "functools.partial": partials, "callable object": callable_objects,
    "__slots__ with __dict__": slots_with_dict, "keyword-only ids": keyword_only,
    "*ids": star_args,
    **{f"returns {kind}": returning(kind)
       for kind in ("int", "np.int64", "tuple", "ndarray", "set", "generator")},
}


def _free(pool, name, ids):
    if name == "keyword-only ids":
        return pool.free(ids=ids)
    if name == "*ids":
        return pool.free(*ids)
    return pool.free(ids)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_allocators_are_tracked_exactly(name, mode):
    pool = ODD[name]()
    g = kvguard.guard(pool, SPEC, on_violation=mode)
    got = pool.allocate(1)
    ids = [int(got)] if isinstance(got, (int, np.integer)) else [int(b) for b in got]
    assert sorted(g.live) == ids and pool.num_free() == 7
    _free(pool, name, ids)
    assert g.live == {} and pool.num_free() == 8
    if mode == "raise":
        with pytest.raises(kvguard.DoubleFreeError):
            _free(pool, name, ids)
    elif mode == "log":
        with pytest.raises(ValueError, match="already free"):  # forwarded: the pool refuses
            _free(pool, name, ids)
    else:
        _free(pool, name, ids)  # dropped by repair
    assert [v.kind for v in g.violations] == [kinds.DOUBLE_FREE]
    assert pool.num_free() == 8 and g.check() == {None: (0, 0)}
    g.unguard()
    g.unguard()
    assert kvguard.guard_of(pool) is None


def test_slots_without_dict_is_refused_and_unchanged():
    class Pool:
        __slots__ = ("n", "free_ids")
        __init__, allocate, free, num_free = Core.__init__, Core.take, Core.give, Core.num_free
    p = Pool()
    with pytest.raises(TypeError, match="__slots__"):
        kvguard.guard(p, SPEC)
    assert p.allocate(1) == [0] and kvguard.guard_of(p) is None


def test_a_missing_method_is_refused_and_unchanged():
    p = Core()
    with pytest.raises(TypeError, match="no method 'allocate'"):
        kvguard.guard(p, SPEC)
    assert vars(p) == vars(Core())


# --- lifecycles -----------------------------------------------------------------------------

def test_reguarding_after_unguard_learns_the_blocks_out():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(2)
    g.unguard()
    g2 = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    assert g2 is not g
    a.free(ids)
    assert g2.stats.learned == 2 and g2.violations == [] and g.guarded is False


def test_unguard_leaves_a_method_replaced_since_by_someone_else():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)

    def mine(blocks):
        return "mine"
    a.free = mine
    g.unguard()
    assert a.free is mine and "allocate" not in vars(a) and kvguard.guard_of(a) is None


def test_a_guarded_allocator_is_still_collected():
    a = LinkedFreeList(8)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    a.allocate(2)
    copy.copy(a)
    gone = weakref.ref(a)
    del a
    gc.collect()
    assert gone() is None, "the guard and its wrappers keep no allocator alive"
    assert not any(g.allocator is None for g in kvguard.guards())


@pytest.mark.parametrize("mode", MODES)
def test_threads_racing_to_free_the_same_blocks(mode):
    a = LinkedFreeList(64)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation=mode)
    ids = a.allocate(32)
    errors = []

    def worker():
        for b in ids:
            try:
                a.free([b])
            except ValueError as exc:  # raise mode's error, or the allocator's own in log mode
                errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.free_blocks == 64 and g.live == {}
    assert g.stats.violations[kinds.DOUBLE_FREE] == 96, "every second free of each block"
    assert len(errors) == (0 if mode == "repair" else 96)
    assert g.check() == {None: (0, 0)}


def test_an_allocator_calling_itself_passes_through():
    class Splitting(LinkedFreeList):
        def free(self, blocks):
            if len(blocks) > 1:
                for b in blocks:
                    self.free([b])
            else:
                super().free(blocks)
    a = Splitting(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(3)
    a.free(ids)
    assert a.free_blocks == 8 and g.live == {} and g.stats.free_calls == 1


def test_a_copy_taken_during_quarantine_sees_every_freed_block():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    g.set_quarantine(4)
    ids = a.allocate(2)
    a.free(ids)
    assert g.held() == ids and a.free_blocks == 6
    b = copy.deepcopy(a)
    assert b.free_blocks == 8 and a.free_blocks == 8 and g.held() == []
    assert g.check() == {None: (0, 0)}


def test_a_raising_subscriber_is_an_internal_error_not_the_callers():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="repair")

    def broken(guard, violation):
        raise RuntimeError("listener bug")
    unsubscribe = kvguard.subscribe(broken)
    try:
        ids = a.allocate(1)
        a.free(ids + ids)
    finally:
        unsubscribe()
    assert g.stats.internal_errors == 1 and a.free_blocks == 8


@pytest.mark.parametrize("value", [None, "3", b"\x01", {0: 1}, 2.0, [[0]], object(),
                                   10 ** 30, [-1], [2 ** 63]])
def test_junk_ids_in_raise_mode_change_nothing(value):
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    a.allocate(2)
    before = (list(a._blocks), a.free_blocks, sorted(g.live))
    with pytest.raises(kvguard.KVGuardError) as info:
        a.free(value)
    assert isinstance(info.value, ValueError)
    assert (list(a._blocks), a.free_blocks, sorted(g.live)) == before


# --- settings and files ---------------------------------------------------------------------

@pytest.mark.parametrize("text", ["pkg", "pkg.Cls(", "pkg.Cls(free=)", "pkg.Cls(bogus=1)",
                                  "pkg.Cls=nomodule_kvg:SPEC", ",,,", "pkg.Cls(skip=x)"])
def test_garbled_register_settings_are_one_clear_error(text):
    from kvguard.staging import config_from_env
    with pytest.raises(ValueError) as info:
        config_from_env({"KVGUARD": "1", "KVGUARD_REGISTER": text})
    assert str(info.value).startswith("KVGUARD_REGISTER")
    assert "\n" not in str(info.value)


def test_a_log_path_that_cannot_be_written_costs_only_the_lines(tmp_path, caplog):
    from kvguard.staging import JsonLinesSink
    blocker = tmp_path / "file"
    blocker.write_text("")
    sink = JsonLinesSink(str(blocker / "sub" / "k-{pid}.jsonl"), every=1)
    unsubscribe = kvguard.subscribe(sink)
    try:
        a = LinkedFreeList(8)
        g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
        ids = a.allocate(1)
        logging.getLogger("kvguard").disabled = False
        with caplog.at_level(logging.ERROR, logger="kvguard"):
            for _ in range(3):
                a.free(ids + ids)  # duplicate-id, forwarded: LinkedFreeList takes both
                ids = a.allocate(1)
    finally:
        unsubscribe()
    assert sink.failed and caplog.text.count("cannot write violation reports") == 1
    assert g.stats.violations[kinds.DUPLICATE_ID] == 3 and g.stats.internal_errors == 0
