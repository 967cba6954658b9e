"""Adversarial staging files: ``kvguard report`` and ``kvguard replay`` never crash on a record
they cannot digest. Every unreadable or ill-typed line is counted and named (file:line), and the
rest of the directory is still summarized. The property test fuzzes every field of every record
type that staging writes (start, violation, stats, and a bare ``Violation.to_dict()``)."""

import json
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.staging.replay import build
from kvguard.staging import JsonLinesSink
from kvguard.staging.report import jsonable, render
from kvguard.staging.summary import load, summarize

from .staging_env import staged_env, staged_python_fixture  # noqa: F401


pytestmark = pytest.mark.usefixtures("quiet_kvguard_log")


def _real_records(tmp_path_factory):
    """The lines a real log-mode guard writes: start, violations with history and blocks,
    stats."""
    path = tmp_path_factory.mktemp("real") / "k.jsonl"
    sink = JsonLinesSink(str(path), every=1)
    unsubscribe = kvguard.subscribe(sink)
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log", history=8)
    try:
        a.allocate(3)
        a.free([0])
        a.free([1, 1])    # duplicate-id, forwarded: the free list now holds 1 twice
        a.allocate(3)     # shared-block, with a block history and a flight recorder
    finally:
        unsubscribe()
        sink.close([g])
        g.unguard()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    events = [r["event"] for r in lines]
    assert events == ["start"] + ["violation"] * (len(events) - 2) + ["stats"], events
    return lines


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return _real_records(tmp_path_factory)


def _write(path, records, raw=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(
        line + "\n" for line in raw))
    return str(path)


def _digest(path):
    """Everything the report and replay commands do with a file, in process."""
    records = load([path])
    summary = summarize(records)
    text = render(summary)
    jsonable(summary)
    try:
        result = build(path)
    except ValueError:
        result = None
    else:
        result.render()
        json.dumps(result.to_dict(), default=repr)
    return records, summary, text


