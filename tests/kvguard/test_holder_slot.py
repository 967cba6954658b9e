"""The holder a request boundary sets: a per-thread slot (``kvguard.owners``), not the context
variable, so an engine's per-request boundary costs a C integer saved and restored.

Each behaviour is checked on both implementations where they stand alone (the compiled
``Holding`` / ``Boundary`` and their Python twins), and, with the active one, against
``kvguard.owner`` (the context variable) nested either way, threads, and a guard whose fast
paths must read the slot: a stale free inside a boundary is reported on every wrapper."""

from __future__ import annotations

import functools
import threading

import pytest

import kvguard
from kvguard import boundaries, owners
from kvguard.examples import LinkedFreeList

from .conftest import three_ways, use_wrappers

IMPLEMENTATIONS = [pytest.param((owners._PyHolding, owners._py_boundary, owners._py_holder_now),
                                id="python")]
if owners.holding is not owners._PyHolding:
    IMPLEMENTATIONS.insert(0, pytest.param(
        (owners.holding, owners.Boundary, owners.holder_now), id="compiled"))


def label(now) -> object:
    return owners.OWNERS.labels[now()]


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request):
    return request.param


def test_holding_sets_the_holder_for_its_block_and_restores_it(impl):
    holding, _, now = impl
    assert now() == 0
    with holding("req-1"):
        assert label(now) == "req-1"
        with holding("req-2"):
            assert label(now) == "req-2"
        assert label(now) == "req-1"
        with pytest.raises(KeyError):
            with holding("req-3"):
                raise KeyError("the engine's own error")
        assert label(now) == "req-1"
    assert now() == 0


def test_holding_interns_any_label_once(impl):
    holding, _, now = impl
    unhashable = ["req", 7]
    with holding(unhashable):           # interned by its repr, as OWNERS.intern does
        assert label(now) == repr(unhashable)
    with holding(12345):
        first = now()
    with holding(12345):
        assert now() == first
    with holding(None):                 # None: explicitly no holder inside
        assert now() == 0


class Manager:
    """An engine manager of our own: each method acts for one request."""

    def allocate(self, request_id, n):
        return label(self.now), n

    def free(self, request):
        return label(self.now)

    def fail(self, request_id):
        raise RuntimeError(f"failed for {label(self.now)}")


def installed(impl):
    _, boundary, now = impl
    cls = type("Wrapped", (Manager,), {
        "now": staticmethod(now),
        "allocate": boundary(Manager.allocate, 1, 0, "request_id", None),
        "free": boundary(Manager.free, 1, 0, "request", "request_id"),
        "fail": boundary(Manager.fail, 1, 0, "request_id", None),
    })
    return cls()


class Request:
    def __init__(self, request_id):
        self.request_id = request_id


def test_a_boundary_runs_its_method_as_the_request_its_call_names(impl):
    m = installed(impl)
    now = impl[2]
    assert m.allocate("r1", 3) == ("r1", 3)                 # by position, bound
    assert m.allocate(n=2, request_id="r2") == ("r2", 2)    # by keyword
    assert type(m).allocate(m, "r3", 1) == ("r3", 1)        # unbound, the instance first
    bound = m.allocate                                       # a bound method kept
    assert bound("r4", 0) == ("r4", 0)
    assert m.free(Request("r5")) == "r5"                    # the request's attribute
    assert now() == 0


def test_a_boundary_that_cannot_read_its_holder_runs_the_method_as_it_is(impl):
    m = installed(impl)
    with kvguard.owner("outer") if impl[2] is owners.holder_now else _nothing():
        expected = label(impl[2])
        assert m.free(object()) == expected         # no request_id attribute
        assert m.free(Request(None)) == expected    # a holder of None
        assert m.allocate(None, 1) == (expected, 1)


def test_a_boundary_restores_the_holder_when_its_method_raises(impl):
    m = installed(impl)
    with pytest.raises(RuntimeError, match="failed for r9"):
        m.fail("r9")
    assert impl[2]() == 0


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def test_owner_inside_a_boundary_decides_and_the_boundary_comes_back():
    with owners.holding("boundary"):
        with kvguard.owner("inner"):
            assert kvguard.current_holder() == "inner"
        assert kvguard.current_holder() == "boundary"
    with kvguard.owner("outer"):
        with owners.holding("boundary"):
            assert kvguard.current_holder() == "boundary"
        assert kvguard.current_holder() == "outer"
    assert kvguard.current_holder() is None


