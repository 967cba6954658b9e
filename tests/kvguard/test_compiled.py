"""The optional compiled wrappers (``kvguard._fastpath``) and the fallback to the closures.

``pip install -e .`` builds the extension when a C compiler is there; without one, and with
``KVGUARD_PURE=1``, the guard uses the Python closures of ``kvguard.guard.shadowing``. The
differential tests in ``test_fastpath`` hold both to the careful path's verdicts; here: that the
extension really is built and in use, that everything works without it, and what a C wrapper
must get right beyond verdicts (threads, reentrancy, the allocator raising, odd ids, reference
counts, memory, sites, copying and pickling).
"""

import copy
import gc
import logging
import operator
import os
import pickle
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tracemalloc

import numpy as np
import pytest

import kvguard
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC,
    REFCOUNTED_POOL_SPEC,
    LinkedFreeList,
    RefcountedPool,
)
from kvguard.guard import shadowing
from kvguard.stacks import SITES

from .conftest import compiled_wrappers, three_ways, use_wrappers
from .helpers import ledger_state, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def test_the_extension_is_built_and_in_use_where_a_compiler_is():
    """`pip install -e .` on a machine with a C compiler builds kvguard._fastpath, and a guard
    made without KVGUARD_PURE uses it (CI installs that way, so CI runs the compiled path)."""
    if _compiler() is None:
        pytest.skip("no C compiler here: kvguard runs on the closures (see the pure tests)")
    built = compiled_wrappers()
    if built is None:
        pytest.skip("kvguard._fastpath is not built in this checkout (an install without the "
                    "build step, e.g. PYTHONPATH on a source tree): `pip install -e .` builds it")
    if os.environ.get("KVGUARD_PURE", "") not in ("", "0"):
        pytest.skip("KVGUARD_PURE is set: the closures are asked for")
    assert shadowing.ACCEL is built
    a = LinkedFreeList(4)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    assert type(vars(a)["free"]) is built.Wrapper
    assert type(vars(a)["allocate"]) is built.Wrapper


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, **env}
    environ["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=120, check=False)


FALLBACK_SCRIPT = """
    import sys
    {hide}
    import kvguard
    from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
    from kvguard.guard import shadowing

    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(2)
    a.free(ids)
    try:
        a.free(ids[:1])
    except kvguard.DoubleFreeError as exc:
        caught = exc.kind
    print(shadowing.ACCEL is not None, type(vars(a)["free"]).__name__, caught, g.stats.free_calls,
          g.live == {{}}, "kvguard._fastpath" in sys.modules and
          sys.modules["kvguard._fastpath"] is not None,
          "C" if "Counters" in [c.__name__ for c in type(g.stats).__mro__] else "plain")
"""


PURE_RUN = ["False", "function", "double-free", "1", "True", "False", "plain"]
"""FALLBACK_SCRIPT's output on the closures: no extension loaded, plain int counters."""


def test_without_the_extension_everything_works_on_the_closures():
    """An install without a compiler has no kvguard._fastpath: the import fails, silently, and
    the guard runs on the closures with the same verdicts."""
    hide = "sys.modules['kvguard._fastpath'] = None  # as if never built"
    done = _run_python(FALLBACK_SCRIPT.format(hide=hide))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.split() == PURE_RUN


def test_kvguard_pure_picks_the_closures():
    done = _run_python(FALLBACK_SCRIPT.format(hide="pass"), KVGUARD_PURE="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == PURE_RUN


def test_kvguard_pure_0_keeps_the_compiled_wrappers():
    if compiled_wrappers() is None:
        pytest.skip("kvguard._fastpath is not built")
    done = _run_python(FALLBACK_SCRIPT.format(hide="pass"), KVGUARD_PURE="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "True", "Wrapper", "double-free", "1", "True", "True", "C"]


STATS_SCRIPT = """
import copy, pickle
import kvguard

s = kvguard.Stats()
s.free_calls += 3
s.blocks_freed = 1
s.learned = 2 ** 63 - 1
s.violations["double-free"] += 2
twin, deep, back = copy.copy(s), copy.deepcopy(s), pickle.loads(pickle.dumps(s))
s.alloc_calls += 1
deep.violations["leak"] += 1
print(repr(s))
print(twin.to_dict(), deep.to_dict(), back.to_dict(), type(back.blocks_freed).__name__,
      type(back) is kvguard.Stats, back.violations == s.violations)
"""


@pytest.mark.parametrize("pure", ["0", "1"])
def test_stats_read_write_copy_and_pickle_the_same_with_c_counters_or_without(pure):
    """With the extension, ``Stats``'s counters are C integers (``Counters``); without it,
    plain ``__slots__``: every use kvguard and its users make of them reads the same."""
    if pure == "0" and compiled_wrappers() is None:
        pytest.skip("kvguard._fastpath is not built")
    done = _run_python(STATS_SCRIPT, KVGUARD_PURE=pure)
    assert done.returncode == 0, done.stderr
    counts = ("'share_calls': 0, 'blocks_allocated': 0, 'blocks_freed': 1, 'blocks_shared': 0, "
              "'learned': 9223372036854775807, 'internal_errors': 0")
    assert done.stdout.splitlines() == [
        f"Stats({{'alloc_calls': 1, 'free_calls': 3, {counts}, "
        "'violations': {'double-free': 2}})",
        f"{{'alloc_calls': 0, 'free_calls': 3, {counts}, 'violations': {{'double-free': 2}}}} "
        f"{{'alloc_calls': 0, 'free_calls': 3, {counts}, "
        "'violations': {'double-free': 2, 'leak': 1}} "
        f"{{'alloc_calls': 0, 'free_calls': 3, {counts}, 'violations': {{'double-free': 2}}}} "
        "int True True"]


def test_a_c_counter_refuses_what_it_cannot_hold_and_keeps_its_value():
    """A C counter holds what a long long holds (2**63 - 1 is centuries of calls): a bigger
    value, a non-integer or a delete raises and leaves the counter as it was."""
    built = compiled_wrappers()
    if built is None:
        pytest.skip("kvguard._fastpath is not built: Stats has plain int counters")
    s = built.Counters()
    s.learned = 7
    for bad, error in [(2 ** 63, OverflowError), (-2 ** 63 - 1, OverflowError), ("1", TypeError),
                       (1.0, TypeError), (None, TypeError)]:
        with pytest.raises(error):
            s.learned = bad
        assert s.learned == 7
    with pytest.raises(TypeError, match="cannot be deleted"):
        del s.learned
    assert s.learned == 7
    s.learned = -2 ** 63
    assert s.learned == -2 ** 63 and s.free_calls == 0


def test_a_guards_counters_follow_its_wrappers(implementation):
    """A guard on the compiled wrappers counts in ``Stats`` (C counters with the extension),
    one on the Python wrappers in ``PlainStats`` (plain ints, which Python's attribute caches
    make cheapest to bump from the closures); both count the same."""
    from kvguard.guard import telemetry
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="off")
    a.free(a.allocate(3))
    built = compiled_wrappers()
    expected = telemetry.Stats if implementation == "compiled" else telemetry.PlainStats
    assert type(g.stats) is expected
    in_c = built is not None and isinstance(g.stats, built.Counters)  # False: not built
    assert in_c == (implementation == "compiled" and telemetry.Stats is not telemetry.PlainStats)
    assert (g.stats.alloc_calls, g.stats.free_calls, g.stats.blocks_freed) == (1, 1, 3)


def test_a_c_counter_at_its_limit_fails_the_call_as_the_closures_would():
    """A guarded call that would take a C counter past its limit raises OverflowError after
    the allocator's call (as ``stats.free_calls += 1`` would in Python code) and the counter
    keeps its value: the compiled wrapper's in-place add falls back to setattr."""
    built = compiled_wrappers()
    if built is None or not isinstance(kvguard.Stats(), built.Counters):
        pytest.skip("Stats has plain int counters here: they have no limit")
    with use_wrappers(built):
        a = LinkedFreeList(4)
        g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="off")
    assert type(vars(a)["free"]) is built.Wrapper
    ids = a.allocate(3)
    g.stats.free_calls = 2 ** 63 - 1
    with pytest.raises(OverflowError):
        a.free(ids[:1])
    assert g.stats.free_calls == 2 ** 63 - 1 and g.stats.blocks_freed == 0
    g.stats.blocks_freed = 2 ** 63 - 2
    g.stats.free_calls = 0
    with pytest.raises(OverflowError):
        a.free(ids[1:])  # two blocks: one more than the counter has room for
    assert (g.stats.free_calls, g.stats.blocks_freed) == (1, 2 ** 63 - 2)


# --- what a wrapper must get right beyond verdicts (both implementations) ------------------


class SelfCalling(LinkedFreeList):
    """An allocator whose methods call each other through the instance (so through the
    guard's wrappers): ``allocate`` frees a scratch block, ``free`` takes ids one by one."""

    def allocate(self, n):
        scratch = super().allocate(1)
        self.free(scratch)  # the wrapper passes this straight through: the lock is ours
        return super().allocate(n)

    def free(self, ids):
        ids = list(ids)
        if len(ids) > 1:
            for b in ids:
                self.free([b])
            return
        super().free(ids)


def test_an_allocator_calling_itself_is_counted_once(implementation):
    a = SelfCalling(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(3)
    a.free(ids)
    assert (g.stats.alloc_calls, g.stats.free_calls, g.stats.blocks_freed) == (1, 1, 3)
    assert g.live == {} and a.free_blocks == 8
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(ids[:1])


class Raising(LinkedFreeList):
    def __init__(self, n):
        super().__init__(n)
        self.fail = False

    def allocate(self, n):
        if self.fail:
            raise MemoryError("out of blocks")
        return super().allocate(n)

    def free(self, ids):
        if self.fail:
            raise ValueError("allocator refuses")
        super().free(ids)


def test_an_allocator_raising_leaves_the_ledger_unchanged(implementation):
    a = Raising(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(3)
    before = snapshot(a, g), g.stats.to_dict(), list(g.history)
    a.fail = True
    with pytest.raises(ValueError, match="allocator refuses"):
        a.free(ids)
    with pytest.raises(MemoryError):
        a.allocate(2)
    assert (snapshot(a, g), g.stats.to_dict(), list(g.history)) == before
    assert not g.inside()  # the lock was released on the way out
    a.fail = False
    a.free(ids)
    assert g.live == {}


BAD_IDS = [True, 1.0, 2 ** 70, -(2 ** 70), -1, "1", None, [0, 0], [0, True], [2 ** 64],
           np.array([0.0]), np.array([True]), np.uint64(2 ** 63), [np.uint64(2 ** 64 - 1)],
           (x for x in [0])]


@pytest.mark.parametrize("bad", BAD_IDS,
                         ids=[f"{n}-{type(b).__name__}" for n, b in enumerate(BAD_IDS)])
def test_bad_ids_get_the_careful_paths_verdict(bad):
    """Each odd id goes the careful way on both implementations: the same error (or the same
    acceptance) and the same ledger as the careful path."""
    seen = []
    for accel, fast in three_ways():
        a = LinkedFreeList(4)
        with use_wrappers(accel):
            g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="off", fast_path=fast)
        a.allocate(2)
        value = copy.copy(bad) if not hasattr(bad, "__next__") else (x for x in [0])
        try:
            a.free(value)
            outcome = "ok"
        except kvguard.KVGuardError as exc:
            outcome = exc.kind
        seen.append((outcome, snapshot(a, g), g.stats.to_dict()))
    assert all(s == seen[-1] for s in seen)


def test_reference_counts_of_ids_and_results_do_not_drift(implementation):
    """Ids passed in, on the fast path and on the careful one, are neither leaked nor
    over-released: once the guard (its flight recorder, its violations) is gone, every id
    object and argument list has the count it had before."""
    a = RefcountedPool(64)
    g = kvguard.guard(a, REFCOUNTED_POOL_SPEC, on_violation="repair", max_violations=10)
    probe = 12345678901  # private int objects whose counts we watch
    big = 98765432101
    ids = a.allocate(4)
    arg = list(ids)
    gc.collect()
    before = [sys.getrefcount(x) for x in (probe, big, arg)]
    logging.getLogger("kvguard").disabled = True
    try:
        for _ in range(500):
            a.share(arg)
            a.free(arg)
            a.free([probe, big])  # noqa: KVG104 (foreign: the careful path, repaired away)
            a.share((ids[0],))
            a.free((ids[0], ids[0]))  # noqa: KVG104 (a duplicate: careful, one dropped)
    finally:
        logging.getLogger("kvguard").disabled = False
    for _ in range(500):
        a.share(arg)
        a.free(np.array(arg))
    g.unguard()
    del g
    gc.collect()
    assert [sys.getrefcount(x) for x in (probe, big, arg)] == before


def test_no_memory_grows_over_100k_calls(implementation):
    a = LinkedFreeList(64)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC, history=4)
    for _ in range(2000):  # warm caches: sites, types
        a.free(a.allocate(2))
        a.free(np.array(a.allocate(1)))
    tracemalloc.start()
    try:
        first = tracemalloc.get_traced_memory()[0]
        for _ in range(25_000):
            a.free(a.allocate(2))
            a.free(np.array(a.allocate(1)))
        gc.collect()
        last = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert last - first < 64 * 1024, (first, last)


def _sites_of(accel, stacks):
    a = LinkedFreeList(8)
    with use_wrappers(accel):
        g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks=stacks)
    ids = a.allocate(2)  # one line for both implementations: the same caller frames
    a.free(ids[:1])
    return g, [g.ledger().origin[b] for b in ids], g.ledger().freed_at[ids[0]]


