"""The guard's lock: ``kvguard._fastpath.GuardLock`` (the compiled wrappers take it inline)
behaves as ``threading.RLock`` does for everything kvguard and its users do with ``guard.lock``.

Every test runs on both locks (``lock_type``), so the RLock is the reference the GuardLock is
held to; then the guard's wrappers on both implementations, contending with a hook that holds
``guard.lock``.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import signal
import sys
import threading
import time
import warnings
import weakref

import pytest

import kvguard
from .conftest import compiled_wrappers

FASTPATH = compiled_wrappers()


@pytest.fixture(params=["RLock", "GuardLock"])
def lock_type(request):
    if request.param == "RLock":
        return threading.RLock
    if FASTPATH is None:
        pytest.skip("kvguard._fastpath is not built (no C compiler at install)")
    return FASTPATH.GuardLock


def in_thread(fn, *args):
    """fn(*args) run in another thread: what it returned, or the exception it raised."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive(), "the other thread hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


def in_threads(fn, n):
    """fn() run in n threads at once, all finished (within 30 s each)."""
    threads = [threading.Thread(target=fn) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


class Holder:
    """Another thread holding ``lock`` until ``done()``."""

    def __init__(self, lock):
        self.lock = lock
        self.held, self.go = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold)
        self.thread.start()
        assert self.held.wait(10)

    def _hold(self):
        with self.lock:
            self.held.set()
            self.go.wait(10)

    def done(self):
        self.go.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_reentrant_and_owned_by_the_acquiring_thread(lock_type):
    lock = lock_type()
    assert not lock._is_owned()
    assert lock.acquire() is True
    assert lock.acquire(True) is True and lock.acquire(blocking=False) is True
    assert lock._is_owned() and "locked" in repr(lock) and "count=3" in repr(lock)
    assert in_thread(lock._is_owned) is False
    for _ in range(3):
        lock.release()
    assert not lock._is_owned() and repr(lock).startswith("<unlocked")
    with pytest.raises(RuntimeError, match="cannot release un-acquired lock"):
        lock.release()
    with lock as entered:
        assert entered is True and lock._is_owned()
        with lock:
            assert lock._is_owned()
        assert lock._is_owned()
    assert not lock._is_owned()


def test_a_release_from_a_thread_that_does_not_hold_it_raises_and_changes_nothing(lock_type):
    lock = lock_type()
    lock.acquire()
    with pytest.raises(RuntimeError, match="cannot release un-acquired lock"):
        in_thread(lock.release)
    assert lock._is_owned()
    assert in_thread(lambda: lock.acquire(False)) is False, "still held by this thread"
    lock.release()
    assert in_thread(lambda: (lock.acquire(False), lock.release())[0]) is True


def test_another_threads_lock_does_not_block_a_non_blocking_or_timed_acquire(lock_type):
    lock = lock_type()
    holder = Holder(lock)
    try:
        assert lock.acquire(False) is False
        assert lock.acquire(blocking=False) is False
        start = time.monotonic()
        assert lock.acquire(timeout=0.05) is False
        assert time.monotonic() - start >= 0.045
        assert lock.acquire(True, 0) is False
        assert not lock._is_owned()
    finally:
        holder.done()
    assert lock.acquire(timeout=5) is True and lock._is_owned()
    lock.release()


def test_a_blocked_acquire_returns_once_the_holder_releases(lock_type):
    lock = lock_type()
    holder = Holder(lock)
    threading.Timer(0.05, holder.done).start()
    start = time.monotonic()
    assert lock.acquire() is True
    assert time.monotonic() - start >= 0.04 and lock._is_owned()
    lock.release()


