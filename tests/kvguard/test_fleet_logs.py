"""Staging's files in a fleet: every record the sink writes matches the shipped JSON Schema of
its format version; rotated and compressed files as logrotate leaves them; --since; many hosts;
records of a newer format said so, never misread."""

import copy
import gc
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import kvguard
from kvguard import kinds
from kvguard.staging import records
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)
from kvguard.staging.logfiles import collect_files, parse_since, rotation_set
from kvguard.staging.replay import build
from kvguard.staging import FORMAT_VERSION, JsonLinesSink, StagingConfig
from kvguard.staging.report import render
from kvguard.staging.summary import load, since, summarize

from . import sample_records

jsonschema = pytest.importorskip("jsonschema")


pytestmark = pytest.mark.usefixtures("quiet_kvguard_log")


def strict(schema):
    """The schema with no field beyond those it names (but in ``extra``): the code must not
    write a field the schema does not document."""
    schema = copy.deepcopy(schema)

    def close(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)
    close(schema)
    del schema["additionalProperties"]  # the root only routes to one record type
    for name in ("start", "violation", "stats"):
        # allOf + own properties: the common fields are named again so that each is closed
        node = schema["$defs"][name]
        common = schema["$defs"]["common"]
        node["properties"] = {**common["properties"], **node["properties"]}
        node["required"] = common["required"] + node["required"]
        del node["allOf"]
    return schema


def validator(schema):
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def every_kind_of_record(tmp_path):
    """Run guards into every corner the sink writes: each kind of violation it can report
    without an engine, log and repair modes, sub-pools, shares, learned ids, owners, a sampled
    guard, the flight recorder; then the stats lines. Returns the file's records."""
    torch = pytest.importorskip("torch")
    config = StagingConfig(log=str(tmp_path), register=(("x.Y", None),)).to_dict()
    sink = JsonLinesSink(str(tmp_path / "k-{pid}.jsonl"), every=1, config=config)
    unsubscribe = kvguard.subscribe(sink)
    pool = LinkedFreeList(16)
    g1 = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="repair")
    shared = RefcountedPool(16)
    g2 = kvguard.guard(shared, REFCOUNTED_POOL_SPEC, on_violation="log", stacks="full",
                       sample=3)
    late = LinkedFreeList(16)
    held = late.allocate(4)
    g3 = kvguard.guard(late, LINKED_FREE_LIST_SPEC, on_violation="log", stacks="off",
                       history=0)
    try:
        with kvguard.owner(("req", 7)):
            ids = pool.allocate(4)
        pool.allocate(0)                                  # empty calls: one folded entry
        pool.free([])
        pool.free([ids[0], ids[0]])                       # duplicate-id
        pool.free([ids[0]])                               # double-free
        pool.free([True])                                 # bool-id
        pool.free(torch.tensor([ids[1]]))                 # tensor-id
        pool.free([99])                                   # invalid-id
        pool.free([9])                                    # foreign-id
        pool.free(b for b in [ids[2]])                    # consumed-iterable
        pool.free(["x"])
        g1.check_tables({"a": [ids[3]], "b": [ids[3]], "c": [ids[0]]})  # shared, stale
        with pytest.raises(kvguard.LeakError):
            g1.assert_no_leaks()
        with kvguard.owner(3.5):
            s = shared.allocate(2)
        shared.share(s)
        shared.free(s)
        shared.free(s)
        try:
            shared.free(s)                                # double-free, refcounted
        except ValueError:
            pass
        gone = LinkedFreeList(4)
        sink.track(kvguard.guard(gone, LINKED_FREE_LIST_SPEC))
        gone.allocate(1)
        del gone
        gc.collect()                                      # a stats line as it is collected
        late.free(held[:2])                               # learned
        with pytest.raises(ValueError):
            late.free(held[:1])                           # double-free after learning
    finally:
        unsubscribe()
        sink.close([g1, g2, g3])
    (path,) = tmp_path.glob("k-*.jsonl")
    lines = read(path)
    found = {r["violation"]["kind"] for r in lines if r["event"] == "violation"}
    assert found >= {"duplicate-id", "double-free", "bool-id", "tensor-id", "invalid-id",
                     "foreign-id", "consumed-iterable", "shared-block", "stale-table", "leak"}
    assert [r["event"] for r in lines].count("stats") == 4
    folds = [op for r in lines if r["event"] == "violation" for op in r["violation"]["history"]
             if op["op"] == "empty"]
    assert folds and folds[0]["count"] == 2, "the empty calls are one entry counting two"
    return lines