@pytest.mark.parametrize("stacks", ["cheap", "full"])
def test_the_same_call_gets_the_same_interned_site_on_both(stacks):
    built = compiled_wrappers()
    if built is None:
        pytest.skip("kvguard._fastpath is not built")
    runs = [_sites_of(accel, stacks) for accel in (built, None)]  # one line: same frames
    (g_c, origin_c, freed_c), (_, origin_p, freed_p) = runs
    assert len(set(origin_c)) == 1 and 0 not in origin_c and freed_c != 0
    # The interned keys may differ in one offset: a caller's frame records the CALL instruction
    # while a C function runs and the CALL's last inline-cache entry while a Python one does.
    # Both resolve to the same line, so every report is the same.
    assert SITES.pairs(origin_c[0]) == SITES.pairs(origin_p[0])
    assert SITES.pairs(freed_c) == SITES.pairs(freed_p)
    frames = next(iter(g_c.live.values())).allocated_at
    assert frames[0].function == "_sites_of"
    assert len(frames) == (3 if stacks == "cheap" else len(SITES.pairs(origin_p[0])))


def test_a_site_capture_failure_is_contained_like_the_closures(implementation, monkeypatch):
    """A fault inside the capture (here: interning a new site) raises in raise mode and is
    counted, the call completed, in log mode."""
    def broken(*args):
        raise RuntimeError("injected")
    monkeypatch.setattr(SITES, "_intern", broken)
    a = LinkedFreeList(4)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="full")
    with pytest.raises(RuntimeError, match="injected"):
        a.allocate(1)
    assert not vars(a)["__kvguard__"].inside()
    b = LinkedFreeList(4)
    g = kvguard.guard(b, LINKED_FREE_LIST_SPEC, stacks="full", on_violation="log")
    ids = b.allocate(2)
    b.free(ids)
    assert g.stats.internal_errors >= 2 and g.live == {} and b.free_blocks == 4


