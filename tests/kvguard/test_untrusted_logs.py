"""Staging logs are untrusted input: ``report``, ``replay`` and ``--emit-test`` read them as data.

Found before the fixes: a guard name (or the log file's name) holding ``\"\"\"; code; \"\"\"`` was
pasted into the docstring of the test ``--emit-test`` printed, and ran when pytest collected it;
``replay`` imported whatever module the log's class field named; a ``*.jsonl`` FIFO in a log
directory hung ``kvguard report``; a 1.5 MB ``.jsonl.gz`` inflating to one 1.2 GB line killed
it; ``--since`` with a huge span printed a traceback; a guard name with terminal escapes was
printed raw. CLI runs that could hang run as subprocesses with a timeout.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from kvguard.cli import main

from .test_replay import recorded, seed_bug

pytestmark = pytest.mark.usefixtures("quiet_kvguard_log")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = "kvguard.examples.LINKED_FREE_LIST_SPEC"
PAYLOAD = '"""; __import__("os").system("touch PWNED"); """'


def _kvguard(args, cwd, timeout=120):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "kvguard", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _rewrite(path, change):
    """The log with ``change(record)`` applied to every record."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(change(r)) + "\n" for r in lines))


def _named(record, name):
    if isinstance(record.get("guard"), dict):
        record["guard"]["name"] = name
    return record


def test_an_emitted_test_holds_a_hostile_guard_and_file_name_as_data(tmp_path, capsys):
    path = recorded(tmp_path, seed_bug, name=f"r{PAYLOAD}.jsonl".replace("/", "_"))
    _rewrite(path, lambda r: _named(r, PAYLOAD + "\n\x1b[2Jimport os"))
    code = main(["replay", str(path), "--emit-test", "--trust", "--factory", "cls(8)",
                 "--spec", SPEC])
    test = capsys.readouterr().out
    assert code == 0, test
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        exec(compile(test, "<emitted>", "exec"), namespace)  # what pytest's collection does
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "PWNED").exists(), "the log's name ran as code"
    (func,) = [f for name, f in namespace.items() if name.startswith("test_")]
    assert PAYLOAD[:20] in func.__doc__ and "\x1b" not in func.__doc__


def test_replay_imports_a_class_the_log_names_only_when_told_to(tmp_path, capsys):
    """A module that would leave a mark when imported: without ``--trust`` (and not
    registered) it is not imported, and the refusal says why in one line."""
    (tmp_path / "marking_pool.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('IMPORTED').touch()\n"
        "from kvguard.examples import LinkedFreeList as Pool\n")
    path = recorded(tmp_path, seed_bug)
    _rewrite(path, lambda r: {**r, "guard": {**r["guard"], "class": "marking_pool.Pool"}}
             if isinstance(r.get("guard"), dict) else r)
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["replay", str(path), "--emit-test", "--factory", "cls(8)", "--spec", SPEC])
        err = capsys.readouterr().err
        assert code == 2 and not (tmp_path / "IMPORTED").exists()
        assert err.count("\n") == 1 and "not registered with kvguard" in err and "--trust" in err
        code = main(["replay", str(path), "--emit-test", "--trust", "--factory", "cls(8)",
                     "--spec", SPEC])
        err = capsys.readouterr().err
        assert code == 0 and (tmp_path / "IMPORTED").exists()
        assert "importing marking_pool.Pool, the class the log names (--trust)" in err
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("marking_pool", None)


def test_terminal_escapes_in_a_log_are_printed_escaped(tmp_path, capsys):
    path = recorded(tmp_path, seed_bug)
    evil = "evil\x1b[2J\rkvguard report: 0 violation(s)\u202e"
    _rewrite(path, lambda r: {**r, "guard": {**r["guard"], "class": evil}}
             if isinstance(r.get("guard"), dict) else r)  # printed under "by allocator"
    main(["report", str(path)])
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
    assert "evil\\x1b[2J\\x0dkvguard report" in out
    assert [line for line in out.splitlines() if line.startswith("kvguard report:")] == \
        [out.splitlines()[0]], "a log field forged a report line"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_report_skips_fifos_devices_and_symlinks_out_of_the_directory(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    real = recorded(logs, seed_bug, name="z-real.jsonl")
    os.mkfifo(logs / "a-fifo.jsonl")  # no writer: reading it would block
    os.symlink("/dev/zero", logs / "b-zero.jsonl")
    outside = recorded(tmp_path, seed_bug, name="outside.jsonl")
    os.symlink(outside, logs / "c-out.jsonl")
    done = _kvguard(["report", str(logs)], tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("kvguard report: 4 violation(s) in 1 of 1 process(es)")
    assert sorted(done.stderr.splitlines()) == [
        f"kvguard report: {logs}/a-fifo.jsonl: skipped: not a regular file (a FIFO)",
        f"kvguard report: {logs}/b-zero.jsonl: skipped: a symlink out of the directory "
        "(to /dev/zero)",
        f"kvguard report: {logs}/c-out.jsonl: skipped: a symlink out of the directory "
        f"(to {outside.resolve()})",
    ]
    assert real.exists()


def test_a_line_inflating_past_the_bound_is_skipped_unread(tmp_path):
    """A small .jsonl.gz that inflates to one line far past the bound: skipped and named,
    the rest of the file read (memory stays bounded)."""
    path = recorded(tmp_path, seed_bug)
    good = path.read_bytes()
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb", compresslevel=9) as f:
        chunk = b"x" * (1 << 20)
        for _ in range(64):  # 64 MiB of one line, a few hundred KiB compressed
            f.write(chunk)
        f.write(b"\n")
        f.write(good)  # read after it
    assert os.path.getsize(bomb) < (1 << 20)
    done = _kvguard(["report", str(bomb), "--format", "json"], tmp_path, timeout=300)
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    assert summary["violations"] == 4
    assert any("skipped unread" in s["why"] for s in summary["skipped"]), summary["skipped"]


@pytest.mark.parametrize("since", ["99999999999999999999w", "1e9" + "9" * 400 + "s".lstrip(),
                                   "0001-01-01T00:00"])
def test_since_out_of_range_is_one_clear_line(tmp_path, capsys, since):
    path = recorded(tmp_path, seed_bug)
    code = main(["report", str(path), "--since", since])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("kvguard report: error: --since")
    assert "Traceback" not in err
