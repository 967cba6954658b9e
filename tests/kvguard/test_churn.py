"""Readers of state that other threads create and drop tolerate the churn.

A metrics scrape, ``kvguard.guards()``, ``Guard.snapshot()`` and the staging summary all read
guards that other threads make, unguard and let the collector take at the same moment. Here
four threads create, use, unguard and drop guarded allocators as fast as they can while the
main thread reads everything there is to read; no read may raise, and the metrics' counters
never go down (a guard's counts move into ``retired`` when it is collected).
"""

import gc
import threading

import pytest

import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.staging import metrics

pytestmark = pytest.mark.usefixtures("quiet_kvguard_log")


class ChurnPool(LinkedFreeList):
    """A class of its own, so the counters read are this test's."""


def _churn(stop, errors):
    try:
        n = 0
        while not stop.is_set():
            pool = ChurnPool(8)
            g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="log", stacks="off")
            ids = pool.allocate(2)
            pool.free(ids)
            try:
                pool.free(ids)  # a double free: counted
            except ValueError:
                pass
            if n % 3 == 0:
                g.unguard()
            del pool, g
            n += 1
            if n % 50 == 0:
                gc.collect()
    except BaseException as exc:  # pragma: no cover - what the test reports
        errors.append(exc)


def test_reading_guards_while_other_threads_make_and_drop_them():
    totals = metrics.Totals()
    stop = threading.Event()
    errors: list = []
    workers = [threading.Thread(target=_churn, args=(stop, errors)) for _ in range(4)]
    for w in workers:
        w.start()
    last: dict = {}
    reads = 0
    try:
        for _ in range(300):
            for g in kvguard.guards():
                g.snapshot()
                g.stats.to_dict()
                list(g.live)
            counters, _gauges = totals.read()
            for key, value in counters.items():
                if key[1] and str(key[1][0]).endswith("ChurnPool"):  # labels: (class, ...)
                    assert value >= last.get(key, 0), (key, value, last.get(key))
                    last[key] = value
            reads += 1
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    assert not errors, errors
    assert reads == 300 and any(last.values()), "the readers saw nothing to read"