def test_the_slot_is_per_thread_and_threads_started_inside_follow_it():
    seen = {}
    ready, done = threading.Event(), threading.Event()

    def other():
        ready.wait()
        seen["other"] = kvguard.current_holder()
        done.set()

    def started():
        seen["started"] = kvguard.current_holder()

    t = threading.Thread(target=other)
    t.start()
    kvguard.instrument()
    try:
        with owners.holding("req-t"):
            ready.set()
            done.wait(10)
            child = threading.Thread(target=started)
            child.start()
            child.join()
    finally:
        kvguard.uninstrument()
    t.join()
    assert seen == {"other": None, "started": "req-t"}


def test_declared_boundaries_use_the_compiled_boundary_and_keep_the_method_look():
    class Engine:
        def allocate_slots(self, request, n):
            """Allocate for one request."""
            return kvguard.current_holder()

    boundaries.declare(Engine, allocate_slots=boundaries.request_arg(0))
    boundaries.instrument()
    try:
        method = Engine.__dict__["allocate_slots"]
        assert owners.Boundary is owners._py_boundary or isinstance(method, owners.Boundary)
        assert Engine.allocate_slots.__name__ == "allocate_slots"
        assert Engine.allocate_slots.__doc__ == "Allocate for one request."
        assert Engine.allocate_slots.__wrapped__.__name__ == "allocate_slots"
        assert Engine().allocate_slots(Request("r1"), 1) == "r1"
    finally:
        boundaries.uninstrument()
    assert Engine().allocate_slots(Request("r1"), 1) is None


@pytest.mark.skipif(owners.Boundary is owners._py_boundary, reason="the compiled part is not built")
def test_compiled_parts_reject_bad_arguments_with_clear_errors():
    with pytest.raises(TypeError):
        owners.Boundary(42)
    with pytest.raises(TypeError):
        owners.Boundary(len, 1, 0, 7)
    with pytest.raises(TypeError):
        owners.holding()
    with pytest.raises(TypeError):
        owners.holding("a", "b")
    with pytest.raises(ValueError):
        owners.swap_holder(-2)
    with pytest.raises(TypeError):
        owners.swap_holder("x")
    assert owners.holder_now() == 0
    with pytest.raises(TypeError):
        owners.FASTPATH.bind_holders(1, {}, len)


@pytest.mark.parametrize("accel,fast", three_ways(),
                         ids=lambda v: "fast" if v is True else "careful" if v is False
                         else "closures" if v is None else "compiled")
def test_a_stale_free_inside_a_boundary_is_reported_on_every_wrapper(accel, fast):
    class Server:
        def __init__(self, pool):
            self.pool, self.blocks = pool, {}

        def allocate(self, request_id, n):
            self.blocks[request_id] = self.pool.allocate(n)
            return self.blocks[request_id]

        def free(self, request_id, blocks=None):
            self.pool.free(blocks if blocks is not None else self.blocks.pop(request_id))

    boundaries.declare(Server, allocate=boundaries.request_id_arg(0),
                       free=boundaries.request_id_arg(0))
    boundaries.instrument()
    try:
        with use_wrappers(accel):
            pool = LinkedFreeList(4)
            g = kvguard.guard(pool, fast_path=fast)
            server = Server(pool)
            r = server.allocate("R", 2)
            server.free("R")
            q = server.allocate("Q", 2)
            reused = [b for b in q if b in r]
            assert reused
            with pytest.raises(kvguard.StaleFreeError) as info:
                server.free("R", reused)      # R's late free of what Q now holds
            assert "'Q' holds it" in str(info.value)
            assert set(g.live) == set(q) and g.live[reused[0]].holder == "Q"  # unchanged
            server.free("Q")                  # the holder's own free is fine
            assert g.stats.violations == {"stale-free": 1} and not g.live
    finally:
        boundaries.uninstrument()
        boundaries._declared.pop(f"{Server.__module__}.{Server.__qualname__}", None)
        boundaries._classes.pop(f"{Server.__module__}.{Server.__qualname__}", None)


def test_functools_wraps_keeps_the_boundary_a_descriptor():
    def method(self, request_id):
        return kvguard.current_holder()

    wrapped = owners.Boundary(method, 1, 0)
    functools.update_wrapper(wrapped, method)
    cls = type("C", (), {"m": wrapped})
    assert cls().m("x") == "x"
    assert cls.m.__wrapped__ is method
