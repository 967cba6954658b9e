"""Owners and in-flight leases: who holds a block, and which step still uses it.

A ``stale-free`` is a legal call on a live block (the allocator cannot tell), so these tests
check that the guard tells it apart from a correct free by the holder, on every wrapper (the
compiled ones, the closures, the careful path), in every mode; and that an allocation handing
out a block a step in flight still uses is a ``free-in-flight``."""

from __future__ import annotations

import threading

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvguard
from kvguard import owners
from kvguard.examples import LinkedFreeList
from kvguard.holderbooks import SEVERAL

from .conftest import three_ways, use_wrappers

WAYS = pytest.mark.parametrize("accel,fast", three_ways(),
                               ids=lambda v: "fast" if v is True else "careful" if v is False
                               else "closures" if v is None else "compiled")


class RefPool:
    """A refcounted pool of our own (vLLM-like): ``take`` adds a reference (a prefix hit),
    ``release`` drops one per id and frees a block at zero."""

    def __init__(self, n):
        self.free_list = list(range(n))
        self.refs = [0] * n

    def allocate(self, k):
        out = [self.free_list.pop(0) for _ in range(k)]
        for b in out:
            self.refs[b] = 1
        return out

    def take(self, ids):
        for b in ids:
            if self.refs[b] == 0:
                self.free_list.remove(b)
            self.refs[b] += 1

    def release(self, ids):
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_list.append(b)


REF_SPEC = kvguard.AllocatorSpec(free="release", share="take", refcounted=True)


def reuse_by_another(pool):
    """R allocates and frees 2 blocks; Q is handed them again. Returns Q's blocks."""
    with kvguard.owner("R"):
        r = pool.allocate(2)
        pool.free(r)
    with kvguard.owner("Q"):
        q = pool.allocate(2)
    assert set(q) & set(r), "the pool must hand R's blocks to Q for this test"
    return [b for b in q if b in r]


@WAYS
def test_a_stale_free_after_reuse_is_raised_and_changes_nothing(accel, fast):
    with use_wrappers(accel):
        pool = LinkedFreeList(4)
        g = kvguard.guard(pool, fast_path=fast)
        stale = reuse_by_another(pool)
        before = (list(pool.next), pool.head, pool.free_blocks) if hasattr(pool, "next") else None
        live = dict(g.live)
        with pytest.raises(kvguard.StaleFreeError) as info, kvguard.owner("R"):
            pool.free(stale[:1])
        assert isinstance(info.value, ValueError)
        assert info.value.kind == "stale-free" and info.value.block_ids == (stale[0],)
        assert dict(g.live) == live and g.live[stale[0]].holder == "Q"
        if before is not None:
            assert (list(pool.next), pool.head, pool.free_blocks) == before
        assert "'Q' holds it" in str(info.value)
        with kvguard.owner("Q"):  # the holder's own free is fine
            pool.free(stale)
        assert g.stats.violations == {"stale-free": 1}


@WAYS
@pytest.mark.parametrize("mode", ["log", "repair"])
def test_stale_free_in_log_and_repair_mode(accel, fast, mode, quiet_kvguard_log):
    with use_wrappers(accel):
        pool = LinkedFreeList(4)
        g = kvguard.guard(pool, on_violation=mode, fast_path=fast)
        stale = reuse_by_another(pool)
        with kvguard.owner("R"):
            pool.free(stale[:1])  # never raises in these modes
        assert [v.kind for v in g.violations] == ["stale-free"]
        if mode == "repair":  # the stale id was held back: Q keeps its block
            assert g.live[stale[0]].holder == "Q"
            with kvguard.owner("Z"):
                fresh = pool.allocate(pool.free_blocks)
            assert stale[0] not in fresh
        else:  # forwarded untouched, and the ledger follows what the pool was told
            assert stale[0] not in g.live


@WAYS
def test_no_holder_on_either_side_changes_nothing(accel, fast):
    with use_wrappers(accel):
        pool = LinkedFreeList(4)
        g = kvguard.guard(pool, fast_path=fast)
        ids = pool.allocate(2)           # no holder
        with kvguard.owner("R"):
            pool.free(ids[:1])           # a holder freeing an unheld block: not stale
        with kvguard.owner("R"):
            mine = pool.allocate(1)
        pool.free(mine)                  # no holder freeing R's block: not checked
        assert not g.violations


