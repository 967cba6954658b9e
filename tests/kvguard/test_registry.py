"""register()/instrument(): guarding instances from construction, modules imported later too."""

import sys
import textwrap

import pytest

import kvguard
from kvguard import registry
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList


@pytest.fixture
def later_module(tmp_path, monkeypatch):
    """A module on sys.path that nobody has imported yet."""
    name = f"kvg_later_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        class Pool:
            def __init__(self, n):
                self.n = n
                self.free_ids = list(range(n))

            def allocate(self, k):
                out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
                return out

            def free(self, ids):
                self.free_ids.extend(ids)

        class Child(Pool):
            def __init__(self, n):
                super().__init__(n)
                self.child_ready = True
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    registry.unregister(f"{name}.Pool")
    registry.unregister(f"{name}.Child")


def test_register_by_dotted_name_does_not_import(later_module):
    kvguard.register(f"{later_module}.Pool", kvguard.AllocatorSpec(size="n"))
    assert later_module not in sys.modules
    assert f"{later_module}.Pool" in kvguard.registered()


def test_instrument_guards_classes_imported_later(later_module):
    kvguard.register(f"{later_module}.Pool", kvguard.AllocatorSpec(size="n"))
    kvguard.instrument()
    module = __import__(later_module)
    pool = module.Pool(4)
    g = kvguard.guard_of(pool)
    assert g is not None and g.spec.size == "n"
    ids = pool.allocate(2)
    with pytest.raises(kvguard.DuplicateIdError):
        pool.free([ids[0], ids[0]])
    child = module.Child(4)  # a subclass is guarded once, after its own __init__ finished
    assert kvguard.guard_of(child) is not None and child.child_ready
    kvguard.uninstrument()
    assert kvguard.guard_of(module.Pool(2)) is None
    assert kvguard.guard_of(pool) is g, "guards already attached stay"


def test_instrument_patches_classes_already_imported():
    kvguard.register(LinkedFreeList, LINKED_FREE_LIST_SPEC)
    try:
        kvguard.instrument(on_violation="log")
        a = LinkedFreeList(4)
        g = kvguard.guard_of(a)
        assert g.mode == "log" and g.spec is LINKED_FREE_LIST_SPEC
        kvguard.uninstrument()
        assert "__init__" in LinkedFreeList.__dict__
        assert not getattr(LinkedFreeList.__init__, "__kvguard_patch__", False)
        assert kvguard.guard_of(LinkedFreeList(2)) is None
    finally:
        kvguard.unregister(LinkedFreeList)


def test_register_while_instrumented_patches_at_once(later_module):
    module = __import__(later_module)
    kvguard.instrument()
    kvguard.register(module.Pool, kvguard.AllocatorSpec())
    assert kvguard.guard_of(module.Pool(3)) is not None


def test_guard_without_spec_uses_registry_then_defaults(later_module):
    module = __import__(later_module)
    plain = kvguard.guard(module.Pool(3))
    assert plain.spec == kvguard.AllocatorSpec()
    kvguard.register(module.Child, kvguard.AllocatorSpec(size="n"))
    assert kvguard.guard(module.Child(3)).spec.size == "n"


def test_register_rejects_nonsense():
    with pytest.raises(ValueError, match="dotted name"):
        kvguard.register("NoModule", kvguard.AllocatorSpec())
    with pytest.raises(TypeError, match="AllocatorSpec"):
        kvguard.register("a.B", {"free": "free"})
    with pytest.raises(TypeError):
        kvguard.register(42, kvguard.AllocatorSpec())


def test_builtin_specs_are_registered_by_name():
    names = kvguard.registered()
    assert "deepspeed.inference.v2.ragged.blocked_allocator.BlockedAllocator" in names


def test_class_level_calls_are_dispatched_to_the_instance_guard(later_module):
    """While instrumented, ``Pool.free(pool, ids)`` reaches ``pool``'s guard; ``Child``, which
    inherits the methods, dispatches through the same functions; the last guard's unguard()
    restores them."""
    module = __import__(later_module)
    kvguard.register(module.Pool, kvguard.AllocatorSpec(size=lambda p: p.n))
    functions = dict(vars(module.Pool))
    kvguard.instrument()
    pool, child = module.Pool(4), module.Child(4)
    g, gc_ = kvguard.guard_of(pool), kvguard.guard_of(child)
    ids = module.Pool.allocate(pool, 2)
    module.Pool.free(pool, ids)
    with pytest.raises(kvguard.DoubleFreeError):
        module.Pool.free(pool, ids[:1])
    with pytest.raises(kvguard.DuplicateIdError):
        module.Child.free(child, [module.Child.allocate(child, 1)[0]] * 2)
    assert (g.stats.free_calls, gc_.stats.alloc_calls) == (1, 1)
    assert sorted(pool.free_ids) == [0, 1, 2, 3]
    kvguard.uninstrument()
    module.Pool.free(pool, module.Pool.allocate(pool, 1))  # live guards hold them still
    assert g.stats.free_calls == 2
    g.unguard()
    gc_.unguard()
    assert {k: vars(module.Pool)[k] for k in ("allocate", "free")} == {
        k: functions[k] for k in ("allocate", "free")}


class Frozen(type):
    def __setattr__(cls, name, value):
        if name != "__init__":  # the registry's constructor patch is let through
            raise TypeError(f"{cls.__name__} is frozen")
        super().__setattr__(name, value)


class FrozenPool(LinkedFreeList, metaclass=Frozen):
    """A class no dispatcher can be put on: its guarded methods are its own."""

    def allocate(self, n):
        return super().allocate(n)

    def free(self, blocks):
        return super().free(blocks)


def test_a_class_that_refuses_attributes_is_still_guarded_per_instance():
    kvguard.register(FrozenPool, LINKED_FREE_LIST_SPEC)
    try:
        kvguard.instrument()
        pool = FrozenPool(4)
        ids = pool.allocate(2)
        with pytest.raises(kvguard.DuplicateIdError):
            pool.free([ids[0], ids[0]])
        FrozenPool.free(pool, ids)  # no dispatcher could be put on: passes the guard
        assert sorted(kvguard.guard_of(pool).live) == sorted(ids)  # only check() would tell
    finally:
        kvguard.uninstrument()
        kvguard.unregister(FrozenPool)
