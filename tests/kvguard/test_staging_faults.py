"""Never hurt the serving path: faults injected into the guard's own internals, bounded memory,
and attaching to a live allocator (seeded or learned) without false alarms.

The fault tests run the same operations on a guarded allocator and on an unguarded twin: in log
mode, whatever breaks inside the guard, every call must return what the twin returned (or raise
the allocator's own error the twin raised) and leave the allocator in the twin's state.
"""

import importlib
import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvguard
from kvguard import Violation
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)
from kvguard.ledger import Ledger
from kvguard.stacks import SITES, UNKNOWN, SiteTable

from .helpers import allocator_state

guard_module = importlib.import_module("kvguard.guard")
HOMES = {"normalize": "kvguard.guard.careful", "result_ids": "kvguard.guard.bookkeeping",
         "raw_stack": "kvguard.guard.evidence", "int_tensor_ids": "kvguard.guard.readers",
         "torch_tensor_type": "kvguard.guard.readers", "violation": "kvguard.guard.evidence"}
"""The module whose global each injected fault replaces."""


def _home(name):
    return importlib.import_module(HOMES[name])


class Flaky:
    """Replaces a function of the guard: raises on every ``every``-th call (1: always)."""

    def __init__(self, original, every=1):
        self.original, self.every, self.calls = original, every, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls % self.every == 0:
            raise RuntimeError("injected fault inside kvguard")
        return self.original(*args, **kwargs)


def _inject(monkeypatch, where, every):
    """Patch one internal of the guard so that it fails on every ``every``-th call."""
    if where == "site capture":
        monkeypatch.setattr(SITES, "_intern", Flaky(SITES._intern, every))
    elif where in ("normalize", "result_ids", "raw_stack"):
        monkeypatch.setattr(_home(where), where, Flaky(getattr(_home(where), where), every))
    elif where in ("Ledger.release", "Ledger.adopt", "Ledger.allocate"):
        name = where.split(".")[1]
        flaky = Flaky(getattr(Ledger, name), every)
        monkeypatch.setattr(Ledger, name, lambda self, *a, **k: flaky(self, *a, **k))
    elif where in ("Violation.render", "Violation.to_dict"):
        name = where.split(".")[1]
        flaky = Flaky(getattr(Violation, name), every)
        monkeypatch.setattr(Violation, name, lambda self, *a, **k: flaky(self, *a, **k))
    elif where == "evidence.violation":
        monkeypatch.setattr(_home("violation"), "violation",
                            Flaky(_home("violation").violation, every))
    elif where == "subscriber":
        unsubscribe = kvguard.subscribe(Flaky(lambda g, v: v.to_dict(), every))
        monkeypatch.setattr(guard_module, "_kvg_test_unsubscribe", unsubscribe, raising=False)
    else:
        raise AssertionError(where)


FAULTS = ["site capture", "normalize", "result_ids", "raw_stack", "Ledger.release",
          "Ledger.adopt", "Ledger.allocate", "Violation.render", "Violation.to_dict",
          "evidence.violation", "subscriber"]

# Operations: ("alloc", n) or ("free", how, which) with which picking held blocks by index.
FREES = ["list", "tuple", "int", "dup", "foreign", "stale"]
OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 3)),
    st.tuples(st.just("free"), st.sampled_from(FREES), st.integers(0, 10)),
), max_size=25)


def outcome(call):
    try:
        return ("ok", call())
    except Exception as exc:  # the allocator's own errors are part of the behaviour compared
        return ("error", type(exc).__name__, str(exc))