@pytest.mark.parametrize("args, kwargs, error", [
    ((False, 1), {}, ValueError),                 # a timeout on a non-blocking call
    ((), {"blocking": False, "timeout": 0.5}, ValueError),
    ((), {"timeout": -2}, ValueError),            # negative, not -1
    ((), {"timeout": math.nan}, ValueError),
    ((), {"timeout": 1e300}, OverflowError),
    ((), {"timeout": "1"}, TypeError),
    ((True, 1, 2), {}, TypeError),
    ((), {"wait": True}, TypeError),
])
def test_acquires_bad_arguments_raise_as_rlocks_do(lock_type, args, kwargs, error):
    lock = lock_type()
    with pytest.raises(error):
        lock.acquire(*args, **kwargs)
    assert not lock._is_owned(), "a rejected acquire takes nothing"
    assert lock.acquire(False, -1) is True and lock.acquire(timeout=-1) is True
    lock.release()
    lock.release()


def test_threads_contending_each_get_it_in_turn(lock_type):
    lock = lock_type()
    box = {"n": 0}

    def work():
        for _ in range(300):
            with lock:
                with lock:  # re-entered under contention
                    n = box["n"]
                    time.sleep(0)  # let the others run while holding it
                    box["n"] = n + 1
            if not lock.acquire(timeout=5):
                raise AssertionError("timed out")
            lock.release()
    in_threads(work, 4)
    assert box["n"] == 1200 and not lock._is_owned()


def test_a_condition_over_it_releases_every_level_while_it_waits(lock_type):
    lock = lock_type()
    cond = threading.Condition(lock)
    seen = []

    def notify():
        with cond:  # possible only if wait() dropped both levels
            seen.append("other")
            cond.notify()
    with lock:
        with cond:
            threading.Timer(0.02, notify).start()
            assert cond.wait(5)
            assert lock._is_owned()
        assert lock._is_owned()
    assert seen == ["other"] and not lock._is_owned()
    with pytest.raises(RuntimeError):
        lock._release_save()
    for bad in ("x", (1,), (1, 2, 3), ("a", "b")):
        with pytest.raises(TypeError):
            lock._acquire_restore(bad)
        assert not lock._is_owned(), "a rejected restore takes nothing"
        assert in_thread(lambda: (lock.acquire(False), lock.release())[0]) is True


@pytest.mark.skipif(not hasattr(signal, "setitimer") or sys.platform == "win32",
                    reason="needs SIGALRM")
def test_a_signal_handlers_exception_ends_a_blocked_acquire(lock_type):
    lock = lock_type()
    holder = Holder(lock)

    class Alarm(Exception):
        pass

    def raise_alarm(signum, frame):
        raise Alarm
    old = signal.signal(signal.SIGALRM, raise_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Alarm):
            lock.acquire()
        assert not lock._is_owned()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Alarm):
            lock.acquire(timeout=5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        holder.done()
    assert lock.acquire(False) is True, "the interrupted waits left nothing behind"
    lock.release()


def test_at_fork_reinit_frees_it_and_it_is_weakly_referenceable_not_picklable(lock_type):
    lock = lock_type()
    lock.acquire()
    lock.acquire()
    lock._at_fork_reinit()  # what kvguard's after-fork hook does in the child
    assert not lock._is_owned() and in_thread(lambda: lock.acquire(False)) is True
    assert weakref.ref(lock)() is lock
    for dump in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError):
            dump(lock)


@pytest.mark.skipif(FASTPATH is None, reason="kvguard._fastpath is not built")
def test_guardlock_takes_no_arguments_and_dies_unlocked_or_held():
    with pytest.raises(TypeError):
        FASTPATH.GuardLock(1)
    with pytest.raises(TypeError):
        FASTPATH.GuardLock(blocking=True)
    held = FASTPATH.GuardLock()
    held.acquire()
    del held  # freed while held, as an RLock may be
    waited = FASTPATH.GuardLock()
    holder = Holder(waited)
    assert waited.acquire(timeout=0.01) is False  # a waiter came and went
    holder.done()
    del waited


# --- the guard's lock under the wrappers ---------------------------------------------------


class Pool:
    """A free list whose allocate can be held open (``gate``) to keep a guarded call running."""

    def __init__(self, n=8):
        self.free_ids = list(range(n))
        self.gate = None

    def allocate(self):
        if self.gate is not None:
            self.gate()
        return self.free_ids.pop()

    def free(self, block):
        self.free_ids.append(block)


