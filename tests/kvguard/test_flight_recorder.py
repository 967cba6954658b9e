"""The compiled flight recorder (``kvguard._fastpath.FlightRecorder``) against the deque it
stands in for.

With the compiled wrappers a guard's ``history`` is a ring of the entries' fields (no tuple
per guarded call); it must read as ``collections.deque(maxlen=...)`` does for everything kvguard
and its users do with ``guard.history``, keep and drop references exactly, and stay whole when
code it runs (a finalizer of an entry it drops, the garbage collector during a read) uses it.
"""

import collections
import copy
import gc
import pickle
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.guard import shadowing

from .conftest import compiled_wrappers

FASTPATH = compiled_wrappers()
pytestmark = pytest.mark.skipif(FASTPATH is None, reason="kvguard._fastpath is not built: a "
                                "guard's history is a deque (the pure tests cover it)")


def entry(n):
    return (n, [n, n + 1], n % 3, None if n % 2 else ("pool", n), "free")


OPS = st.lists(st.one_of(st.tuples(st.just("append"), st.integers(0, 10 ** 6)),
                         st.tuples(st.just("clear")),
                         st.tuples(st.just("index"), st.integers(-50, 50)),
                         st.tuples(st.just("assign"), st.integers(-50, 50),
                                   st.integers(0, 10 ** 6))), max_size=120)


@settings(max_examples=150, deadline=None)
@given(maxlen=st.integers(1, 40), ops=OPS)
def test_it_reads_as_a_deque_with_that_maxlen_reads(maxlen, ops):
    """Appends past maxlen (and past the first allocation of 8 slots), clears, indexing and
    assigning (in range or not, negative too): every read gives what the deque gives."""
    ring, model = FASTPATH.FlightRecorder(maxlen), collections.deque(maxlen=maxlen)
    for op in ops:
        if op[0] == "append":
            ring.append(entry(op[1]))
            model.append(entry(op[1]))
        elif op[0] == "clear":
            ring.clear()
            model.clear()
        elif op[0] == "assign":  # as evidence.fold_empty rewrites the newest entry
            try:
                model[op[1]] = entry(op[2])
            except IndexError:
                with pytest.raises(IndexError):
                    ring[op[1]] = entry(op[2])
            else:
                ring[op[1]] = entry(op[2])
        else:
            try:
                expected = model[op[1]]
            except IndexError:
                with pytest.raises(IndexError):
                    ring[op[1]]  # noqa: B018 (the read is the test)
            else:
                assert ring[op[1]] == expected
        assert len(ring) == len(model) and bool(ring) == bool(model)
        assert list(ring) == list(model)
    assert list(reversed(ring)) == list(reversed(model)) and ring.maxlen == maxlen
    assert all((e in ring) for e in model)
    assert repr(ring) == f"FlightRecorder({list(model)!r}, maxlen={maxlen})"


def test_a_guard_records_into_it_with_the_compiled_wrappers_and_into_a_deque_without(
        monkeypatch):
    seen = []
    for accel in (FASTPATH, None):
        monkeypatch.setattr(shadowing, "ACCEL", accel)
        a = LinkedFreeList(8)
        g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, history=4, stacks="off")
        for n in (1, 2, 3):
            a.free(a.allocate(n))
        seen.append((type(g.history).__name__, list(g.history), g.history.maxlen))
    assert seen[0][0] == "FlightRecorder" and seen[1][0] == "deque"
    assert seen[0][1:] == seen[1][1:] and len(seen[0][1]) == 4


@pytest.mark.parametrize("bad", [[1, 2, 3, 4, 5], (1, 2, 3, 4), (1, 2, 3, 4, 5, 6), None, "abcde"])
def test_an_entry_that_is_not_a_five_tuple_is_refused_and_changes_nothing(bad):
    ring = FASTPATH.FlightRecorder(2)
    ring.append(entry(1))
    with pytest.raises(TypeError, match="flight-recorder entry"):
        ring.append(bad)
    assert list(ring) == [entry(1)]