def run_twins(ops, guarded, raw):
    """Apply ``ops`` to both allocators, comparing every outcome."""
    held_g, held_r, freed = [], [], []
    for op in ops:
        if op[0] == "alloc":
            got_g = outcome(lambda: guarded.allocate(op[1]))
            got_r = outcome(lambda: raw.allocate(op[1]))
            assert got_g == got_r
            if got_g[0] == "ok":
                held_g += list(got_g[1])
                held_r += list(got_r[1])
            continue
        _, how, which = op
        if how == "foreign":
            ids = [guarded._num_blocks - 1 - which % 2]
        elif how == "stale":
            ids = [freed[which % len(freed)]] if freed else [0]
        elif not held_g:
            continue
        else:
            b = held_g[which % len(held_g)]
            ids = {"list": [b], "tuple": (b,), "int": b, "dup": [b, b]}[how]
        got_g = outcome(lambda: guarded.free(list(ids) if isinstance(ids, list) else ids))
        got_r = outcome(lambda: raw.free(list(ids) if isinstance(ids, list) else ids))
        assert got_g == got_r, (op, ids)
        if got_g[0] == "ok":
            for b in ([ids] if isinstance(ids, int) else list(dict.fromkeys(ids))):
                if b in held_g:
                    held_g.remove(b)
                    held_r.remove(b)
                freed.append(b)
        assert allocator_state(guarded) == allocator_state(raw)
    assert allocator_state(guarded) == allocator_state(raw)


@pytest.mark.parametrize("where", FAULTS)
@pytest.mark.parametrize("stacks", ["off", "cheap"])
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(ops=OPS, every=st.sampled_from([1, 2, 3]))
def test_log_mode_never_lets_an_internal_fault_reach_the_caller(monkeypatch, where, stacks, ops,
                                                                every):
    guarded, raw = LinkedFreeList(6), LinkedFreeList(6)
    g = kvguard.guard(guarded, LINKED_FREE_LIST_SPEC, on_violation="log", stacks=stacks)
    with monkeypatch.context() as m:
        _inject(m, where, every)
        logging.getLogger("kvguard").disabled = True
        try:
            run_twins(ops, guarded, raw)
        finally:
            logging.getLogger("kvguard").disabled = False
            unsubscribe = getattr(guard_module, "_kvg_test_unsubscribe", None)
            if unsubscribe is not None:
                unsubscribe()
    assert g.stats.alloc_calls + g.stats.free_calls <= len(ops)


@pytest.mark.parametrize("where", ["site capture", "normalize", "Ledger.release",
                                   "evidence.violation", "Violation.render"])
def test_an_internal_fault_is_logged_once_and_counted(monkeypatch, caplog, where):
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    _inject(monkeypatch, where, 1)
    with caplog.at_level(logging.ERROR, logger="kvguard"):
        for _ in range(3):
            ids = a.allocate(2)
            with pytest.raises(ValueError, match="already free"):
                a.free([7])  # foreign-id: the slow path and a violation to build and log
            a.free(set(ids))  # a set: the slow path, no violation
            a.free(a.allocate(1) + a.allocate(1))  # the fast path
    assert g.stats.internal_errors >= 1
    assert caplog.text.count("internal error in the guard of") == 1
    assert sorted(a.allocate(8)) == list(range(8))


@pytest.mark.parametrize("where", ["site capture", "normalize", "Ledger.release"])
def test_repair_mode_survives_internal_faults_and_keeps_the_pool_sound(monkeypatch, where):
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="repair")
    _inject(monkeypatch, where, 2)
    logging.getLogger("kvguard").disabled = True
    try:
        for _ in range(5):
            ids = a.allocate(3)
            a.free(set(ids[:2]))  # the slow path (a set), where repair would sanitize
            a.free(ids[2:])
    finally:
        logging.getLogger("kvguard").disabled = False
    rest = a.allocate(a.free_blocks)
    assert sorted(rest) == list(range(8)), "every block came back exactly once"
    assert g.stats.internal_errors >= 1


def test_raise_mode_shows_the_guards_own_fault():
    a = LinkedFreeList(4)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    original = SITES._intern
    SITES._intern = Flaky(original)
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            a.allocate(1)  # a never-seen call site: interning it fails
    finally:
        del SITES._intern