def test_wrappers_look_like_the_closures_to_the_rest_of_kvguard(implementation):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    wrapper = vars(a)["free"]
    assert wrapper.__kvguard__ is g and wrapper.__wrapped__.__func__ is vars(
        LinkedFreeList)["free"].__kvguard_function__
    assert copy.copy(wrapper) is wrapper and copy.deepcopy(wrapper) is wrapper
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        pickle.dumps(wrapper)
    ids = a.allocate(2)
    clone = copy.deepcopy(a)  # the guard's reduce hook: an unguarded copy
    assert "free" not in vars(clone) and kvguard.guard_of(clone) is None
    clone.free(ids)  # frees on the copy only
    assert set(g.live) == set(ids)
    g.unguard()
    assert "free" not in vars(a)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_a_drained_iterator_is_forwarded_by_position_or_keyword(by_keyword):
    """``iterator_ok`` specs (vLLM's ``free_blocks(reversed(blocks))``): the iterator is read
    once and the allocator gets the list, whichever way the ids were passed; the same on both
    implementations and the careful path."""
    from .test_fastpath import SHAPES, TolerantPool

    spec = SHAPES["id_attr_hinted"][1]
    seen = []
    for accel, fast in three_ways():
        a = TolerantPool(objects=True)
        with use_wrappers(accel):
            g = kvguard.guard(a, spec, stacks="off", fast_path=fast)
        blocks = a.allocate(3)
        a.share(blocks[:1])
        if by_keyword:
            a.free(ids=reversed(blocks), pool=0)
        else:
            a.free(reversed(blocks), 0)
        seen.append((a.state(), ledger_state(g), g.stats.to_dict(),
                     [(entry[0], entry[1], entry[4]) for entry in g.history]))
    assert all(s == seen[-1] for s in seen)
    assert seen[-1][0][0][0][blocks[0].block_id] == 1  # one reference left: the share's