def test_an_entry_is_replaced_only_by_a_five_tuple_and_never_deleted():
    ring = FASTPATH.FlightRecorder(2)
    ring.append(entry(1))
    with pytest.raises(TypeError, match="flight-recorder entry"):
        ring[0] = (1, 2)
    with pytest.raises(TypeError, match="cannot be deleted"):
        del ring[0]
    assert list(ring) == [entry(1)]


def test_empty_calls_fold_in_c_into_a_deque_history_as_into_the_recorder(monkeypatch):
    """The compiled wrappers fold calls with no ids into the newest entry of a guard's history
    in place when it is their FlightRecorder, and through the sequence protocol when it is any
    other (a deque): the same entries either way, and the same as the closures'."""
    seen = []
    for accel, deque_history in ((FASTPATH, False), (FASTPATH, True), (None, True)):
        monkeypatch.setattr(shadowing, "ACCEL", accel)
        if deque_history:
            monkeypatch.setattr(shadowing, "new_history",
                                lambda n: collections.deque(maxlen=n))
        a = LinkedFreeList(8)
        g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, history=3, stacks="off")
        for n in (0, 2, 0, 0, 1, 0):
            a.free(a.allocate(n))
        a.free([])
        seen.append((type(g.history).__name__, list(g.history)))
    assert [name for name, _ in seen] == ["FlightRecorder", "deque", "deque"]
    assert seen[0][1] == seen[1][1] == seen[2][1] == [
        (10, [1], 0, None, "allocate"), (11, [1], 0, None, "free"),
        (14, 3, None, None, "empty")]  # calls #12..#14


@pytest.mark.parametrize("maxlen, error", [(0, ValueError), (-1, ValueError), ("3", TypeError),
                                           (2.0, TypeError), (2 ** 70, OverflowError)])
def test_a_bad_maxlen_is_refused(maxlen, error):
    with pytest.raises(error):
        FASTPATH.FlightRecorder(maxlen)


def test_maxlen_is_read_only_and_the_recorder_unhashable_as_a_deque():
    ring = FASTPATH.FlightRecorder(3)
    with pytest.raises(AttributeError):
        ring.maxlen = 4
    with pytest.raises(TypeError):
        hash(ring)
    assert FASTPATH.FlightRecorder(maxlen=2).maxlen == 2


def test_copies_and_pickles_hold_the_same_entries():
    ring = FASTPATH.FlightRecorder(3)
    for n in range(5):
        ring.append(entry(n))
    for twin in (copy.copy(ring), copy.deepcopy(ring), pickle.loads(pickle.dumps(ring))):
        assert type(twin) is type(ring) and twin is not ring
        assert list(twin) == list(ring) and twin.maxlen == 3
    deep = copy.deepcopy(ring)
    assert deep[0][1] is not ring[0][1]


class Marker:
    pass


def test_every_reference_it_holds_is_dropped_when_an_entry_leaves():
    """Evicted by a newer entry, cleared, or with the recorder itself: each field is released
    (a leak would keep the ids lists of the guard's whole life)."""
    ring = FASTPATH.FlightRecorder(2)
    held = [Marker() for _ in range(4)]
    refs = [weakref.ref(m) for m in held]
    for n, m in enumerate(held):
        ring.append((n, [m], m, None, "free"))
    del held, m
    assert [r() is None for r in refs] == [True, True, False, False]  # two evicted
    ring.clear()
    assert all(r() is None for r in refs)
    last = Marker()
    ring.append((1, [], None, last, "free"))
    gone = weakref.ref(last)
    del last, ring
    assert gone() is None


def test_a_cycle_through_it_is_collected():
    ring = FASTPATH.FlightRecorder(2)
    ring.append((1, [ring], None, None, "free"))
    gone = weakref.ref(ring)
    del ring
    gc.collect()
    assert gone() is None


