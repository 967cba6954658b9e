"""The staging sink's lock survives an exception from a signal handler at any bytecode.

``JsonLinesSink`` takes its lock without blocking where it must never wait (the finalizer of a
collected guard, which may run inside the sink's own call; ``close(wait=False)`` from a signal
handler). It did so with ``if self._lock.acquire(blocking=False):`` one bytecode before the
``try`` that lets the lock go: an exception from a signal handler, run by the interpreter right
after that call returned, left the lock held for good, and every later line (and ``close()``,
which waits) with it. Here an interval timer raises into those methods' own frames thousands
of times; afterwards the lock is free. (``tests/kvguard/test_signals.py`` does the same for the
guard's lock.)
"""

import os
import signal

import pytest

import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.staging import JsonLinesSink
from kvguard.staging import sink as sink_module

pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no setitimer here")


class Interrupt(Exception):
    pass


def _storm(calls: int, work, codes) -> int:
    """``work()`` ``calls`` times under a timer raising ``Interrupt`` every 20 microseconds in
    the frames of ``codes`` only. Returns how many landed."""
    landed = [0]

    def handler(signum, frame):
        if frame is not None and frame.f_code in codes:
            landed[0] += 1
            raise Interrupt

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.00002, 0.00002)
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


def _remains(tmp_path):
    pool = LinkedFreeList(8)
    guard = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="log")
    pool.free(pool.allocate(2))  # something to report: the stats line is written
    return sink_module._Remains(guard), guard


def test_a_signal_in_the_collected_guards_finalizer_never_leaves_the_sink_locked(tmp_path):
    sink = JsonLinesSink(str(tmp_path / "k-{pid}.jsonl"), every=1)
    remains, guard = _remains(tmp_path)
    codes = {JsonLinesSink._on_collected.__code__}
    landed = _storm(20000, lambda: sink._on_collected(remains), codes)
    assert landed > 100, landed  # the storm reached the finalizer's frame
    assert not sink._lock.locked(), f"the sink's lock is held after {landed} interrupts"
    sink.close([guard])  # waits for the lock: would hang had one been lost
    guard.unguard()


def test_a_signal_in_close_without_waiting_never_leaves_the_sink_locked(tmp_path):
    sinks = []

    def work():
        sink = JsonLinesSink(str(tmp_path / f"c{len(sinks)}-{{pid}}.jsonl"), every=1)
        sinks.append(sink)
        sink.close((), wait=False)

    landed = _storm(5000, work, {JsonLinesSink.close.__code__})
    assert landed > 50, landed
    held = [s for s in sinks if s._lock.locked()]
    assert not held, f"{len(held)} of {len(sinks)} sinks locked for good after {landed} interrupts"