# --- found in review: a crash, a lost exception context, a wrapper weakref refused ----------


class _Block:
    def __init__(self, block_id):
        self.block_id = block_id


class _ObjectPool:
    """Block objects by ``block_id`` (vLLM's shape), every free skipped item-by-item."""

    num_blocks = 8

    def __init__(self):
        self.free_ids = list(range(8))

    def allocate(self, n):
        return [_Block(self.free_ids.pop(0)) for _ in range(n)]

    def free(self, blocks):
        for b in blocks:
            self.free_ids.append(b.block_id)


SKIP_DROPS_THE_ITEM = """
    import functools, operator, sys
    import kvguard
    from kvguard import AllocatorSpec
    from kvguard.guard import shadowing
    from tests.kvguard.test_compiled import _Block, _ObjectPool

    if sys.argv[1] == "pure":
        shadowing.ACCEL = None
    seen = []
    held = []

    class Item(_Block):
        def __eq__(self, other):
            seen.append(vars(self).get("block_id"))
            return False
        __hash__ = object.__hash__

    class Sentinel:
        def __eq__(self, other):
            if held:
                held.pop().clear()  # the list's only reference to the item goes
            return NotImplemented   # ... and the reflected item.__eq__ runs on it

    spec = AllocatorSpec(id_attr="block_id", skip=functools.partial(operator.eq, Sentinel()),
                         size="num_blocks")
    a = _ObjectPool()
    kvguard.guard(a, spec, on_violation="log")
    block = a.allocate(1)[0]
    arg = [Item(block.block_id)]
    held.append(arg)
    del block
    a.free(arg)
    print(type(vars(a)["free"]).__name__, seen)
"""