def test_every_record_the_sink_writes_matches_the_schema_of_its_version(tmp_path):
    lines = every_kind_of_record(tmp_path)
    schema = records.schema()
    assert schema["properties"]["kvguard"]["const"] == FORMAT_VERSION
    loose, tight = validator(schema), validator(strict(schema))
    for record in lines:
        assert record["kvguard"] == FORMAT_VERSION
        loose.validate(record)
        tight.validate(record)  # no field the schema does not document
        assert records.problem(record) is None, "the readers take what the schema allows"
    bare = validator({**schema["$defs"]["violation_report"], "$defs": schema["$defs"]})
    for record in lines:  # format 0: a bare Violation.to_dict()
        if record["event"] == "violation":
            bare.validate(record["violation"])


def test_the_schema_rejects_what_the_readers_reject(tmp_path):
    lines = every_kind_of_record(tmp_path)
    tight = validator(strict(records.schema()))
    violation = next(r for r in lines if r["event"] == "violation")
    for broken in ({**violation, "kvguard": 2}, {**violation, "event": "oops"},
                   {**violation, "occurrence": 0}, {**violation, "pid": "12"},
                   {**violation, "violation": {**violation["violation"], "kind": "nope"}},
                   {**violation, "guard": {**violation["guard"], "sample": 0}},
                   {**violation, "guard": {**violation["guard"], "undocumented": 1}}):
        assert not tight.is_valid(broken)
    stats = next(r for r in lines if r["event"] == "stats")
    assert not tight.is_valid({**stats, "stats": {**stats["stats"], "violations": {"x": 1}}})


def test_schema_and_reader_tables_name_the_same_fields():
    """records.py checks types when reading; the schema documents what is written. They must
    not drift apart: every field one names, the other names."""
    defs = records.schema()["$defs"]
    common = set(defs["common"]["properties"])
    for event in records.EVENTS:
        assert set(records.RECORDS[event]) == common | set(defs[event]["properties"]), event
    pairs = [(records.GUARD, defs["guard"]), (records.STATS, defs["counters"]),
             (records.RAY, defs["ray"]),
             (records.VIOLATION, defs["violation_report"]), (records.FRAME, defs["frame"]),
             (records.ALLOCATOR, defs["violation_report"]["properties"]["allocator"]),
             (records.BLOCK, defs["violation_report"]["properties"]["blocks"]["items"]),
             (records.OPERATION, defs["violation_report"]["properties"]["history"]["items"])]
    for table, node in pairs:
        assert set(table) == set(node["properties"])
    assert defs["kind"]["enum"] == list(kinds.MEANING)


SCHEMA_SHA256 = {1: "5ab0c5c5a34dc614d00f0e797b87a639ba132c24d30d7746eafd40e900903fbd"}
# (two kinds added, stale-free and free-in-flight, and the optional holder fields, ray context,
# checkpoint mark and an operation's count (the empty calls one entry folds): compatible
# changes; readers count a kind they do not know by its name and ignore fields they do not know)
"""Released schemas. Editing one is allowed only for a compatible change (a new optional field,
a clearer description): then update its hash here. An incompatible change (a field removed,
retyped or given another meaning, a new required field) is a new format: add log-v2.json, set
FORMAT_VERSION = 2 in kvguard/records.py, keep reading version 1, and add its hash."""