class Appender:
    """An entry field whose finalizer appends to (or clears) the recorder dropping it."""

    ran = 0
    rearm = 0
    """While positive, each finalizer leaves a new cycle behind for the next collection."""

    def __init__(self, ring, clear=False):
        self.ring, self.clear = ring, clear

    def __del__(self):
        Appender.ran += 1
        if Appender.rearm > 0:
            Appender.rearm -= 1
            junk = [Appender(self.ring, self.clear)]
            junk.append(junk)
        if self.clear:
            self.ring.clear()
        else:
            self.ring.append((-1, [], None, None, "reset"))


@pytest.mark.parametrize("clear", [False, True])
def test_a_finalizer_run_by_an_evicted_entry_finds_the_recorder_whole(clear):
    ring = FASTPATH.FlightRecorder(3)
    ring.append((0, [], Appender(ring, clear), None, "free"))
    ring.append(entry(1))
    ring.append(entry(2))
    ring.append(entry(3))  # evicts entry 0: its finalizer appends (evicting 1) or clears
    model = [] if clear else [entry(2), entry(3), (-1, [], None, None, "reset")]
    assert list(ring) == model and len(ring) == len(model)
    ring.append(entry(4))
    assert list(ring)[-1] == entry(4)


@pytest.mark.parametrize("clear", [False, True])
def test_reads_survive_the_garbage_collector_running_code_that_changes_it_meanwhile(clear):
    """Every tuple a read makes may start a collection, whose finalizers may append to the
    recorder or clear it: a read returns whole entries only (the ring is read afresh after each
    allocation), and a recorder cleared under a read gives the entries read before."""
    ring = FASTPATH.FlightRecorder(5)
    threshold, ran = gc.get_threshold(), Appender.ran
    gc.set_threshold(2)
    Appender.rearm = 10 ** 9  # a finalizer to run at every collection, reads included
    try:
        for i in range(30):
            for n in range(5 - len(ring)):
                ring.append(entry(n))
            junk = [Appender(ring, clear)]
            junk.append(junk)  # a cycle: only the collector frees it, at some allocation
            del junk
            # 5-tuples held, so the read's come from the collector's allocator, not the free
            # list (only a collector-tracked allocation can start a collection on 3.11)
            hold = [tuple(range(5)) for _ in range(2100 + i % 3)]  # collections shifted
            got = list(ring)
            del hold
            assert len(got) <= 5 and all(type(e) is tuple and len(e) == 5 for e in got)
            assert clear or len(got) == 5
            try:
                last = ring[-1]
            except IndexError:
                assert clear
            else:
                assert last in (entry(4), (-1, [], None, None, "reset")) or clear
        assert Appender.ran > ran + 30  # the collector did run their finalizers meanwhile
    finally:
        Appender.rearm = 0
        gc.set_threshold(*threshold)
        gc.collect()


def test_a_read_is_one_state_of_the_recorder_when_the_collector_appends_during_it():
    """Reading the recorder allocates a tuple per entry; before Python 3.12 an allocation can
    run the collector, and code it runs (a finalizer calling the guarded allocator) can append
    to a full ring or clear it. The read is then the recorder as it was or as it is, never a
    mix of both (it skipped an entry the ring still held and kept the one it dropped), and
    never an IndexError in the middle of a violation report."""
    for change in ("append", "clear"):
        ring = FASTPATH.FlightRecorder(4)
        for n in range(4):
            ring.append(entry(n))
        before = [e[0] for e in ring]
        state = {"armed": False, "calls": 0}

        def during_collection(phase, info, ring=ring, change=change, state=state):
            if phase == "start" and state["armed"]:
                state["calls"] += 1
                if state["calls"] == 2:  # while the second entry's tuple is being allocated
                    ring.append(entry(99)) if change == "append" else ring.clear()
        gc.callbacks.append(during_collection)
        threshold = gc.get_threshold()
        gc.set_threshold(1, 1000, 1000)
        try:
            drained = [tuple([i, 0, 0, 0, 0]) for i in range(5000)]  # no free 5-tuples left
            state["armed"] = True
            got = [e[0] for e in ring]
        finally:
            state["armed"] = False
            gc.set_threshold(*threshold)
            gc.callbacks.remove(during_collection)
        del drained
        assert got in (before, [e[0] for e in ring]), (change, got)