@pytest.mark.parametrize("which", ["compiled", "pure"])
def test_a_skip_that_drops_the_item_it_is_asked_about_does_not_crash(which):
    """``skip`` is the engine's code; the wrapper holds its own reference to each item it asks
    about, as the closure's ``map`` does (the C wrapper once passed a borrowed item: a
    segfault when ``skip`` ran code that emptied the list)."""
    if which == "compiled" and compiled_wrappers() is None:
        pytest.skip("kvguard._fastpath is not built")
    script = textwrap.dedent(SKIP_DROPS_THE_ITEM)
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    environ.pop("KVGUARD_PURE", None)  # the child picks its wrappers itself (argv[1])
    done = subprocess.run([sys.executable, "-c", script, which], env=environ, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    wrapper = "Wrapper" if which == "compiled" else "function"
    assert done.stdout.split(None, 1) == [wrapper, "[0]\n"]  # the item was alive when asked


class _UnlocksAndRaises(LinkedFreeList):
    def free(self, ids):
        vars(self)["__kvguard__"].lock.release()  # the guard's unlock() will then fail
        raise ValueError("allocator error")


def test_an_exception_on_the_way_out_keeps_the_allocators_as_its_context(implementation):
    """As Python's ``finally``: when unlocking fails while the allocator's exception is in
    flight, that exception is the new one's ``__context__``, not lost."""
    a = _UnlocksAndRaises(4)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ids = a.allocate(1)
    with pytest.raises(RuntimeError) as raised:
        a.free(ids)
    assert isinstance(raised.value.__context__, ValueError)
    assert str(raised.value.__context__) == "allocator error"


def test_a_guarded_method_can_be_weakly_referenced(implementation):
    """Callback registries hold methods weakly: a guard must not make that fail."""
    import weakref

    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    ref = weakref.ref(vars(a)["free"])
    assert ref() is vars(a)["free"]
    ids = a.allocate(1)
    ref()(ids)
    assert g.live == {} and g.stats.free_calls == 1


def test_an_interpreter_running_without_the_gil_gets_the_closures():
    """The C wrappers rely on the GIL; on a free-threaded build running without it (modelled
    here: ``sys._is_gil_enabled`` is what 3.13t answers with) kvguard never imports them."""
    hide = "sys._is_gil_enabled = lambda: False  # as 3.13t without the GIL says"
    done = _run_python(FALLBACK_SCRIPT.format(hide=hide))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == PURE_RUN


def test_a_wrapper_names_the_module_its_closure_would(implementation):
    a = LinkedFreeList(4)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    assert vars(a)["free"].__module__ == "kvguard.guard.shadowing"
    assert vars(a)["allocate"].__name__ == "allocate"


# --- found in the second review: keeps_all that is not what it seems; a thread's own free ---


def _keeps_tuple():
    def skip(block):
        return False
    skip.keeps_all = ("is_null", False)  # the pairs put on keeps_all itself, by mistake
    return skip


def _keeps_empty_tuple():
    def skip(block):
        return getattr(block, "block_id", None) == 1  # block 1 is another pool's
    skip.keeps_all = ()
    return skip


def _keeps_bad_identities():
    def skip(block):
        return False

    def keeps_all(allocator, blocks):
        return True
    keeps_all.identities = (("is_null",), (1, False))  # not (name, object) pairs
    skip.keeps_all = keeps_all
    return skip


@pytest.mark.parametrize("make_skip", [_keeps_tuple, _keeps_empty_tuple, _keeps_bad_identities])
def test_a_keeps_all_c_cannot_read_as_identities_is_called_as_the_closure_calls_it(make_skip):
    """Only a well-formed ``keeps_all.identities`` is checked in C; anything else is called,
    so the compiled wrapper neither crashes on it (a tuple on keeps_all itself once did) nor
    takes a call the closure sends to the careful path."""
    seen = []
    for accel in ([compiled_wrappers()] if compiled_wrappers() else []) + [None]:
        shadowing_accel, shadowing.ACCEL = shadowing.ACCEL, accel
        try:
            spec = kvguard.AllocatorSpec(id_attr="block_id", skip=make_skip(),
                                         size="num_blocks")
            a = _ObjectPool()
            g = kvguard.guard(a, spec, on_violation="log")
            blocks = a.allocate(2)
            a.free(blocks)
        finally:
            shadowing.ACCEL = shadowing_accel
        seen.append((g.stats.to_dict(), sorted(g.live), [v.kind for v in g.violations]))
    assert all(s == seen[-1] for s in seen), seen


NO_FRAME_FREES = """
    import _thread, sys, threading, time
    import kvguard
    from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
    from kvguard.guard import shadowing

    if sys.argv[1] == "pure":
        shadowing.ACCEL = None
    a = LinkedFreeList(64)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation=sys.argv[2], sample=2)
    ids = [a.allocate(1)[0] for _ in range(20)]
    threading.excepthook = lambda *args: None
    sys.stderr = open("/dev/null", "w")
    for b in ids:
        _thread.start_new_thread(a.free, (b,))  # the wrapper is the thread's own function
        time.sleep(0.02)
    deadline = time.monotonic() + 120  # every thread done (a loaded machine, a sanitizer)
    while _thread._count() and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = g.stats.to_dict()
    print(stats["free_calls"], stats["internal_errors"], g._capture.__kvguard_sample__[0]())
"""


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_a_free_with_no_python_frame_under_it_samples_as_the_closure_does(mode):
    """``sample=N`` on a free that is a thread's own function (no Python caller): one draw
    per call and the same contained capture failure on both implementations."""
    if compiled_wrappers() is None:
        pytest.skip("kvguard._fastpath is not built")
    outs = []
    for which in ("compiled", "pure"):
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(NO_FRAME_FREES), which,
                               mode], env=environ, cwd=ROOT, capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(done.stdout.split())
    assert outs[0] == outs[1]