def guarded_pool():
    pool = Pool()
    kvguard.guard(pool, kvguard.AllocatorSpec(),
                  on_violation="log")
    return pool


def test_the_guards_lock_is_the_compiled_wrappers_own_only_with_them(implementation):
    pool = guarded_pool()
    lock = kvguard.guard_of(pool).lock
    if implementation == "compiled":
        assert type(lock) is FASTPATH.GuardLock
        assert type(vars(pool)["free"]).__name__ == "Wrapper"
    else:
        assert type(lock) is type(threading.RLock())


def test_a_hook_holding_the_guards_lock_holds_off_another_threads_guarded_call(implementation):
    pool = guarded_pool()
    g = kvguard.guard_of(pool)
    done = threading.Event()
    with g.lock:  # as a hook (kvguard.cache, writes) takes it
        assert g.inside()
        t = threading.Thread(target=lambda: (pool.free(pool.allocate()), done.set()))
        t.start()
        assert not done.wait(0.1), "the guarded call ran while the lock was held"
        pool.free(pool.allocate())  # this thread holds it: its calls pass straight through
    assert done.wait(10)
    t.join(10)
    assert (g.stats.alloc_calls, g.stats.free_calls) == (1, 1), "the other thread's, checked"
    assert not g.stats.violations


def test_a_guarded_call_in_progress_holds_the_lock_against_timed_and_foreign_acquires(
        implementation):
    pool = guarded_pool()
    g = kvguard.guard_of(pool)
    inside, leave = threading.Event(), threading.Event()

    def gate():
        assert g.inside()
        inside.set()
        leave.wait(10)
    pool.gate = gate
    t = threading.Thread(target=pool.allocate)
    t.start()
    try:
        assert inside.wait(10)
        assert g.lock.acquire(timeout=0.05) is False
        assert g.lock.acquire(False) is False
        with pytest.raises(RuntimeError):
            g.lock.release()  # held by the allocating thread, not this one
        assert not g.inside()
    finally:
        leave.set()
        t.join(10)
    pool.gate = None
    assert g.lock.acquire(False) is True
    g.lock.release()
    assert g.stats.alloc_calls == 1 and len(pool.free_ids) == 7


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_holds_the_compiled_guards_lock(implementation, tmp_path):
    """Mostly test_adversarial_guard's fork test, here for both implementations: the child's
    guarded call goes through (the after-fork hook frees the lock) and is checked."""
    pool = guarded_pool()
    holder = Holder(kvguard.guard_of(pool).lock)
    try:
        with warnings.catch_warnings():  # 3.12+: forking a process that has threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: exit code says what happened
            code = 1
            try:
                g = kvguard.guard_of(pool)
                b = pool.allocate()
                pool.free(b)
                pool.free(b)  # a double free, caught (log mode)
                code = 0 if (g.stats.alloc_calls, g.stats.free_calls) == (1, 2) and \
                    not g.inside() else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        holder.done()
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("wrappers, lock", [("compiled", "GuardLock"), ("pure", "RLock"),
                                            ("pure", "GuardLock")])
def test_threads_allocating_and_freeing_through_the_wrappers_under_either_lock(
        monkeypatch, wrappers, lock):
    """Both implementations can run in one process (the hooks of ``kvguard.guard.roles`` are
    Python under the compiled wrappers too), so the Python wrappers must work under a GuardLock."""
    from kvguard.guard import shadowing
    if FASTPATH is None and (wrappers == "compiled" or lock == "GuardLock"):
        pytest.skip("kvguard._fastpath is not built (no C compiler at install)")
    monkeypatch.setattr(shadowing, "ACCEL", FASTPATH if wrappers == "compiled" else None)
    monkeypatch.setattr(shadowing, "new_lock",
                        FASTPATH.GuardLock if lock == "GuardLock" else threading.RLock)
    pool = guarded_pool()
    g = kvguard.guard_of(pool)
    assert type(g.lock).__name__ == lock
    assert (type(vars(pool)["free"]).__name__ == "Wrapper") == (wrappers == "compiled")

    def work():
        for _ in range(300):
            pool.free(pool.allocate())
    in_threads(work, 4)
    assert (g.stats.alloc_calls, g.stats.free_calls) == (1200, 1200)
    assert not g.violations and not g.live and len(pool.free_ids) == 8