def test_a_failing_watcher_is_contained_in_log_mode():
    class Broken:
        def on_free(self, guard, pool, ids):
            raise RuntimeError("watcher bug")

        def on_alloc(self, guard, pool, ids):
            raise RuntimeError("watcher bug")

    guarded, raw = LinkedFreeList(6), LinkedFreeList(6)
    g = kvguard.guard(guarded, LINKED_FREE_LIST_SPEC, on_violation="log")
    g.add_watcher(Broken())
    logging.getLogger("kvguard").disabled = True
    try:
        run_twins([("alloc", 2), ("free", "list", 0), ("alloc", 3), ("free", "dup", 1),
                   ("free", "tuple", 0)], guarded, raw)
    finally:
        logging.getLogger("kvguard").disabled = False
    assert g.stats.internal_errors >= 2


class TensorFreeList(LinkedFreeList):
    """Hands ids out as an int32 tensor, as DeepSpeed's BlockedAllocator does."""

    def allocate(self, num_blocks):
        import torch
        return torch.tensor(super().allocate(num_blocks), dtype=torch.int32)


@pytest.mark.parametrize("where", ["int_tensor_ids", "torch_tensor_type"])
def test_a_fault_reading_a_tensor_result_is_contained(monkeypatch, where):
    a = TensorFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    monkeypatch.setattr(_home(where), where, Flaky(getattr(_home(where), where)))
    got = a.allocate(3)  # the fast path cannot read the tensor: the slow path does
    assert got.tolist() == [0, 1, 2] and sorted(g.live) == [0, 1, 2]
    a.free(got.tolist())
    assert g.violations == [] and g.live == {} and a.free_blocks == 8


# --- bounded memory ---------------------------------------------------------------------------

def _distinct_sites(n):
    """``n`` functions with distinct code objects, each capturing its own call site."""
    out = []
    for k in range(n):
        namespace = {}
        exec(f"def site_{k}(table):\n    return table.capture(0, 3)\n", namespace)
        out.append(namespace[f"site_{k}"])
    return out


def test_the_site_table_is_bounded():
    table = SiteTable(capacity=8)
    sites = [f(table) for f in _distinct_sites(40)]
    assert len(table) <= 2 * 8 + 1
    assert UNKNOWN in sites[-5:], "past twice the capacity new sites go unrecorded"
    assert all(s != UNKNOWN for s in sites[:8])
    assert len(table.pairs(sites[10])) == 1, "past capacity a site keeps its innermost frame"


def test_violations_are_a_ring_buffer_and_the_recorder_is_bounded():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log", max_violations=5, history=4)
    logging.getLogger("kvguard").disabled = True
    try:
        for _ in range(20):
            with pytest.raises(ValueError):
                a.free([7])  # foreign-id each time; the allocator refuses it too
            a.free(a.allocate(1))
    finally:
        logging.getLogger("kvguard").disabled = False
    assert len(g.violations) == 5 and g.stats.violations["foreign-id"] == 20
    assert len(g.history) == 4
    assert [op.op for op in g.violations[-1].history] == ["allocate", "free"] * 2


def test_the_same_call_site_logs_once_per_n(caplog):
    a = LinkedFreeList(8)
    kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log", log_every=50)
    with caplog.at_level(logging.WARNING, logger="kvguard"):
        for _ in range(120):
            with pytest.raises(ValueError):
                a.free([3])
    assert caplog.text.count("ERROR: kvguard: foreign-id") == 3  # 1st, 50th, 100th
    assert "(occurrence 100)" in caplog.text


# --- attaching to a live allocator ------------------------------------------------------------

def test_learning_is_automatic_when_blocks_are_out_and_reported():
    a = LinkedFreeList(8)
    early = a.allocate(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)  # raise mode even: no false alarm
    assert g._learn and g.stats.learned == 0
    a.free(early[:3])
    a.free(early[3])
    assert g.violations == [] and g.stats.learned == 4
    assert g.check() == {None: (4, 4)}
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(early[:1])
    fresh = kvguard.guard(LinkedFreeList(8), LINKED_FREE_LIST_SPEC)
    assert not fresh._learn, "nothing out at attach: an unknown id is foreign"
    with pytest.raises(kvguard.ForeignIdError):
        fresh.allocator.free([2])