# --- block attributes read from their slots ------------------------------------------------


def _slotted_pool():
    """_ObjectPool handing out blocks of a fresh slotted class (the compiled reader reads a
    slot straight from the object while the class is as it was when it looked the slot up)."""

    class SlotBlock:
        __slots__ = ("block_id", "ref_cnt")

        def __init__(self, block_id):
            self.block_id, self.ref_cnt = block_id, 1

    class Pool(_ObjectPool):
        def allocate(self, n):
            return [SlotBlock(self.free_ids.pop(0)) for _ in range(n)]

    pool = Pool()
    kvguard.guard(pool, kvguard.AllocatorSpec(id_attr="block_id", refcounted=True,
                                              refcount_attr="ref_cnt", size="num_blocks"),
                  on_violation="log")
    return pool, SlotBlock


def test_a_block_class_changed_after_its_slots_were_read_is_read_as_it_is_now(implementation):
    pool, cls = _slotted_pool()
    g = kvguard.guard_of(pool)
    blocks = pool.allocate(4)
    pool.free(blocks[:1])  # block 0 freed, its slots read (and remembered where they are)
    pool.free(blocks[1:2])
    assert not g.violations
    slot = vars(cls)["block_id"]
    cls.block_id = property(lambda self: 0)  # from now on every block says it is block 0
    pool.free(blocks[2:3])
    assert [(v.kind, v.block_ids) for v in g.violations] == [("double-free", (0,))]
    cls.block_id = slot  # the slot again: block 3 is block 3
    pool.free(blocks[3:4])
    assert len(g.violations) == 1 and g.stats.free_calls == 4
    assert sorted(g.live) == [2], "block 2 was never freed: its free said block 0"


def test_a_block_whose_slot_is_unset_or_class_swapped_gets_the_careful_paths_verdict(
        implementation):
    pool, cls = _slotted_pool()
    g = kvguard.guard_of(pool)
    blocks = pool.allocate(3)
    pool.free(blocks[:1])  # the slots read and remembered
    del blocks[1].ref_cnt  # the engine's count unset: the ledger decides
    pool.free(blocks[1:2])
    assert not g.violations and g.stats.internal_errors == 0
    assert sorted(g.live) == [2]

    class Swapped(cls):  # the same layout, and a block_id that is not the slot
        __slots__ = ()
        block_id = property(lambda self: 0)
    blocks[2].__class__ = Swapped
    pool.free(blocks[2:3])
    assert [(v.kind, v.block_ids) for v in g.violations] == [("double-free", (0,))]
    assert g.stats.free_calls == 3 and g.stats.internal_errors == 0


# --- long calls: repeated ids found in a table (up to 512 ids) or by sorting (more) ---------


class _Handout:
    """Hands out exactly the ids it is asked for (so a test picks ids that collide in a hash
    table, or are spread over a large pool); takes anything back."""

    num_blocks = 1 << 20

    def allocate(self, ids):
        return list(ids)

    def free(self, ids):
        pass


@pytest.mark.parametrize("n", [25, 40, 257, 512, 513, 700])
@pytest.mark.parametrize("spread", [1, 1024, 4099])
@pytest.mark.parametrize("repeat", [None, (0, -1), (-2, -1), (5, 6)])
def test_a_long_calls_repeated_id_is_found_on_both(implementation, n, spread, repeat):
    pool = _Handout()
    g = kvguard.guard(pool, kvguard.AllocatorSpec(size="num_blocks"))
    ids = [i * spread % pool.num_blocks for i in range(n)]
    assert len(set(ids)) == n
    pool.allocate(ids)
    freed = list(ids)
    if repeat is not None:
        freed[repeat[1]] = freed[repeat[0]]
        with pytest.raises(kvguard.KVGuardError) as err:
            pool.free(freed)
        assert err.value.kind == "duplicate-id"
        assert len(g.live) == n and g.stats.free_calls == 0, "a rejected call changes nothing"
        freed = ids
    pool.free(freed)
    assert not g.live and g.stats.free_calls == 1 and g.stats.blocks_freed == n