@WAYS
def test_refcounted_blocks_shared_by_two_holders(accel, fast):
    with use_wrappers(accel):
        pool = RefPool(4)
        g = kvguard.guard(pool, REF_SPEC, fast_path=fast)
        with kvguard.owner("R"):
            r = pool.allocate(2)
        with kvguard.owner("Q"):
            pool.take(r)                 # a prefix hit: Q holds a reference too
        with kvguard.owner("R"):
            pool.release(r)
        with pytest.raises(kvguard.StaleFreeError), kvguard.owner("R"):
            pool.release(r[:1])          # R's reference is gone; Q still holds the block
        with kvguard.owner("Q"):
            pool.release(r)
        assert g.live == {} and pool.refs[r[0]] == 0
        with kvguard.owner("Q"):         # revived from the cache: Q holds it alone
            pool.take(r[:1])
        with pytest.raises(kvguard.StaleFreeError), kvguard.owner("R"):
            pool.release(r[:1])
        assert [v.kind for v in g.violations] == ["stale-free", "stale-free"]


@WAYS
def test_a_leased_block_handed_out_again_is_free_in_flight(accel, fast):
    with use_wrappers(accel):
        pool = LinkedFreeList(4)
        g = kvguard.guard(pool, fast_path=fast)
        with kvguard.owner("R"):
            r = pool.allocate(4)
        g.begin_step(7, r, request="R")
        with kvguard.owner("R"):
            pool.free(r[:2])             # a deferred free while step 7 runs: fine
        assert not g.violations
        with pytest.raises(kvguard.FreeInFlightError) as info, kvguard.owner("Q"):
            pool.allocate(1)
        assert info.value.violation.extra["in_flight_steps"] == ["7"]
        assert g.end_step(7) and not g.end_step(7)
        with kvguard.owner("Q"):
            pool.allocate(1)             # after the step: reuse is fine
        assert g.stats.violations == {"free-in-flight": 1}


@WAYS
def test_a_voided_lease_lets_the_blocks_go(accel, fast):
    with use_wrappers(accel):
        pool = LinkedFreeList(2)
        g = kvguard.guard(pool, fast_path=fast)
        with kvguard.owner("R"):
            r = pool.allocate(2)
        g.begin_step("s", r, request="R")
        with kvguard.owner("R"):
            pool.free(r)
        assert g.void_in_flight("R") == 1   # preempted: its in-flight output is dropped
        with kvguard.owner("Q"):
            pool.allocate(2)
        assert not g.violations and g.open_steps == ["s"]


def test_in_flight_context_manager_and_step_reuse():
    pool = LinkedFreeList(2)
    g = kvguard.guard(pool)
    ids = pool.allocate(2)
    with g.in_flight("prefill", ids):
        pool.free(ids)
        with pytest.raises(kvguard.FreeInFlightError):
            pool.allocate(1)
    assert g.open_steps == []
    assert pool.allocate(1)


class OverlapScheduler:
    """A faithful small model of mini-sglang's overlap loop: a request's table row and pages
    come from two pools; batch N is launched, then the loop processes batch N-1's result while
    N runs. ``abort`` frees the request's row and pages at once; ``process`` of a finished or
    aborted request frees them again unless the fix (``fixed``) skips requests already freed."""

    def __init__(self, pages, fixed):
        self.pages = LinkedFreeList(pages)
        self.fixed = fixed
        self.held = {}       # request -> pages
        self.freed = set()

    def add(self, rid, n):
        with kvguard.owner(rid):
            self.held[rid] = self.pages.allocate(n)

    def launch(self, step, rids):
        guard = kvguard.guard_of(self.pages)
        for rid in rids:
            guard.begin_step(step, self.held[rid], request=rid)

    def abort(self, rid):
        with kvguard.owner(rid):
            self.pages.free(self.held[rid])
        self.freed.add(rid)

    def process(self, step, rids):
        for rid in rids:  # the late result: finished, free its pages
            if self.fixed and rid in self.freed:
                continue
            with kvguard.owner(rid):
                self.pages.free(self.held[rid])
            self.freed.add(rid)
        kvguard.guard_of(self.pages).end_step(step)


@pytest.mark.parametrize("fixed", [False, True])
def test_abort_while_in_flight_on_an_overlap_loop(fixed):
    s = OverlapScheduler(4, fixed)
    g = kvguard.guard(s.pages)
    s.add("R", 2)
    s.launch(1, ["R"])
    s.abort("R")                   # the abort frees R's pages while batch 1 is in flight
    g.void_in_flight("R")          # ... and the loop drops R's part of batch 1
    s.add("Q", 2)                  # Q is handed the same pages
    if fixed:
        s.process(1, ["R"])
        assert not g.violations
    else:
        with pytest.raises(kvguard.StaleFreeError):
            s.process(1, ["R"])    # R's late result frees Q's pages again


