"""Staging never blocks the host: a log that cannot take a line costs the line, not the call.

A ``KVGUARD_LOG`` that was a FIFO with no reader blocked the first guarded call that logged, in
``open()``, holding the guard's lock (every other thread freeing a block then waited too). The
sink opens non-blocking now: the record is dropped and counted (``dropped`` in the ``stats``
line), and the next record tries again, so a reader that comes later gets the lines from then
on. A pipe that is full, or a disk that is full, drops the line the same way.
"""

import errno
import json
import os
import subprocess
import textwrap
import threading

import pytest

import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.staging import JsonLinesSink

from .staging_env import staged_env, staged_python_fixture  # noqa: F401

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")

SERVE = textwrap.dedent('''
    import json, threading
    import kvguard
    from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList

    class FifoPool(LinkedFreeList):
        pass

    pool = FifoPool(8)
    g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="log")
    ids = pool.allocate(2)
    pool.free(ids)
    try:
        pool.free(ids)  # a double free: logged, and its record has nowhere to go
    except ValueError:
        pass
    taken = []
    other = threading.Thread(target=lambda: taken.append(g.lock.acquire(timeout=5)))
    other.start()
    other.join(30)
    print(json.dumps({"violations": len(g.violations), "lock_free": taken == [True]}))
''')


def test_a_kvguard_log_fifo_with_no_reader_never_blocks_a_guarded_call(tmp_path,
                                                                        staged_python):
    fifo = tmp_path / "kvguard.jsonl"
    os.mkfifo(fifo)
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    env = staged_env(KVGUARD=1, KVGUARD_LOG=str(fifo), KVGUARD_MODE="log")
    done = subprocess.run([staged_python, str(script)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"violations": 1, "lock_free": True}
    assert "is a FIFO with no reader" in done.stderr
    assert "Traceback" not in done.stderr


def _guarded_double_free(sink):
    unsubscribe = kvguard.subscribe(sink)
    try:
        pool = LinkedFreeList(8)
        g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="log")
        ids = pool.allocate(1)
        pool.free(ids)
        try:
            pool.free(ids)
        except ValueError:
            pass
    finally:
        unsubscribe()
    return g


def test_the_sink_drops_and_counts_a_line_for_a_fifo_without_reader_then_recovers(
        tmp_path, quiet_kvguard_log):
    fifo = tmp_path / "k.jsonl"
    os.mkfifo(fifo)
    sink = JsonLinesSink(str(fifo), every=1)
    got = []  # in a thread with a timeout: a blocking open fails the test, never hangs it
    worker = threading.Thread(target=lambda: got.append(_guarded_double_free(sink)),
                              daemon=True)
    worker.start()
    worker.join(60)
    assert got, "the guarded call blocked on a FIFO with no reader"
    assert sink.dropped == 1 and not sink.failed and len(got[0].violations) == 1
    # a reader comes: the next record is written, start line first
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        _guarded_double_free(sink)
        data = os.read(reader, 1 << 16).decode()
    finally:
        os.close(reader)
    events = [json.loads(line)["event"] for line in data.splitlines()]
    assert events == ["start", "violation"]


def test_a_full_pipe_or_disk_costs_the_line_and_nothing_else(tmp_path, monkeypatch,
                                                             quiet_kvguard_log):
    sink = JsonLinesSink(str(tmp_path / "k.jsonl"), every=1)
    real_write = os.write
    full = [errno.EAGAIN]

    def write(fd, data):
        if full and fd == sink._fd:
            raise OSError(full[0], os.strerror(full[0]))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    for code in (errno.EAGAIN, errno.ENOSPC):
        full[:] = [code]
        _guarded_double_free(sink)
    assert sink.dropped >= 2 and not sink.failed
    full.clear()
    _guarded_double_free(sink)
    with open(sink.path) as f:
        lines = [json.loads(line)["event"] for line in f]
    assert lines == ["start", "violation"], "a dropped start line is written before the next"


def test_a_guarded_call_holding_the_lock_while_logging_never_waits_on_the_log(
        tmp_path, quiet_kvguard_log):
    """A FIFO whose reader never reads: once its pipe is full, lines are dropped; the guarded
    calls go on (run in a thread with a timeout, so a block fails the test)."""
    fifo = tmp_path / "k.jsonl"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # there, but never reads
    sink = JsonLinesSink(str(fifo), every=1)
    finished = []

    def many():
        for _ in range(400):  # far more than a 64 KiB pipe holds
            _guarded_double_free(sink)
        finished.append(True)

    try:
        worker = threading.Thread(target=many, daemon=True)
        worker.start()
        worker.join(120)
    finally:
        os.close(reader)
    assert finished == [True], "a guarded call waited on the log"
    assert sink.dropped > 0 and not sink.failed