def test_a_block_table_passed_as_ids_is_refused_without_being_converted(implementation):
    """A 2-D integer array (a block table passed by mistake) gets ``invalid-id`` on both, and
    neither reader turns it into nested lists first (the compiled one reads ``ndim`` from the
    array before it calls ``tolist()``): 40,000 ids would cost megabytes."""
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="off")
    a.free(np.array(a.allocate(2), dtype=np.int64))  # the fast path has read an array
    table = np.arange(40_000, dtype=np.int64).reshape(200, 200)
    tracemalloc.start()
    try:
        with pytest.raises(kvguard.KVGuardError):
            a.free(table)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [v.kind for v in g.violations] == ["invalid-id"]
    assert peak < 400_000, f"{peak} bytes traced: the table was converted"


class FakeArray:
    """Stands in for an array type ``fastread`` has learned as numpy's but whose fields the
    compiled reader cannot read in place (a Python class): it asks ``ndim``, ``dtype.kind``
    and ``tolist()`` by name, as ``fastread.plain_ids`` does."""

    def __init__(self, ids, ndim=1, kind="i"):
        self.ids, self._ndim, self.dtype = ids, ndim, type("dtype", (), {"kind": kind})()

    @property
    def ndim(self):
        if isinstance(self._ndim, Exception):
            raise self._ndim
        return self._ndim

    def tolist(self):
        return list(self.ids)

    def __iter__(self):
        return iter(self.ids)

    def __len__(self):
        return len(self.ids)


FAKE_ARRAYS = [dict(), dict(ndim=2), dict(ndim=0), dict(ndim=1.0), dict(ndim="1"),
               dict(ndim=2 ** 70), dict(ndim=LookupError("no ndim")), dict(kind="u"),
               dict(kind="f"), dict(kind=""), dict(kind="iu"), dict(kind=5)]


@pytest.mark.parametrize("fake", FAKE_ARRAYS, ids=[str(f) for f in FAKE_ARRAYS])
def test_an_array_read_by_name_gets_the_python_readers_verdict(fake):
    """The compiled reader's by-name path (``ndim``, then ``dtype.kind``, then ``tolist()``)
    against the closures' ``plain_ids`` on each odd answer: the same outcome, counters and
    ledger."""
    from kvguard import fastread
    seen = []
    built = compiled_wrappers()
    fastread.KINDS[FakeArray] = fastread.ARRAY
    try:
        for accel in ([built] if built else []) + [None]:
            with use_wrappers(accel):
                a = LinkedFreeList(8)
                g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="off")
            ids = a.allocate(3)
            try:
                a.free(FakeArray(ids[:2], **fake))
                outcome = "ok"
            except kvguard.KVGuardError as exc:
                outcome = exc.kind
            seen.append((outcome, snapshot(a, g), g.stats.to_dict()))
    finally:
        del fastread.KINDS[FakeArray]
    assert all(s == seen[-1] for s in seen)


@pytest.mark.parametrize("pure", [False, True])
def test_stats_pickle_under_every_protocol(pure):
    """Protocols 0 and 1 cannot reduce an object with C counters by themselves; ``Stats``
    reduces itself by name, on either storage."""
    import pickle

    from kvguard.guard.telemetry import PlainStats, Stats
    if not pure and compiled_wrappers() is None:
        pytest.skip("kvguard._fastpath is not built: Stats has plain int counters")
    stats = (PlainStats if pure else Stats)()
    stats.free_calls, stats.learned = 3, 2 ** 62
    stats.violations["double-free"] += 2
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(stats, protocol))
        assert type(back) is type(stats) and back.to_dict() == stats.to_dict(), protocol


class _ScalarPool:
    """Hands out one id per call as a numpy integer scalar made by ``make`` (as pools built on
    numpy arrays hand out their elements) and takes one back, reading it with
    ``operator.index``. Ids 3, 3 + 1024 and 3 + 2048 fall in one slot of the compiled
    reader's small cache of ints."""

    num_blocks = 2100

    def __init__(self, make) -> None:
        self.make = make
        self.free_list = [3 + 2048, 3 + 1024, 3, 7]

    def allocate(self):
        return self.make(self.free_list.pop())

    def free(self, block) -> None:
        self.free_list.append(operator.index(block))


class _IndexOverride(np.int64):
    """A heap subclass whose ``__index__`` is not its stored value: read by name, never in
    place (``operator.index`` is what the careful path reads)."""

    def __index__(self):
        return int(np.int64(self)) + 1


class _IntOverride(np.int64):
    """One whose ``int()`` is not its value: ``int()`` is not what the careful path reads."""

    def __int__(self):
        return int(np.int64(self)) + 1


def _three_ways(make_pool):
    """A fresh pool from ``make_pool`` and its guard (log mode, stacks off) on the compiled
    wrappers (where built), on the Python closures, and on the careful path, in turn."""
    for accel, fast in three_ways():
        pool = make_pool()
        with use_wrappers(accel):
            g = kvguard.guard(pool, kvguard.AllocatorSpec(size="num_blocks"), stacks="off",
                              on_violation="log", fast_path=fast)
        yield pool, g