def test_an_overlap_loop_that_reuses_without_voiding_is_free_in_flight():
    s = OverlapScheduler(2, fixed=True)
    kvguard.guard(s.pages)
    s.add("R", 2)
    s.launch(1, ["R"])
    s.abort("R")                   # batch 1 still reads R's pages and will write them
    with pytest.raises(kvguard.FreeInFlightError):
        s.add("Q", 2)


def test_threads_started_under_an_owner_inherit_it_while_instrumented():
    seen = {}

    def work(name):
        seen[name] = (kvguard.current_owner(), kvguard.current_holder())

    kvguard.instrument()
    try:
        with kvguard.owner("req-1"):
            t = threading.Thread(target=work, args=("on",))
            t.start()
            t.join()
    finally:
        kvguard.uninstrument()
    with kvguard.owner("req-2"):
        t = threading.Thread(target=work, args=("off",))
        t.start()
        t.join()
    assert seen == {"on": ("req-1", "req-1"), "off": (None, None)}
    assert not getattr(threading.Thread.start, "__kvguard_follow__", False)


def test_labelled_sets_no_holder_and_holding_keeps_the_label():
    with owners.labelled("test-a"):
        assert (kvguard.current_owner(), kvguard.current_holder()) == ("test-a", None)
        with owners.holding("req-9"):
            assert (kvguard.current_owner(), kvguard.current_holder()) == ("test-a", "req-9")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "stale"]), st.integers(0, 2)),
                max_size=40),
       st.sampled_from(three_ways()))
def test_stale_free_is_reported_exactly_when_the_model_says(ops, way):
    """Model: each holder holds a set of blocks; a free by a holder of a block another holder
    holds is stale; anything else is fine. The guard must agree, call by call."""
    accel, fast = way
    with use_wrappers(accel):
        pool = LinkedFreeList(6)
        g = kvguard.guard(pool, fast_path=fast)
        held = {0: [], 1: [], 2: []}
        expected = 0
        for op, who in ops:
            with kvguard.owner(f"h{who}"):
                if op == "alloc" and pool.free_blocks:
                    held[who] += pool.allocate(1)
                elif op == "free" and held[who]:
                    pool.free([held[who].pop()])
                elif op == "stale":
                    others = [b for h, bs in held.items() if h != who for b in bs]
                    if others:
                        expected += 1
                        with pytest.raises(kvguard.StaleFreeError):
                            pool.free([others[0]])
        assert g.stats.violations.get("stale-free", 0) == expected
        assert sorted(g.live) == sorted(b for bs in held.values() for b in bs)
        assert {b: r.holder for b, r in g.live.items()} == {
            b: f"h{h}" for h, bs in held.items() for b in bs}


class RequestPool:
    """An allocator of our own whose calls name the request: ``alloc(req, n)`` / ``free(req,
    ids)`` (a table manager's shape)."""

    def __init__(self, n):
        self.free_list = list(range(n))

    def alloc(self, req, n):
        return [self.free_list.pop(0) for _ in range(n)]

    def release(self, req, ids):
        self.free_list.extend(ids)


@WAYS
@pytest.mark.parametrize("where", [0, "req", lambda args, kwargs: args[0]])
def test_owner_arg_makes_the_call_its_requests(accel, fast, where):
    spec = kvguard.AllocatorSpec(alloc="alloc", free="release", free_arg="ids", owner_arg=where)
    with use_wrappers(accel):
        pool = RequestPool(2)
        g = kvguard.guard(pool, spec, fast_path=fast)
        r = pool.alloc("R", 2)
        pool.release("R", r)
        q = pool.alloc("Q", 2)
        with pytest.raises(kvguard.StaleFreeError):
            pool.release("R", q[:1])
        pool.release("Q", q)
        assert g.stats.violations == {"stale-free": 1} and not g.live
        assert {b: pool.free_list.count(b) for b in range(2)} == {0: 1, 1: 1}


def test_owner_arg_is_checked():
    with pytest.raises(TypeError, match="owner_arg"):
        kvguard.AllocatorSpec(owner_arg=True)
    with pytest.raises(TypeError, match="owner_arg"):
        kvguard.AllocatorSpec(owner_arg=1.5)


def test_reports_and_records_carry_the_holders(quiet_kvguard_log):
    pool = LinkedFreeList(4)
    g = kvguard.guard(pool, on_violation="log")
    stale = reuse_by_another(pool)
    with kvguard.owner("R"):
        pool.free(stale[:1])
    (v,) = g.violations
    d = v.to_dict()
    assert d["holder"] == "R" and d["blocks"][0]["holder"] == "Q"
    assert kvguard.Violation.from_dict(d).blocks[0].holder == "Q"
    assert "owner 'Q'" in v.render()
    jsonschema = pytest.importorskip("jsonschema")
    from kvguard.staging import records
    schema = records.schema(1)
    jsonschema.validate(d, {"$defs": schema["$defs"], "$ref": "#/$defs/violation_report"})