def test_a_released_schema_is_frozen():
    for version in range(1, FORMAT_VERSION + 1):
        text = json.dumps(records.schema(version), sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()
        assert digest == SCHEMA_SHA256[version], (
            f"log-v{version}.json changed (sha256 {digest}): see SCHEMA_SHA256")
    assert set(records.FORMATS) == set(range(FORMAT_VERSION + 1))


# --- reading ----------------------------------------------------------------------------------

def violation(kind="double-free", **fields):
    """A violation record, stamped late enough for the --since tests."""
    return sample_records.violation(kind, **{"t": 1000.0, **fields})


GUARD = {"name": "Pool#1", "class": "eng.Pool", "address": "0x1", "mode": "log",
         "stacks": "cheap", "sample": 1, "learning": False, "learned": 0, "seeded": 0}


def record(event, pid=11, host="h1", t=1000.0, **fields):
    return {"kvguard": 1, "event": event, "pid": pid, "host": host, "time": t, **fields}


def stats_record(n, pid=11, host="h1", t=2000.0, kind="double-free"):
    return record("stats", pid=pid, host=host, t=t, guard=GUARD, dropped=0, stats={
        "alloc_calls": 10, "free_calls": 5, "share_calls": 0, "blocks_allocated": 10,
        "blocks_freed": 5, "blocks_shared": 0, "learned": 0, "internal_errors": 0,
        "violations": {kind: n}})


def write(path, lines, gz=False):
    data = "".join(json.dumps(r) + "\n" for r in lines)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        path.write_text(data)
    return str(path)


def test_rotation_names_and_order(tmp_path):
    for name in ("kvguard-7.jsonl", "kvguard-7.jsonl.1", "kvguard-7.jsonl.2.gz",
                 "kvguard-7.jsonl-20261130.gz", "kvguard-7.jsonl-20261129", "a.jsonl.gz",
                 "notes.txt", "kvguard-7.jsonl.bak", "x.json"):
        (tmp_path / name).write_text("")
    base = str(tmp_path / "kvguard-7.jsonl")
    assert rotation_set(str(tmp_path / "kvguard-7.jsonl.2.gz")) == (base, 2)
    assert rotation_set("notes.txt") is None
    assert [os.path.basename(f) for f in collect_files([str(tmp_path)])] == [
        "a.jsonl.gz", "kvguard-7.jsonl-20261129", "kvguard-7.jsonl-20261130.gz",
        "kvguard-7.jsonl.2.gz", "kvguard-7.jsonl.1", "kvguard-7.jsonl"]
    given = [str(tmp_path / n) for n in ("kvguard-7.jsonl", "kvguard-7.jsonl.1")]
    assert collect_files(given) == given[::-1], "explicit files: oldest of a set first too"


def test_a_process_rotated_with_copytruncate_is_one_process_with_exact_counts(tmp_path):
    """The sink keeps its O_APPEND descriptor; logrotate copytruncate copies the file aside
    (then compresses the copy) and empties it; the process goes on writing."""
    logs = tmp_path / "logs"
    sink = JsonLinesSink(str(logs / "kvguard-{pid}.jsonl"), every=1)
    unsubscribe = kvguard.subscribe(sink)
    pool = LinkedFreeList(8)
    g = kvguard.guard(pool, LINKED_FREE_LIST_SPEC, on_violation="repair")
    try:
        for round_ in range(3):
            ids = pool.allocate(2)
            pool.free([ids[0], ids[0]])
            pool.free(ids)
            if round_ < 2:  # rotate: .1 becomes .2.gz, the live file becomes .1
                live = sink.path
                if os.path.exists(live + ".1"):
                    with open(live + ".1", "rb") as src, gzip.open(live + ".2.gz", "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    os.remove(live + ".1")
                shutil.copy(live, live + ".1")
                os.truncate(live, 0)
    finally:
        unsubscribe()
        sink.close([g])
    names = sorted(os.listdir(logs))
    assert [n.split(".", 1)[1] for n in names] == ["jsonl", "jsonl.1", "jsonl.2.gz"]
    summary = summarize(load(collect_files([str(logs)])))
    assert len(summary["processes"]) == 1 and summary["exact"]
    assert summary["by_kind"]["duplicate-id"]["count"] == g.stats.violations["duplicate-id"]
    assert summary["by_kind"]["double-free"]["count"] == g.stats.violations["double-free"] == 3
    assert summary["processes"][0]["file"] == sink.path
    # kvguard replay reads the compressed part, where the first reports are
    result = build(str(logs / (os.path.basename(sink.path) + ".2.gz")))
    assert result.reports and result.first_wrong is None


def test_gzip_files_and_a_truncated_one(tmp_path):
    a = write(tmp_path / "a.jsonl.gz", [record("start"), record(
        "violation", occurrence=1, guard=GUARD, violation=violation())], gz=True)
    cut = tmp_path / "b.jsonl.gz"
    write(cut, [record("start", pid=12)] + [record(
        "violation", pid=12, occurrence=n, guard=GUARD, violation=violation(pid=12))
        for n in range(1, 400)], gz=True)
    cut.write_bytes(cut.read_bytes()[:300])  # a compressor still at work
    loaded = load(collect_files([str(tmp_path)]))
    assert [r["file"] for r in loaded.violations][:1] == [a]
    assert any(f == str(cut) and "compressed data ends early" in why
               for f, _line, why in loaded.problems)
    assert "compressed data ends early" in render(summarize(loaded))


def test_many_hosts_merge_per_host_and_per_kind(tmp_path):
    for host, kind, n in (("gpu-a", "double-free", 4), ("gpu-b", "double-free", 2),
                          ("gpu-b", "duplicate-id", 5)):
        d = tmp_path / host
        d.mkdir(exist_ok=True)
        write(d / f"kvguard-11-{kind}.jsonl", [
            record("start", host=host),  # the same pid on every host: still two processes
            record("violation", host=host, occurrence=1, guard=GUARD,
                   violation=violation(kind)),
            stats_record(n, host=host, kind=kind)])
    summary = summarize(load(collect_files([str(tmp_path / "gpu-a"), str(tmp_path / "gpu-b")])))
    assert summary["violations"] == 11 and len(summary["processes"]) == 3
    assert summary["by_host"] == {
        "gpu-a": {"processes": 1, "violations": 4, "by_kind": {"double-free": 4}},
        "gpu-b": {"processes": 2, "violations": 7,
                  "by_kind": {"duplicate-id": 5, "double-free": 2}}}
    text = render(summary)
    assert "(3 file(s), 2 hosts)" in text.splitlines()[0]
    assert "by host:\n  gpu-a        4  in 1 process(es)  double-free 4\n" \
           "  gpu-b        7  in 2 process(es)  duplicate-id 5, double-free 2" in text


def test_since_keeps_recent_records(tmp_path):
    old = write(tmp_path / "old.jsonl", [  # started before the cutoff, still running after it
        record("start", pid=1, t=100.0),
        *[record("violation", pid=1, t=t, occurrence=n, guard=GUARD, violation=violation())
          for n, t in ((1, 110.0), (100, 150.0), (200, 250.0), (300, 260.0))],
        stats_record(320, pid=1, t=300.0)])
    new = write(tmp_path / "new.jsonl", [  # all inside the window: exact from its stats line
        record("start", pid=2, t=210.0),
        record("violation", pid=2, t=220.0, occurrence=1, guard=GUARD, violation=violation()),
        stats_record(7, pid=2, t=230.0)])
    gone = write(tmp_path / "gone.jsonl", [
        record("start", pid=3, t=10.0),
        record("violation", pid=3, t=20.0, occurrence=1, guard=GUARD, violation=violation()),
        stats_record(1, pid=3, t=30.0)])
    everything = load([old, new, gone])
    assert summarize(everything)["violations"] == 320 + 7 + 1
    recent = summarize(since(everything, 200.0))
    assert recent["violations"] == 200 + 7, "pid 1: 300 - 100 logged before; pid 2 exact"
    assert not recent["exact"] and sorted(p["pid"] for p in recent["processes"]) == [1, 2]
    assert "--since: a process that started earlier" in render(recent)
    assert summarize(since(everything, 1000.0))["violations"] == 0


def test_since_forms():
    now = 1_000_000.0
    assert parse_since("2h", now) == now - 7200
    assert parse_since("90s", now) == now - 90
    assert parse_since("1.5d", now) == now - 1.5 * 86400
    assert parse_since("1w", now) == now - 7 * 86400
    assert parse_since("2026-12-01T09:30:00Z") == 1796117400.0
    assert parse_since("2026-12-01T10:30:00+01:00") == 1796117400.0
    assert parse_since("2026-12-01") == time.mktime((2026, 12, 1, 0, 0, 0, 0, 0, -1))
    for bad in ("yesterday", "2h ago", "-3h", ""):
        with pytest.raises(ValueError, match="expected an ISO time"):
            parse_since(bad, now)


def cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "KVGUARD"}
    return subprocess.run([sys.executable, "-m", "kvguard", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


def test_report_cli_since_and_a_newer_format(tmp_path):
    t = time.time()
    path = write(tmp_path / "kvguard-5.jsonl", [
        record("start", pid=5, t=t - 7200),
        record("violation", pid=5, t=t - 7100, occurrence=1, guard=GUARD,
               violation=violation(t=t - 7100)),
        record("violation", pid=5, t=t - 60, occurrence=1, guard=GUARD,
               violation=violation("duplicate-id", t=t - 60)),
        {**record("violation", pid=5, t=t - 30, occurrence=1, guard=GUARD,
                  violation=violation("bool-id", t=t - 30)), "kvguard": 2},
        violation("foreign-id", pid=6, t=t - 20)])  # format 0: a bare Violation.to_dict()
    out = cli("report", str(tmp_path), "--since", "1h", "--format", "json")
    assert out.returncode == 1, out.stderr
    summary = json.loads(out.stdout)
    assert set(summary["by_kind"]) == {"duplicate-id", "foreign-id"}
    assert summary["formats"] == {"0": 1, "1": 3} and summary["newer_formats"] == {"2": 1}
    text = cli("report", path).stdout
    assert ("1 record(s) written by a newer kvguard (format version 2; this one reads up to 1) "
            "were not read: upgrade kvguard to count them") in text
    assert "bool-id" not in text.split("notes:")[0]
    for args, message in ((["--since", "lately"], "--since 'lately': expected an ISO time"),
                          (["--since"], "expected one argument")):
        bad = cli("report", str(tmp_path), *args)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
        assert message in bad.stderr
