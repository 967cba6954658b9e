"""The guard's view of an allocator is the allocator's own, whatever the attribute named like a
guarded method is (issue 27): a property returning a bound method (a data descriptor, which an
instance attribute cannot shadow), a custom descriptor, something rebound later. Each is guarded
in every mode, on the compiled wrappers, the closures and the careful path (the guard's
``descriptors`` module); an unguarded instance of the class keeps working as before."""

from __future__ import annotations

import pytest

import kvguard
from kvguard import kinds

from .conftest import three_ways, use_wrappers

WAYS = three_ways()
WAY_IDS = ["compiled" if a else "closures" if f else "careful" for a, f in WAYS]
MODES = ["raise", "log", "repair"]


class Base:
    def __init__(self, n=4):
        self.n = n
        self.free_list = list(range(n))
        self.calls: list = []

    def allocate(self, k):
        taken, self.free_list = self.free_list[:k], self.free_list[k:]
        return taken

    def _free_v1(self, ids):
        self.calls.append("v1")
        self.free_list.extend(ids)

    def _free_v2(self, ids):
        self.calls.append("v2")
        self.free_list.extend(ids)


class PropertyPool(Base):
    """``free`` is a property: its getter returns the implementation chosen now, its setter
    switches it (an engine that picks a kernel at run time)."""

    def __init__(self, n=4):
        super().__init__(n)
        self._impl = self._free_v1

    @property
    def free(self):
        return self._impl

    @free.setter
    def free(self, impl):
        self._impl = impl


class Dispatching:
    """A custom (non-data) descriptor: the method the instance's ``variant`` names now."""

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        return getattr(obj, f"_free_{obj.variant}")


class DescriptorPool(Base):
    free = Dispatching()

    def __init__(self, n=4):
        super().__init__(n)
        self.variant = "v1"


SPEC = kvguard.AllocatorSpec(size="n", free_count=lambda p: len(p.free_list))
CLASSES = [PropertyPool, DescriptorPool]


def guarded(cls, mode, way):
    with use_wrappers(way[0]):
        pool = cls()
        return pool, kvguard.guard(pool, SPEC, on_violation=mode, fast_path=way[1])


def caught(pool, g, mode, ids, kind):
    """``pool.free(ids)`` is a ``kind`` violation, raised or recorded per mode."""
    if mode == "raise":
        with pytest.raises(kvguard.KVGuardError) as info:
            pool.free(ids)
        assert info.value.kind == kind
    else:
        pool.free(ids)
        assert g.violations[-1].kind == kind


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_method_held_as_a_descriptor_is_guarded(cls, way, mode, quiet_kvguard_log):
    pool, g = guarded(cls, mode, way)
    a = pool.allocate(2)
    pool.free(a)
    assert g.stats.free_calls == 1 and pool.calls == ["v1"] and not g.live
    caught(pool, g, mode, a[:1], kinds.DOUBLE_FREE)
    b = pool.allocate(2)
    caught(pool, g, mode, [b[0], b[0]], kinds.DUPLICATE_ID)
    caught(pool, g, mode, [7], kinds.INVALID_ID)


@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_rebound_later_the_guard_forwards_to_what_the_allocator_would_call(cls, way):
    pool, g = guarded(cls, "raise", way)
    a = pool.allocate(2)
    if cls is PropertyPool:
        pool.free = pool._free_v2                 # through the property's setter
    else:
        pool.variant = "v2"
    pool.free(a)
    assert pool.calls == ["v2"] and g.stats.free_calls == 1
    with pytest.raises(kvguard.DoubleFreeError):
        pool.free(a)
    assert pool.calls == ["v2"]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_unguarded_instances_and_unguard_are_as_before(cls):
    pool, g = guarded(cls, "raise", (None, True))
    other = cls()
    ids = other.allocate(1)
    other.free(ids + ids)                         # unguarded: the engine's own code
    assert other.free_list.count(ids[0]) == 2 and other.calls == ["v1"]
    g.unguard()
    a = pool.allocate(1)
    pool.free(a + a)
    assert pool.free_list.count(a[0]) == 2


def test_a_wrapper_deleted_from_under_a_custom_descriptor_is_put_back():
    pool, g = guarded(DescriptorPool, "raise", (None, True))
    a = pool.allocate(1)
    pool.free = print                             # the instance's own attribute shadows
    del pool.free
    pool.free(a)                                  # the next call is the guard's again
    assert g.stats.free_calls == 1 and any("re-installed" in n for n in g.notes)
    with pytest.raises(kvguard.DoubleFreeError):
        pool.free(a)


@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
def test_a_method_rebound_on_the_class_later_is_followed(way):
    """An engine that swaps a guarded method's implementation on the class after the guard
    came: the guard forwards to the new one from the next call it sees (a careful-path call,
    check(), live...), and says so once."""
    class Swapping(Base):
        def free(self, ids):
            self._free_v1(ids)

    pool, g = guarded(Swapping, "raise", way)
    a = pool.allocate(2)
    Swapping.free = Base._free_v2
    assert g.live and any("rebound on the class" in n for n in g.notes)
    pool.free(a)
    assert pool.calls == ["v2"] and g.stats.free_calls == 1
    with pytest.raises(kvguard.DoubleFreeError):
        pool.free(a)
    g.unguard()
    assert vars(Swapping)["free"] is Base._free_v2