@pytest.mark.parametrize("patched", ["RLock", "get_ident", "_thread.get_ident"])
def test_green_threads_get_the_rlock_they_patched_in(monkeypatch, patched):
    """gevent and eventlet make ``threading`` (and ``_thread``) per greenlet: a lock owned per
    OS thread would pass a second greenlet's call, made while the first is switched out inside
    the guarded call, through unchecked as the allocator calling itself. So where ``threading``
    is not CPython's own, a new guard's lock is the ``threading.RLock`` of the day, and the
    compiled wrappers take it through its methods. Modelled here by patching in pure-Python
    twins of what those libraries patch (neither is installed here)."""
    import _thread

    from kvguard.guard import shadowing
    if FASTPATH is None:
        pytest.skip("kvguard._fastpath is not built (no C compiler at install)")
    monkeypatch.setattr(shadowing, "ACCEL", FASTPATH)
    assert type(guarded_pool_lock()) is FASTPATH.GuardLock
    ident = _thread.get_ident
    if patched == "RLock":
        monkeypatch.setattr(threading, "RLock", threading._PyRLock)
    elif patched == "get_ident":
        monkeypatch.setattr(threading, "get_ident", lambda: ident())
    else:
        green = (lambda: ident())
        monkeypatch.setattr(_thread, "get_ident", green)
        monkeypatch.setattr(threading, "get_ident", green)
    lock = guarded_pool_lock()
    assert type(lock) is not FASTPATH.GuardLock
    pool = guarded_pool()
    guard = kvguard.guard_of(pool)
    assert type(guard.lock) is type(lock) and type(vars(pool)["free"]).__name__ == "Wrapper"
    block = pool.allocate()
    pool.free(block)
    pool.free(block)
    assert [v.kind for v in guard.violations] == ["double-free"]


def guarded_pool_lock():
    return kvguard.guard_of(guarded_pool()).lock


def test_a_timed_acquire_reads_the_os_clock_not_time_monotonic(lock_type, monkeypatch):
    """A test suite that freezes ``time.monotonic`` (freezegun does) must not turn a timed
    acquire into an endless one: the timeout is measured on the clock CPython's locks read."""
    lock = lock_type()
    holder = Holder(lock)
    releaser = threading.Timer(5, holder.go.set)  # without the fix: taken after 5 s, not timed out
    releaser.start()
    try:
        frozen = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: frozen)
        assert lock.acquire(timeout=0.2) is False
    finally:
        monkeypatch.undo()
        releaser.cancel()
        holder.done()


def test_a_lock_freed_while_a_thread_waits_is_not_taken_back_without_waiting():
    """The releasing thread must not take the lock straight back from a thread waiting for it
    (as a guarded allocator called in a loop would, over and over): the waiter would wait
    through GIL switch intervals, milliseconds each, for every call it makes. CPython's RLock
    gets this from its OS lock, which the woken waiter holds at once; the GuardLock, which
    takes the OS lock only to wait, reserves itself for the waiters on release, so the
    releasing thread has to wait beside them (who of them gets it is the OS's choice)."""
    if FASTPATH is None:
        pytest.skip("kvguard._fastpath is not built (no C compiler at install)")
    lock = FASTPATH.GuardLock()
    lock.acquire()
    order = []
    waiting = threading.Event()

    def waiter():
        waiting.set()
        with lock:
            order.append("waiter")
    t = threading.Thread(target=waiter)
    t.start()
    assert waiting.wait(10)
    time.sleep(0.2)  # the waiter is now blocked in acquire(), the GIL released
    lock.release()
    assert lock.acquire(blocking=False) is False  # reserved for the waiter
    assert not lock._is_owned()
    assert lock.acquire(timeout=10) is True
    order.append("releaser")
    lock.release()
    t.join(10)
    assert sorted(order) == ["releaser", "waiter"] and not lock._is_owned()
