"""Signals delivered at random points of guarded calls: the guard's lock is never lost.

A signal handler that raises can land at almost any bytecode. The closures once took the
guard's lock with ``acquire()`` one statement before the ``try`` that releases it: an
exception landing in between left the lock held for good (later calls on that thread passed
unchecked as the allocator "calling itself", other threads hung). Here a repeating interval
timer raises into the guard's own frames (never into the allocator's: the allocator is the
engine's code, and one interrupted half-way is corrupt whoever guards it) thousands of times,
on the compiled wrappers, the closures and the careful path; afterwards the lock is free,
another thread takes it at once, and later calls are checked. (The ledger is not compared: in
Python, an exception landing in the instant between the allocator's return and the ledger's
update loses that one call's record; see docs/reliability.md.)
"""

import os
import signal
import threading

import pytest

import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList

from .conftest import three_ways, use_wrappers

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no setitimer here")


class Interrupt(Exception):
    pass


KVGUARD = os.path.dirname(kvguard.__file__)
ALLOCATOR_CODE = {LinkedFreeList.allocate.__code__, LinkedFreeList.free.__code__}


def _storm(calls: int, work) -> int:
    """``work()`` ``calls`` times under a timer raising ``Interrupt`` every 50 microseconds in
    whatever frame of ``work`` or of kvguard runs then (not the allocator's, nor pytest's).
    Returns how many landed."""
    landed = [0]
    own = set()  # the storm's own loop and its handler are not a guarded call

    def handler(signum, frame):
        if frame is None or frame.f_code in ALLOCATOR_CODE or frame.f_code in own or not (
                frame.f_code is work.__code__ or frame.f_code.co_filename.startswith(KVGUARD)):
            return
        landed[0] += 1
        raise Interrupt

    own.update((_storm.__code__, handler.__code__))
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.00005, 0.00005)
    try:
        for _ in range(calls):
            try:
                work()
            except Interrupt:
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    return landed[0]


@pytest.mark.parametrize("accel, fast", three_ways(),
                         ids=lambda v: "compiled" if v not in (None, True, False) else str(v))
def test_a_signal_raising_anywhere_in_a_guarded_call_never_leaves_the_lock_held(accel, fast):
    pool = LinkedFreeList(64)
    with use_wrappers(accel):
        guard = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, stacks="cheap",
                              on_violation="log", fast_path=fast)
    held = []

    def reclaim(need):
        if pool.free_blocks < need:  # blocks whose ids an interrupt lost: the allocator's own
            held.clear()             # table says which are out
            pool.free([b for b in range(64) if pool._blocks[b] == -1])

    def work():
        reclaim(2)
        if held and len(held) % 3 == 0:
            ids = held.pop()
            pool.free(ids)
        else:
            held.append(pool.allocate(2))

    try:
        landed = _storm(3000, work)
    except RuntimeError as exc:  # "cannot release un-acquired lock": the lock was lost
        pytest.fail(f"the guard's lock broke: {exc}")
    assert landed > 0, "no interrupt landed: the test tried nothing"
    assert not guard.lock._is_owned(), "the lock is still held by this thread"
    taken = []

    def take():
        taken.append(guard.lock.acquire(timeout=10))
        if taken[-1]:
            guard.lock.release()

    other = threading.Thread(target=take)
    other.start()
    other.join(30)
    assert taken == [True], "another thread could not take the guard's lock"
    # later calls are still checked: a double free is seen (not passed through as the
    # allocator calling itself); the storm's last call may have taken the last free blocks
    reclaim(1)
    ids = pool.allocate(1)
    before = len(guard.violations)
    pool.free(ids)
    with pytest.raises(ValueError):  # log mode forwards it: the allocator refuses it
        pool.free(ids)
    assert [v.kind for v in guard.violations[before:]] == ["double-free"]


def test_an_exception_at_any_line_of_let_go_never_leaves_the_dispatch_lock_held():
    """A signal handler may raise at any line of ``dispatch.let_go`` (it runs from finalizers,
    in the middle of anything). Raising at each line in turn, as a handler would, must leave
    the dispatchers' lock free: a lost lock hangs every later ``kvguard.guard()``. The code
    before (a ``try`` after a non-blocking ``acquire()``) lost it at the ``try`` line."""
    import sys

    from kvguard import dispatch

    code = dispatch.let_go.__code__
    lines = sorted({line for _, _, line in code.co_lines() if line is not None})
    raised_at = []
    for target in lines:
        def tracer(frame, event, arg, target=target):
            if frame.f_code is not code:
                return None

            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == target:
                    raised_at.append(target)
                    raise Interrupt
                return local
            return local

        sys.settrace(tracer)
        try:
            dispatch.let_go(object())
        except Interrupt:
            pass
        finally:
            sys.settrace(None)
        got = []

        def take():
            got.append(dispatch._lock.acquire(timeout=2))
            if got[-1]:
                dispatch._lock.release()
        t = threading.Thread(target=take)
        t.start()
        t.join()
        assert got == [True], f"the lock was lost at line {target}"
    assert len(raised_at) >= 3, raised_at