def test_seeding_from_the_allocator_needs_no_learning():
    spec = LINKED_FREE_LIST_SPEC.replace(
        live_ids=lambda a: [b for b, nxt in enumerate(a._blocks) if nxt == -1])
    a = LinkedFreeList(8)
    early = a.allocate(3)
    g = kvguard.guard(a, spec)
    assert not g._learn and sorted(g.live) == early
    a.free(early[:2])
    with pytest.raises(kvguard.ForeignIdError):
        a.free([5])  # never handed out: the seeded ledger knows it
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(early[:1])
    assert g.stats.learned == 0


def _refcounted_history():
    """A vLLM-style pool with shared blocks out (refcounts 2 and 1) and a cached free one."""
    p = RefcountedPool(6)
    ids = p.allocate(3)
    p.share(ids[:1])  # block ids[0]: 2 references
    p.free(ids[2:])  # block ids[2]: free, cached
    return p, ids


@pytest.mark.parametrize("seeded", [False, True])
def test_a_refcounted_pool_attached_late_raises_no_false_alarm(seeded):
    p, ids = _refcounted_history()
    spec = REFCOUNTED_POOL_SPEC.replace(
        live_ids=lambda pool: [b for b, r in enumerate(pool.ref_cnt) if r > 0]) if seeded \
        else REFCOUNTED_POOL_SPEC
    g = kvguard.guard(p, spec)  # raise mode: any false alarm fails the test
    assert bool(g._learn) is not seeded
    p.share(ids[1:2])  # a third holder of ids[1] before the guard came? now 2 refs
    p.share(ids[2:3])  # a prefix-cache hit revives the cached block
    for b in (ids[0], ids[0], ids[1], ids[1], ids[2]):
        p.free([b])  # below the ledger's guess of 1 reference: learned, not a double free
    got = p.allocate(6)  # the allocator hands them all out: not shared-block
    assert sorted(got) == list(range(6)) and g.violations == []
    with pytest.raises(kvguard.DuplicateIdError):
        p.free([got[0], got[0]])  # real misuse is still caught
    p.free(got[:1])
    with pytest.raises(kvguard.DoubleFreeError):
        p.free(got[:1])  # a block handed out after the guard came has a known count


def _valid_linked_ops(draw_ops, a, held):
    for op, k in draw_ops:
        if op == "alloc" and a.free_blocks >= k:
            held += a.allocate(k)
        elif op == "free" and held:
            b = held.pop(k % len(held))
            a.free([b])


def _valid_pool_ops(draw_ops, p, refs):
    for op, k in draw_ops:
        if op == "alloc" and p.num_free() >= k:
            refs += p.allocate(k)
        elif op == "share" and refs:
            b = refs[k % len(refs)]
            p.share([b])
            refs.append(b)
        elif op == "free" and refs:
            b = refs.pop(k % len(refs))
            p.free([b])


VALID = st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(1, 4)),
                 max_size=30)


@settings(max_examples=60, deadline=None)
@given(before=VALID, after=VALID, seeded=st.booleans())
def test_attaching_at_any_point_of_a_valid_run_raises_no_false_alarm(before, after, seeded):
    a, held = LinkedFreeList(10), []
    _valid_linked_ops(before, a, held)
    spec = LINKED_FREE_LIST_SPEC.replace(
        live_ids=lambda x: [b for b, n in enumerate(x._blocks) if n == -1]) if seeded \
        else LINKED_FREE_LIST_SPEC
    g = kvguard.guard(a, spec)
    _valid_linked_ops(after, a, held)
    assert g.violations == []
    g.check()

    p, refs = RefcountedPool(10), []
    _valid_pool_ops(before, p, refs)
    spec = REFCOUNTED_POOL_SPEC.replace(
        live_ids=lambda x: [b for b, r in enumerate(x.ref_cnt) if r > 0]) if seeded \
        else REFCOUNTED_POOL_SPEC
    g = kvguard.guard(p, spec)
    _valid_pool_ops(after, p, refs)
    _valid_pool_ops([("free", 0)] * len(refs), p, refs)  # everyone lets go
    p.allocate(p.num_free())
    assert g.violations == []
