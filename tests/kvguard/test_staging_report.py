"""``kvguard report`` (merging) and ``kvguard run`` (one command with staging on)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvguard import kinds
from kvguard.staging.report import render
from kvguard.staging.summary import collect_files, load, summarize

from .sample_records import violation
from .staging_env import staged_env, staged_python_fixture  # noqa: F401


def record(event, pid=11, **fields):
    base = {"kvguard": 1, "event": event, "pid": pid, "host": "h1", "time": 1.0}
    base.update(fields)
    return base


GUARD = {"name": "Pool#1", "class": "eng.Pool", "address": "0x1", "mode": "log",
         "stacks": "cheap", "sample": 1, "learning": False, "learned": 0, "seeded": 0}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_top_call_sites_count_the_population_by_kind_counts(tmp_path):
    """by_kind and top_sites add up to the same figures: the stats line's exact count goes to
    the one site a kind was logged at, and, for a kind logged at two sites of one guard, what
    the lines do not attribute is one entry of its own (it was counted at 4 where by_kind said
    201: only the logged lines)."""
    other = violation(site=("serve.py", 20, "abort"))
    path = write(tmp_path / "a.jsonl", [
        record("start"),
        *[record("violation", occurrence=n, guard=GUARD, violation=violation()) for n in (1, 100)],
        record("violation", occurrence=1, guard=GUARD, violation=other),
        record("violation", occurrence=1, guard=GUARD,
               violation=violation(kind="duplicate-id")),
        record("stats", guard=GUARD, stats={"alloc_calls": 10, "free_calls": 300,
                                            "share_calls": 0, "learned": 0,
                                            "internal_errors": 0,
                                            "violations": {"double-free": 201,
                                                           "duplicate-id": 57}}),
    ])
    summary = summarize(load([path]))
    per_kind = {}
    for entry in summary["top_sites"]:
        per_kind[entry["kind"]] = per_kind.get(entry["kind"], 0) + entry["count"]
    assert per_kind == {k: e["count"] for k, e in summary["by_kind"].items()} == {
        "double-free": 201, "duplicate-id": 57}
    sites = {(e["kind"], e["site"]): e["count"] for e in summary["top_sites"]}
    assert sites[("duplicate-id", "serve.py:10 in finish")] == 57
    assert sites[("double-free", "serve.py:10 in finish")] == 100
    assert sites[("double-free", "serve.py:20 in abort")] == 1
    assert sites[("double-free", "(occurrences between logged lines, at the call sites above)")] \
        == 100
    assert "between logged lines" in render(summary)


def test_counts_are_exact_with_stats_lines_and_lower_bounds_without(tmp_path):
    with_stats = write(tmp_path / "a.jsonl", [
        record("start"),
        *[record("violation", occurrence=n, guard=GUARD, violation=violation())
          for n in (1, 100, 200)],
        record("stats", guard=GUARD, stats={"alloc_calls": 10, "free_calls": 5,
                                            "share_calls": 0, "learned": 0,
                                            "internal_errors": 0,
                                            "violations": {"double-free": 250}}),
    ])
    summary = summarize(load([with_stats]))
    assert summary["violations"] == 250 and summary["exact"]
    assert summary["by_allocator"]["eng.Pool"]["calls"] == 15
    assert summary["top_sites"][0]["count"] == 250, "the site counts what by_kind counts"

    killed = write(tmp_path / "b.jsonl", [
        record("start", pid=12),
        record("violation", pid=12, occurrence=1, guard=GUARD, violation=violation(pid=12)),
        record("violation", pid=12, occurrence=100, guard=GUARD, violation=violation(pid=12)),
    ])
    summary = summarize(load([with_stats, killed]))
    assert summary["violations"] == 350 and not summary["exact"]
    assert summary["by_kind"]["double-free"] == {
        "count": 350, "processes": 2, "meaning": kinds.MEANING["double-free"]}
    text = render(summary)
    assert text.startswith("kvguard report: at least 350 violation(s) in 2 of 2 process(es)")
    assert "left no stats line" in text


def test_bare_violation_lines_and_junk(tmp_path):
    path = write(tmp_path / "c.jsonl", [violation("bool-id"), {"unrelated": True}])
    with open(path, "a") as f:
        f.write("not json\n\n")
    records = load([path])
    assert len(records.violations) == 1 and records.skipped == 2
    summary = summarize(records)
    assert summary["by_kind"]["bool-id"]["count"] == 1
    assert "2 line(s) skipped: not kvguard records" in render(summary)


def test_a_reused_pid_is_two_processes_and_the_first_report_is_the_earliest(tmp_path):
    path = write(tmp_path / "d.jsonl", [
        record("start", time=1.0),
        record("violation", occurrence=1, guard=GUARD, violation=violation(t=5.0)),
        record("start", time=9.0),
        record("violation", occurrence=1, guard=GUARD,
               violation=violation(t=2.0, site=("other.py", 3, "f"))),
    ])
    summary = summarize(load([path]))
    assert len(summary["processes"]) == 2 and summary["violations"] == 2
    assert summary["first"]["double-free"]["violation"]["time"] == 2.0


def test_learning_and_sampling_are_said(tmp_path):
    learning = {**GUARD, "learning": True, "learned": 7, "sample": 100}
    path = write(tmp_path / "e.jsonl", [
        record("violation", occurrence=1, guard=learning, violation=violation()),
        record("stats", guard=learning, stats={"alloc_calls": 1, "free_calls": 1,
                                               "learned": 7, "violations": {"double-free": 1}}),
    ])
    text = render(summarize(load([path])))
    assert "7 id(s) learned lazily" in text and "attached to 1 allocator(s) that already" in text
    assert "call sites sampled 1 in 100" in text
    assert "note: Pool#1 attached to an allocator with blocks out and had learned 7" in text


def test_collect_files(tmp_path):
    (tmp_path / "sub").mkdir()
    a = write(tmp_path / "a.jsonl", [])
    b = write(tmp_path / "sub" / "b.jsonl", [])
    (tmp_path / "notes.txt").write_text("x")
    assert collect_files([str(tmp_path), a]) == [a, b]
    with pytest.raises(ValueError, match="no such file or directory"):
        collect_files([str(tmp_path / "nope")])


def cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "kvguard", *args], capture_output=True,
                          text=True, timeout=180, cwd=cwd, env=env)


def test_report_exit_status_and_mistakes(tmp_path):
    clean = write(tmp_path / "clean.jsonl", [
        record("stats", guard=GUARD, stats={"alloc_calls": 3, "free_calls": 3,
                                            "violations": {}})])
    out = cli("report", clean)
    assert out.returncode == 0 and "kvguard report: 0 violation(s) in 0 of 1" in out.stdout
    (tmp_path / "empty").mkdir()
    junk = tmp_path / "junk.jsonl"
    junk.write_text("[]\n")
    for args, message in [
        ([str(tmp_path / "nope")], "no such file or directory"),
        ([str(tmp_path / "empty")], "no *.jsonl files in"),
        ([str(junk)], "no kvguard records in 1 file(s)"),
        ([clean, "--format", "yaml"], "invalid choice: 'yaml'"),
        ([], "the following arguments are required"),
    ]:
        out = cli("report", *args)
        assert out.returncode == 2, args
        assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


SERVE = textwrap.dedent('''
    import sys
    from kvguard.examples import LinkedFreeList

    a = LinkedFreeList(8)
    ids = a.allocate(2)
    a.free([ids[0], ids[0]])
    sys.exit(int(sys.argv[1]))
''')


def test_run_sets_up_staging_for_one_command(tmp_path, staged_python):
    (tmp_path / "serve.py").write_text(SERVE)
    env = staged_env()
    out = cli("run", "--log", "logs", "--register",
              "kvguard.examples.LinkedFreeList(size=_num_blocks)", "--sample", "10", "--",
              staged_python, "serve.py", "3", cwd=tmp_path, env=env)
    assert out.returncode == 3, out.stderr  # the command's own exit status
    assert "kvguard: duplicate-id of block 0 on LinkedFreeList#" in out.stderr
    assert "(full report in " in out.stderr and "ERROR: kvguard" not in out.stderr, \
        "one line on stderr, the report in the log"
    assert out.stderr.strip().splitlines()[-1] == (
        "kvguard: 1 violation(s) in 1 guarded process(es); see: kvguard report "
        f"{tmp_path / 'logs'}")
    (name,) = os.listdir(tmp_path / "logs")
    start = json.loads((tmp_path / "logs" / name).read_text().splitlines()[0])
    assert start["config"]["sample"] == 10 and start["config"]["stacks"] == "full"
    assert start["argv"][-2:] == ["serve.py", "3"]


def test_the_default_log_directory_is_ignored_by_git_and_a_named_one_left_alone(
        tmp_path, staged_python):
    """``./kvguard-logs/`` is made with a ``.gitignore`` of its own (as kvguard lint's cache
    is), so a run's logs are not committed by accident; ``kvguard report`` reads it as ever."""
    (tmp_path / "serve.py").write_text(SERVE)
    register = ["--register", "kvguard.examples.LinkedFreeList(size=_num_blocks)"]
    out = cli("run", *register, "--", staged_python, "serve.py", "0", cwd=tmp_path,
              env=staged_env())
    assert out.returncode == 0, out.stderr
    logs = tmp_path / "kvguard-logs"
    assert (logs / ".gitignore").read_text().splitlines() == ["# created by kvguard run", "*"]
    assert "1 violation(s)" in cli("report", str(logs)).stdout
    cli("run", "--log", "logs", *register, "--", staged_python, "serve.py", "0", cwd=tmp_path,
        env=staged_env())
    assert [p.name for p in (tmp_path / "logs").iterdir() if not p.name.endswith(".jsonl")] == []