SCALAR_MAKERS = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                 np.uint64, np.longlong, np.ulonglong, np.intc, np.intp, _IndexOverride,
                 _IntOverride]


@pytest.mark.parametrize("make", SCALAR_MAKERS, ids=lambda m: m.__name__)
def test_numpy_integer_scalars_of_every_type_read_as_the_careful_path_reads_them(make):
    """The compiled reader reads a numpy scalar's value in place (its layout checked once per
    type) and hands out ints from a small cache: on every integer type, on ids sharing a cache
    slot, on a double free, a negative and a too-large id, the compiled wrappers, the closures
    and the careful path give the same verdicts, ledgers and flight recorder, and the ids they
    record are plain ints."""
    fits = make(0).dtype.itemsize > 1  # 1027 and 2051 do not fit in a byte
    signed = make(0).dtype.kind == "i"
    seen = []
    for pool, g in _three_ways(lambda: _ScalarPool(make)):
        got = [pool.allocate() for _ in range(4 if fits else 2)]
        for b in got[::-1] + got[-1:]:  # ids sharing a slot while the others are live; the
            pool.free(b)                 # last one is a double free
        pool.free(make(-1) if signed else np.uint64(2 ** 64 - 2))  # negative, too large
        seen.append(([(v.kind, v.block_ids) for v in g.violations], ledger_state(g),
                     [(op[1], [type(b) for b in op[1]]) for op in g.history]))
    assert all(s == seen[-1] for s in seen)
    kinds = [k for k, _ in seen[0][0]]
    # -1 reads as 0 through _IndexOverride's __index__: a block never handed out
    assert kinds == ["double-free", "foreign-id" if make is _IndexOverride else "invalid-id"]
    assert all(t is int for _, types in seen[0][2] for t in types)


@pytest.mark.parametrize("make", SCALAR_MAKERS, ids=lambda m: m.__name__)
def test_lists_of_numpy_scalars_read_as_the_careful_path_reads_them(make):
    """Lists mixing ints and numpy scalars (ids taken out of an array one by one), read in C:
    ids in one cache slot, a repeat as a scalar and as an int, a negative scalar, and a list
    changing type half-way give the same verdicts and ledgers on all three paths."""
    fits = make(0).dtype.itemsize > 1
    ids = [3, 1027, 2051, 9] if fits else [3, 9, 100, 101]
    signed = make(0).dtype.kind == "i"
    calls = [[make(b) for b in ids[:2]], [ids[2], make(ids[3])], [make(ids[0]), ids[0]],
             [make(ids[1]), True], (make(ids[1]), make(-1) if signed else 2 ** 64)]
    seen = []
    for pool, g in _three_ways(_Handout):
        pool.allocate(ids)
        for call in calls:
            pool.free(call)
        seen.append(([(v.kind, v.block_ids) for v in g.violations], ledger_state(g),
                     [(op[1], [type(b) for b in op[1]]) for op in g.history]))
    assert all(s == seen[-1] for s in seen)
    assert all(t is int for _, types in seen[0][2] for t in types)
    repeat = set() if make is _IndexOverride else {"duplicate-id"}  # its 3 reads as 4
    assert repeat | {"bool-id"} <= {kind for kind, _ in seen[0][0]}


def test_throwaway_scalar_subclasses_do_not_crowd_numpy_types_out():
    """The compiled reader remembers how each numpy scalar type keeps its value in a small
    table: heap types (subclasses, never read in place) must not take its room, or after 16
    throw-away subclasses np.int64 would be read the slow way for the life of the process. Read
    in place, an id's int comes from the reader's cache: the same object twice. (A fresh
    process: the table is the module's, and other tests fill it.)"""
    if compiled_wrappers() is None:
        pytest.skip("kvguard._fastpath is not built: nothing compiled to test")
    script = textwrap.dedent("""
        import numpy as np, kvguard
        class Pool:
            num_blocks = 4096
            def allocate(self, ids): return list(ids)
            def free(self, ids): pass
        pool = Pool()
        g = kvguard.guard(pool, kvguard.AllocatorSpec(size="num_blocks"), stacks="off",
                          on_violation="log")
        pool.allocate(list(range(2000)))
        for n in range(20):
            sub = type(f"Sub{n}", (np.int64,), {})
            for _ in range(2):  # learned by fastread, then met by the compiled reader
                pool.free([sub(n), sub(n)])  # a repeat, logged
        pool.free(list(range(2000)))
        for _ in range(3):  # the first is read in Python (fastread learns the type), then C
            pool.allocate([1000])
            pool.free(np.int64(1000))
        first, second = [op[1][0] for op in list(g.history)[-3::2]]
        assert first == second == 1000 and type(first) is int
        print("same" if first is second else "different")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "KVGUARD_PURE": "0"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "same"