THREE_HOLDERS = [("alloc", 0, 0), ("take", 1, 0), ("take", 1, 0), ("take", 2, 0),
                 ("release", 1, 0), ("stale", 1, 0), ("release", 0, 0), ("release", 1, 0),
                 ("stale", 0, 0), ("release", 2, 0)]
"""One block taken by three holders, one twice, released back to one holder: every step of the
several-holder books, each way checked whatever hypothesis draws."""


@settings(max_examples=150, deadline=None)
@example(THREE_HOLDERS, three_ways()[0])
@example(THREE_HOLDERS, three_ways()[1])
@given(st.lists(st.tuples(st.sampled_from(["alloc", "take", "release", "stale"]),
                          st.integers(0, 2), st.integers(0, 5)), max_size=50),
       st.sampled_from(three_ways()))
def test_refcounted_holders_follow_a_model(ops, way):
    """Model: each holder's references per block (a multiset). A release by a holder of a live
    block it holds no reference to, while another holder does, is stale and changes nothing;
    every other call is fine. The fast paths keep the several-holder blocks in step."""
    accel, fast = way
    with use_wrappers(accel):
        pool = RefPool(6)
        g = kvguard.guard(pool, REF_SPEC, fast_path=fast)
        refs = {0: {}, 1: {}, 2: {}}          # holder -> {block: references}
        expected = 0
        for op, who, pick in ops:
            mine = refs[who]
            live = sorted({b for r in refs.values() for b in r})
            with kvguard.owner(f"h{who}"):
                if op == "alloc" and pool.free_list:
                    (b,) = pool.allocate(1)
                    mine[b] = 1
                elif op == "take" and live:
                    b = live[pick % len(live)]
                    pool.take([b])
                    mine[b] = mine.get(b, 0) + 1
                elif op == "release" and mine:
                    b = sorted(mine)[pick % len(mine)]
                    pool.release([b])
                    mine[b] -= 1
                    if not mine[b]:
                        del mine[b]
                elif op == "stale":
                    others = [b for h, r in refs.items() if h != who for b in r if b not in mine]
                    if others:
                        expected += 1
                        with pytest.raises(kvguard.StaleFreeError):
                            pool.release([others[pick % len(others)]])
        assert g.stats.violations.get("stale-free", 0) == expected
        live = {b for r in refs.values() for b in r}
        assert set(g.live) == live
        assert all(g.live[b].refcount == sum(r.get(b, 0) for r in refs.values()) for b in live)
        assert all(pool.refs[b] == sum(r.get(b, 0) for r in refs.values()) for b in range(6))
        assert references_by_holder(g.ledger(None)) == {
            b: {f"h{h}": r[b] for h, r in refs.items() if b in r} for b in live}


def references_by_holder(ledger) -> dict:
    """Each live block's references per holder label, as the ledger's books say: a block of
    several holders from the sparse map, any other from the holder column and its count."""
    labels = owners.OWNERS.labels
    out = {}
    for b in range(len(ledger.stamp)):
        # the column marks exactly the blocks the map keeps (the fast paths read only it)
        assert (ledger.holder[b] == SEVERAL) == (b in ledger.holders), b
        if ledger.stamp[b] <= 0:
            continue
        counts = ledger.holders.get(b)
        out[b] = ({labels[k]: v for k, v in counts.items()} if counts is not None
                  else {labels[ledger.holder[b]]: ledger.ref[b]})
    return out


@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
def test_a_release_above_the_pool_is_checked_before_the_engine_books_change(mode,
                                                                            quiet_kvguard_log):
    """``Guard.release_by``: an engine that keeps released blocks in its own cache (Hugging
    Face's ``BlockLedger``) asks before its books change; the pool may never see the call."""
    pool = LinkedFreeList(4)
    g = kvguard.guard(pool, on_violation=mode)
    stale = reuse_by_another(pool)
    with kvguard.owner("R"):
        mine = pool.allocate(1)
    assert g.release_by(mine, "R") == []            # R's own: nothing to say
    if mode == "raise":
        with pytest.raises(kvguard.StaleFreeError) as info:
            g.release_by(stale + mine, "R")
        assert info.value.block_ids == tuple(stale)
    else:
        assert g.release_by(stale + mine, "R") == stale
    (v,) = g.violations
    assert v.kind == "stale-free" and "'Q' holds it" in v.message
    assert all(g.live[b].holder == "Q" for b in stale)   # nothing changed in the ledger