def test_run_says_when_nothing_was_reported(tmp_path, staged_python):
    out = cli("run", "--log", str(tmp_path / "logs"), "--", staged_python, "-c", "pass",
              cwd=tmp_path, env=staged_env())
    assert out.returncode == 0
    assert "nothing reported under" in out.stderr


@pytest.mark.parametrize("args, message, code", [
    (["run"], "no command given", 2),
    (["run", "--"], "no command given", 2),
    (["run", "--mode", "loud", "--", "x"], "invalid choice: 'loud'", 2),
    (["run", "--sample", "0", "--", "x"], "KVGUARD_SAMPLE='0': expected a whole number >= 1", 2),
    (["run", "--register", "Pool", "--", "x"], "is not a dotted class name", 2),
    (["run", "--", "no-such-program-kvg"], "cannot run 'no-such-program-kvg'", 127),
])
def test_run_mistakes_are_one_line(tmp_path, args, message, code):
    out = cli(*args, cwd=tmp_path, env=staged_env())
    assert out.returncode == code
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_help_lists_the_staging_commands():
    out = cli("--help")
    for name in ("run", "report", "replay"):
        assert f"  {name} " in out.stdout
    assert "KVGUARD_SAMPLE" in cli("run", "--help").stdout


def test_run_passes_sigterm_on_to_the_command(tmp_path, staged_python):
    (tmp_path / "serve.py").write_text(textwrap.dedent('''
        import os, signal, sys, time
        def stop(signum, frame):
            os.write(1, b"got SIGTERM\\n")  # not print(): the signal may land inside one
            sys.exit(5)
        signal.signal(signal.SIGTERM, stop)
        print("ready", flush=True)
        time.sleep(60)
    '''))
    proc = subprocess.Popen([sys.executable, "-m", "kvguard", "run", "--log", "logs", "--",
                             staged_python, "serve.py"], cwd=tmp_path, env=staged_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.terminate()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 5 and out.strip() == "got SIGTERM", err


def test_run_holds_a_signal_that_comes_while_the_command_starts(tmp_path, staged_python):
    # The SIGTERM lands inside Popen, before the command is known: it is held and passed on
    # once the command runs (which dies of it), instead of killing `kvguard run` alone and
    # leaving the command running with nobody to wait for it.
    (tmp_path / "launch.py").write_text(textwrap.dedent(f'''
        import os, signal, subprocess, sys
        from kvguard import cli
        started = subprocess.Popen
        def popen_then_signal(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            return started(*args, **kwargs)
        subprocess.Popen = popen_then_signal
        sys.exit(cli.main(["run", "--log", "logs", "--", {staged_python!r}, "-c",
                           "import time; time.sleep(60)"]))
    '''))
    out = subprocess.run([sys.executable, "launch.py"], cwd=tmp_path, env=staged_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 128 + 15, (out.returncode, out.stderr)
    assert "the command was killed by SIGTERM" in out.stderr


def test_run_leaves_ctrl_c_to_the_command(tmp_path, staged_python):
    # `kvguard run` ignores SIGINT itself (the terminal sends it to the whole group); the
    # command must not inherit that. Started with SIGINT at its default (a shell's background
    # job, CI's for one, starts with it ignored), so the command's own disposition shows.
    probe = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    out = subprocess.run([sys.executable, "-m", "kvguard", "run", "--log", str(tmp_path / "logs"),
                          "--", staged_python, "-c", probe], cwd=tmp_path, env=staged_env(),
                         capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert out.returncode == 0 and out.stdout.splitlines()[0] == "True", out.stderr


def test_run_blames_the_command_when_it_failed_before_reporting(tmp_path, staged_python):
    # A serve.py that dies at start-up (DeepSpeed's pin_memory=True on a CPU-only torch) wrote
    # nothing: the line says the command failed, not that no allocator was registered.
    crash = "raise RuntimeError('Cannot access accelerator device when none is available.')"
    out = cli("run", "--log", str(tmp_path / "logs"), "--", staged_python, "-c", crash,
              cwd=tmp_path, env=staged_env())
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last == (f"kvguard: the command exited with status 1 and reported nothing under "
                    f"{tmp_path / 'logs'}: see its own error output above")
    assert "no registered allocator" not in out.stderr
    killed = cli("run", "--log", str(tmp_path / "logs"), "--", staged_python, "-c",
                 "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                 cwd=tmp_path, env=staged_env())
    assert killed.returncode == 137
    assert "the command was killed by SIGKILL and reported nothing" in killed.stderr
