"""A staged process killed outright leaves its live gauge files in ``prometheus_client``'s
multi-process directory, and its last gauges in every sum: the other staged processes' writers
mark them dead (``reap_dead``), as a supervisor's ``mark_process_dead`` would."""

import os
import signal
import subprocess

import pytest

from kvguard.staging.reaper import reap_dead

from .staging_env import staged_env, staged_python_fixture  # noqa: F401

pytest.importorskip("prometheus_client")

STAGED = '''
import os, sys, time
import prometheus_client  # as an engine does; staging's writer starts with it
from kvguard.examples import LinkedFreeList
pool = LinkedFreeList(8)
pool.allocate(3)
mine = f"gauge_livesum_{os.getpid()}.db"
deadline = time.monotonic() + 60
while mine not in os.listdir(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
print("ready" if mine in os.listdir(sys.argv[1]) else "no gauge file", flush=True)
time.sleep(600)
'''

PLAIN = '''
import os, sys
import prometheus_client
prometheus_client.Gauge("engine_queue", "queue", multiprocess_mode="livesum").set(3)
print("ready", flush=True)
'''


def start(python, source, directory, staged):
    env = staged_env(PROMETHEUS_MULTIPROC_DIR=directory, KVGUARD_METRICS_INTERVAL="0.05",
                     **({"KVGUARD": 1, "KVGUARD_REGISTER": "kvguard.examples.LinkedFreeList"}
                        if staged else {}))
    child = subprocess.Popen([python, "-c", source, directory], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
    except BaseException:
        child.kill()
        raise
    return child


def test_the_live_gauges_of_a_killed_staged_process_are_marked_dead(tmp_path, staged_python):
    directory = str(tmp_path)
    killed = start(staged_python, STAGED, directory, staged=True)
    alive = start(staged_python, STAGED, directory, staged=True)
    other = start(staged_python, PLAIN, directory, staged=False)  # an engine's process, not ours
    other.wait(timeout=60)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    try:
        assert f"gauge_livesum_{killed.pid}.db" in os.listdir(directory)
        reaped = set()
        assert reap_dead(reaped, directory) == [killed.pid]
        files = os.listdir(directory)
        assert f"gauge_livesum_{killed.pid}.db" not in files
        assert f"counter_{killed.pid}.db" in files  # counters stay: they never go down
        assert f"gauge_livesum_{alive.pid}.db" in files
        assert f"gauge_livesum_{other.pid}.db" in files  # not kvguard's to judge
        assert reap_dead(reaped, directory) == []
    finally:
        alive.kill()
        alive.wait(timeout=60)