def _paths(value, prefix=()):
    """Every field path in a record: dict keys and list indices, depth first."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for n, v in enumerate(value):
            yield from _paths(v, prefix + (n,))


def _replace(record, path, value, delete=False):
    record = json.loads(json.dumps(record))
    if not path:
        return value
    target = record
    for step in path[:-1]:
        target = target[step]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return record


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: (st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=6)


def test_every_field_path_is_reached(real):
    """The fuzz below draws among these: each record type carries its nested fields."""
    paths = {p for r in real for p in _paths(r)}
    assert ("violation", "history", 0, "site", "line") in paths
    assert ("violation", "blocks", 0, "allocated_at", 0, "file") in paths
    assert ("stats", "violations", "shared-block") in paths
    assert ("guard", "name") in paths and ("argv",) in paths


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzing_any_field_of_any_record_never_crashes_the_readers(real, tmp_path, data):
    records = list(real) + [real[1]["violation"]]  # and a bare Violation.to_dict()
    which = data.draw(st.integers(0, len(records) - 1), label="record")
    paths = list(_paths(records[which]))
    path = data.draw(st.sampled_from(paths), label="path")
    how = data.draw(st.sampled_from(["replace", "delete"]) if path else st.just("replace"))
    value = data.draw(json_values, label="value")
    fuzzed = _replace(records[which], path, value, delete=how == "delete")
    good = [r for n, r in enumerate(real) if n != which]
    file = _write(tmp_path / "f.jsonl", good + [fuzzed])
    read, summary, text = _digest(file)
    kept = len(read.starts) + len(read.violations) + len(read.stats)
    assert kept + read.skipped == len(good) + 1, "every line is either read or skipped"
    for path_, line, why in read.problems:
        assert path_ == file and line == len(good) + 1 and why
        assert f"{file}:{line}: {why}" in text


def test_a_guard_named_with_a_tuple_is_skipped_and_named(real, tmp_path):
    bad = json.loads(json.dumps(real[1]))
    bad["guard"]["name"] = ["Pool", 1]   # what json writes for a tuple
    file = _write(tmp_path / "k.jsonl", [real[0], bad, *real[2:]])
    read, summary, text = _digest(file)
    assert read.skipped == 1 and len(read.violations) == len(real) - 3
    assert read.problems == [(file, 2, "ill-formed violation record: 'guard' 'name' has the "
                                       "wrong type ([\"Pool\", 1])")]
    assert summary["violations"] == len(real) - 2, "the stats line still counts every one"
    assert f"{file}:2: ill-formed violation record" in text


def test_a_deeply_nested_line_costs_only_itself(real, tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    nested = json.loads(json.dumps(real[1]))
    nested["violation"]["extra"] = {"x": json.loads("[" * 50 + "]" * 50)}
    file = _write(tmp_path / "k.jsonl", real, raw=[deep, json.dumps(nested), "{not json"])
    read, summary, text = _digest(file)
    assert len(read.violations) == len(real) - 2 and read.skipped == 3
    whys = [why for _f, _line, why in read.problems]
    assert whys[0] == "nested too deeply to read"
    assert whys[1].startswith("ill-formed violation record: nested deeper than")
    assert whys[2].startswith("not JSON")
    n = len(real)
    assert [line for _f, line, _w in read.problems] == [n + 1, n + 2, n + 3]


def test_an_unreadable_file_is_named_and_the_others_are_read(real, tmp_path):
    good = _write(tmp_path / "a.jsonl", real)
    locked = tmp_path / "b.jsonl"
    locked.mkdir()  # a directory named like a log: open() fails, as for a file without rights
    read = load([good, str(locked)])
    assert len(read.violations) == len(real) - 2
    assert read.problems[0][:2] == (str(locked), 0)
    assert "cannot read the file" in read.problems[0][2]


def cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "kvguard", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


def test_report_and_replay_commands_on_a_bad_directory(real, tmp_path):
    bad = json.loads(json.dumps(real[1]))
    bad["guard"]["name"] = ["Pool", 1]
    (tmp_path / "logs").mkdir()
    _write(tmp_path / "logs" / "k.jsonl", [real[0], bad, *real[2:]], raw=["[" * 100_000])
    out = cli("report", str(tmp_path / "logs"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"kvguard report: {len(real) - 2} violation(s) in 1 of 1 process(es)" in out.stdout
    assert "2 line(s) skipped" in out.stdout and "k.jsonl:2: ill-formed" in out.stdout
    out = cli("replay", str(tmp_path / "logs" / "k.jsonl"))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"kvguard": 1, "event": "stats", "pid": "x"}\n')
    out = cli("report", str(junk))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "1 line(s) skipped; first: " + f"{junk}:1: ill-formed stats record" in out.stderr


SERVE = textwrap.dedent('''
    import sys
    from kvguard.examples import LinkedFreeList

    a = LinkedFreeList(8)
    ids = a.allocate(2)
    a.free([ids[0], ids[0]])
    sys.exit(int(sys.argv[1]))
''')


def test_kvguard_run_counts_its_own_processes_and_exits_with_the_childs_status(
        real, tmp_path, staged_python):
    (tmp_path / "serve.py").write_text(SERVE)
    logs = tmp_path / "logs"
    logs.mkdir()
    bad = json.loads(json.dumps(real[1]))
    bad["guard"]["name"] = ["Pool", 1]
    _write(logs / "kvguard-1.jsonl", [real[0], bad], raw=["[" * 100_000])
    lines = []
    for status in (0, 4, 5):
        out = cli("run", "--log", "logs", "--register", "kvguard.examples.LinkedFreeList", "--",
                  staged_python, "serve.py", str(status), cwd=tmp_path, env=staged_env())
        assert out.returncode == status, out.stderr
        assert "Traceback" not in out.stderr
        lines.append(out.stderr.strip().splitlines()[-1])
    assert all(line.startswith("kvguard: 1 violation(s) in 1 guarded process(es)")
               for line in lines), lines
