"""The fuzzers are contained: an allocator (or engine) that hangs, exits, raises
``KeyboardInterrupt``/``GeneratorExit`` or forks is stopped and reported as a finding of its
own, with a non-zero exit, never the end of the run; the user's own Ctrl-C still stops it, with
what finished.

Every case runs in a subprocess of its own with a generous timeout: without the containment a
hang would hang that subprocess (and fail here by its timeout), an exit or an interrupt would
end it (exit 0 with no report, or 130), and a fork would leave a second copy of the fuzzer
running and reporting. The hang limit is 0.5 s; no assertion is timed beyond "did not hang"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
pytestmark = pytest.mark.skipif(not hasattr(signal, "setitimer") or not hasattr(os, "fork"),
                                reason="POSIX only")

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests.kvguard.contained_allocators"
DID_NOT_HANG = 120  # seconds: a subprocess past this hung

API = """if 1:
    import json, sys
    from kvguard.testing import check_allocator
    from tests.kvguard.contained_allocators import *
    report = check_allocator(lambda: {cls}(4), SPEC, examples=10, budget={budget}, hang={hang},
                             clauses={clauses}, raise_on_broken=False)
    print(json.dumps(report.to_dict()))
"""


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=DID_NOT_HANG, **kwargs)


def _api(cls: str, clauses=("valid-trace", "double-free"), budget=60, hang=0.5, env=None):
    out = _python(API.format(cls=cls, clauses=list(clauses), budget=budget, hang=hang),
                  env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cli(*argv, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvguard", "fuzz", *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=DID_NOT_HANG, env=env)


def _fuzz(cls: str, *more, env=None) -> subprocess.CompletedProcess:
    return _cli(f"{MODULE}.{cls}", "--factory", "cls(4)", "--spec", f"{MODULE}.SPEC",
                "--examples", "10", "--hang", "0.5", "--clause", "valid-trace", "--clause",
                "double-free", *more, env=env)


def _one_clear_finding(out, text: str) -> None:
    assert out.returncode == 1, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert text in out.stdout, out.stdout[-3000:]
    headers = [line for line in out.stdout.splitlines() if line.startswith("kvguard conf")]
    assert len(headers) == 1, out.stdout[-3000:]  # one report: no second copy of the fuzzer


# --- hangs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", ["LoopInFree", "SleepInFree"])
def test_a_hanging_call_is_interrupted_and_reported(cls):
    report = _api(cls)
    [escape] = report["escapes"]
    assert escape["kind"] == "hang" and escape["where"] == "free()", escape
    assert "the allocator hung: free() did not return within 0.5 s" in escape["text"]
    assert set(escape["clauses"]) >= {"valid-trace", "double-free"}


@pytest.mark.parametrize("cls", ["LoopInFree", "SleepInFree"])
def test_cli_a_hanging_call_is_a_finding(cls):
    _one_clear_finding(_fuzz(cls), "the allocator hung: free() did not return within 0.5 s")


def test_the_budget_bounds_a_hanging_call_whatever_the_hang_limit():
    started = time.monotonic()
    out = _cli(f"{MODULE}.SleepInFree", "--factory", "cls(4)", "--spec", f"{MODULE}.SPEC",
               "--hang", "3600", "--budget", "3")
    _one_clear_finding(out, "the allocator hung: free() did not return when the time for "
                       "this search ran out")
    assert time.monotonic() - started < DID_NOT_HANG / 2


def test_the_emitted_test_of_a_hang_stops_itself(tmp_path):
    [escape] = _api("SleepInFree", clauses=["valid-trace"])["escapes"]
    assert "signal.setitimer" in escape["test"], escape
    path = tmp_path / "test_emitted.py"
    path.write_text(escape["test"])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:randomly", str(path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=DID_NOT_HANG, env=env)
    assert out.returncode == 1, out.stdout[-3000:]
    assert "did not return within 0.5 s" in out.stdout and "1 failed" in out.stdout


def test_a_thread_that_cannot_take_signals_reports_the_hang_and_abandons_it():
    code = """if 1:
        import threading
        from kvguard.testing import check_allocator
        from tests.kvguard.contained_allocators import *
        got = []
        t = threading.Thread(target=lambda: got.append(check_allocator(
            lambda: LoopInFree(4), SPEC, examples=5, hang=0.5, budget=60,
            clauses=["valid-trace"], raise_on_broken=False)))
        t.start(); t.join(60)
        print(got[0].escapes[0].text)
        STOP.set()
    """
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the allocator hung: free() did not return within 0.5 s" in out.stdout
    assert "left running in a thread" in out.stdout


# --- BaseException from the allocator ---------------------------------------------------------

def test_sys_exit_0_in_free_is_reported_not_a_silent_exit():
    report = _api("ExitInFree")
    [escape] = report["escapes"]
    assert escape["text"] == "the allocator exited the process (SystemExit(0)) in free()"
    assert "except BaseException" in escape["test"], escape  # it fails, and ends nothing


def test_cli_sys_exit_0_in_free_exits_1_with_the_finding():
    _one_clear_finding(_fuzz("ExitInFree"),
                       "the allocator exited the process (SystemExit(0)) in free()")


def test_keyboard_interrupt_from_allocate_is_the_allocators_not_the_users():
    [escape] = _api("InterruptInAllocate")["escapes"]
    assert escape["kind"] == "interrupt" and escape["where"] == "allocate()", escape


def test_cli_keyboard_interrupt_from_allocate_is_a_finding_not_exit_130():
    _one_clear_finding(_fuzz("InterruptInAllocate"),
                       "the allocator raised KeyboardInterrupt() in allocate()")


def test_generator_exit_from_free_is_reported():
    [escape] = _api("GeneratorExitInFree")["escapes"]
    assert escape["kind"] == "generator-exit" and "free()" in escape["text"], escape


def test_cli_generator_exit_from_free_is_a_finding():
    _one_clear_finding(_fuzz("GeneratorExitInFree"),
                       "the allocator raised GeneratorExit() in free()")


def test_a_factory_raising_system_exit_is_reported():
    [escape] = _api("ExitInInit")["escapes"]
    assert escape["text"].startswith("the allocator exited the process (SystemExit(0)) in its "
                                     "factory"), escape


def test_cli_a_factory_raising_system_exit_is_a_finding():
    _one_clear_finding(_fuzz("ExitInInit"),
                       "the allocator exited the process (SystemExit(0)) in its factory")


# --- fork -------------------------------------------------------------------------------------

def test_a_fork_in_the_allocator_leaves_no_second_fuzzer(tmp_path):
    env = dict(os.environ, KVGUARD_TEST_FORK_MARK=str(tmp_path / "child"))
    report = _api("ForkInFree", env=env)
    [escape] = report["escapes"]
    assert escape["kind"] == "fork" and "os.fork() in free()" in escape["text"], escape
    assert not list(tmp_path.iterdir()), "a forked child ran on"


def test_cli_a_fork_in_the_allocator_is_reported_once(tmp_path):
    env = dict(os.environ, KVGUARD_TEST_FORK_MARK=str(tmp_path / "child"))
    out = _fuzz("ForkInFree", env=env)
    _one_clear_finding(out, "the allocator forked the process (os.fork() in free())")
    assert not list(tmp_path.iterdir()), "a forked child ran on"


# --- the user's Ctrl-C ------------------------------------------------------------------------

def test_the_users_ctrl_c_stops_the_run_with_what_finished():
    proc = subprocess.Popen([sys.executable, "-m", "kvguard", "fuzz", f"{MODULE}.SlowPool",
                             "--factory", "cls(4)", "--spec", f"{MODULE}.SPEC", "--examples",
                             "100000", "--budget", "600"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stderr.readline()  # progress: a clause is running, past start-up
        assert "clause" in line, line
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=DID_NOT_HANG)
    finally:
        proc.kill()
    assert proc.returncode == 130, (stdout[-2000:], stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "interrupted (Ctrl-C)" in stdout and "kvguard conformance:" in stdout
    assert stderr.strip().splitlines()[-1] == ("kvguard fuzz: interrupted (Ctrl-C): the report "
                                               "above holds what finished")


def test_the_users_ctrl_c_raises_keyboard_interrupt_with_the_report():
    code = """if 1:
        import os, signal, threading
        from kvguard.testing import check_allocator
        from tests.kvguard.contained_allocators import *
        threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            check_allocator(lambda: SlowPool(4), SPEC, examples=100000, budget=600)
        except KeyboardInterrupt as stop:
            print("stopped:", stop.report.interrupted, len(stop.report.not_run))
    """
    out = _python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stopped: interrupted (Ctrl-C)" in out.stdout, out.stdout


# --- the lifecycle fuzzer ---------------------------------------------------------------------

LIFECYCLE = """if 1:
    from kvguard.testing import check_lifecycle
    from tests.kvguard.contained_allocators import *
    report = check_lifecycle({engine}, Driver, examples=20, budget=60, hang=0.5,
                             raise_on_finding=False)
    print(report.render())
"""


@pytest.mark.parametrize("engine, text", [
    ("hanging_engine", "the engine hung: schedule() did not return within 0.5 s"),
    ("exiting_engine", "the engine exited the process (SystemExit(0)) in abort()"),
])
def test_the_lifecycle_fuzzer_contains_the_engine(engine, text):
    out = _python(LIFECYCLE.format(engine=engine))
    assert out.returncode == 0, out.stderr[-3000:]
    assert text in out.stdout, out.stdout[-3000:]


def test_cli_lifecycle_hang_is_a_finding():
    code = """if 1:
        import sys
        from kvguard.conformance import lifecycle_cli
        from tests.kvguard.contained_allocators import Driver, hanging_engine
        lifecycle_cli.ENGINES["hanging"] = (lambda config: (hanging_engine, Driver), "fixed")
        from kvguard.cli import main
        sys.exit(main(["fuzz", "--lifecycle", "hanging", "--examples", "20", "--hang", "0.5",
                       "--budget", "60"]))
    """
    out = _python(code)
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    assert "the engine hung: schedule() did not return within 0.5 s" in out.stdout
