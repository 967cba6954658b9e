"""Staging in one process: settings from the environment, KVGUARD_REGISTER, the JSON-lines sink
(rate limit, size cap, I/O failure, stats), start()/stop(), sampled stacks and the .pth line."""

import gc
import importlib
import json
import logging
import os
import random
import subprocess
import sys

import pytest

import kvguard
from kvguard import registry, staging
from kvguard._pth import PTH_LINE
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.staging import JsonLinesSink, StagingConfig, config_from_env, parse_register

guard_module = importlib.import_module("kvguard.guard.front")
EXAMPLE = "kvguard.examples.LinkedFreeList"


@pytest.fixture(autouse=True)
def _staging_off():
    yield
    staging.stop()
    registry.unregister(EXAMPLE)


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# --- settings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["", "0", "off", "False", "no", " 0 "])
def test_kvguard_off_values(value):
    assert config_from_env({"KVGUARD": value}) is None
    assert config_from_env({}) is None


def test_defaults_are_for_staging():
    config = config_from_env({"KVGUARD": "1"})
    assert config == StagingConfig()
    assert config.guard_options() == {"on_violation": "log", "stacks": "cheap", "sample": 1,
                                      "history": 32, "log_every": 100}
    assert config.log is None


def test_sampling_defaults_to_full_stacks_unless_told():
    assert config_from_env({"KVGUARD": "1", "KVGUARD_SAMPLE": "100"}).stacks == "full"
    config = config_from_env({"KVGUARD": "1", "KVGUARD_SAMPLE": "100", "KVGUARD_STACKS": "off"})
    assert (config.stacks, config.sample) == ("off", 100)
    config = config_from_env({"KVGUARD": "1", "KVGUARD_MODE": "Repair", "KVGUARD_HISTORY": "0",
                              "KVGUARD_LOG": "/x/{pid}.jsonl", "KVGUARD_LOG_MAX_MB": "2"})
    assert (config.mode, config.history, config.log, config.log_max_bytes) == (
        "repair", 0, "/x/{pid}.jsonl", 2 << 20)


@pytest.mark.parametrize("name, value, message", [
    ("KVGUARD_MODE", "loud", "KVGUARD_MODE='loud': expected one of log, raise, repair"),
    ("KVGUARD_STACKS", "deep", "KVGUARD_STACKS='deep': expected one of off, cheap, full"),
    ("KVGUARD_SAMPLE", "0", "KVGUARD_SAMPLE='0': expected a whole number >= 1"),
    ("KVGUARD_SAMPLE", "1.5", "KVGUARD_SAMPLE='1.5': expected a whole number >= 1"),
    ("KVGUARD_HISTORY", "-1", "KVGUARD_HISTORY='-1': expected a whole number >= 0"),
    ("KVGUARD_LOG_EVERY", "x", "KVGUARD_LOG_EVERY='x'"),
])
def test_bad_settings_name_the_variable(name, value, message):
    with pytest.raises(ValueError) as info:
        config_from_env({"KVGUARD": "1", name: value})
    assert message in str(info.value)


def test_register_forms():
    entries = parse_register(
        f"{EXAMPLE}(size=_num_blocks, free_count=free_blocks, free_arg=0, refcounted=false),"
        " pkg.mod.Pool ; other.mod.Alloc=kvguard.examples:REFCOUNTED_POOL_SPEC")
    assert [name for name, _ in entries] == [EXAMPLE, "pkg.mod.Pool", "other.mod.Alloc"]
    assert entries[0][1] == kvguard.AllocatorSpec(size="_num_blocks", free_count="free_blocks")
    assert entries[1][1] is None
    assert entries[2][1] is kvguard.examples.REFCOUNTED_POOL_SPEC
    assert parse_register("") == [] and parse_register("  ") == []
    (name, spec), = parse_register("a.B(share=touch, refcounted=TRUE, pool_arg=cache_group, "
                                   "size=none)")
    assert (spec.share, spec.refcounted, spec.pool_arg, spec.size) == (
        "touch", True, "cache_group", None)


@pytest.mark.parametrize("text, message", [
    ("Pool", "'Pool' is not a dotted class name"),
    ("a.B(sizes=3)", "unknown keyword 'sizes'"),
    ("a.B(skip=f)", "skip takes a callable: write skip=package.module:function"),
    ("a.B(size)", "expected keyword=value"),
    ("a.B=kvguard.examples:nothing", "has no attribute 'nothing'"),
    ("a.B=kvguard.examples:LinkedFreeList", "is a type, not a kvguard.AllocatorSpec"),
    ("a.B=no_such_module_kvg:SPEC", "No module named 'no_such_module_kvg'"),
    ("a.B(free_arg=-1)", "AllocatorSpec.free_arg must be >= 0, not -1"),
    ("a.B(alloc=7)", "KVGUARD_REGISTER: a.B: AllocatorSpec.alloc must be a method/attribute"),
    ("a.B !", "cannot read"),
])
def test_register_mistakes_are_clear(text, message):
    with pytest.raises(ValueError) as info:
        parse_register(text)
    assert message in str(info.value)


# --- start() / stop() -------------------------------------------------------------------------

def test_start_guards_registered_allocators_in_log_mode(tmp_path, caplog):
    env = {"KVGUARD": "1", "KVGUARD_LOG": str(tmp_path / "kvg-{pid}.jsonl"),
           "KVGUARD_REGISTER": f"{EXAMPLE}(size=_num_blocks, free_count=free_blocks)"}
    assert staging.start(env) and staging.active() is not None
    assert registry.instrumented()
    a = LinkedFreeList(8)
    g = kvguard.guard_of(a)
    assert g is not None and g.mode == "log" and g.spec.size == "_num_blocks"
    ids = a.allocate(3)
    with caplog.at_level(logging.WARNING, logger="kvguard"):
        a.free([ids[0], ids[0]])  # log mode: no exception
    assert "duplicate-id" in caplog.text
    staging.stop()
    assert not registry.instrumented() and staging.active() is None
    path = tmp_path / f"kvg-{os.getpid()}.jsonl"
    records = [r for r in lines(path) if r["event"] != "stats" or r["guard"]["name"] == g.name]
    assert [r["event"] for r in records] == ["start", "violation", "stats"]
    start, violation, stats = records
    assert start["pid"] == os.getpid() and start["config"]["on_violation"] == "log"
    assert violation["violation"]["kind"] == "duplicate-id"
    assert violation["guard"]["class"] == EXAMPLE and violation["occurrence"] == 1
    assert stats["stats"]["alloc_calls"] == 1 and stats["stats"]["violations"] == {
        "duplicate-id": 1}


def test_with_a_log_file_a_logged_violation_is_one_line_on_the_logger(tmp_path, caplog):
    """The full report goes to the JSON lines; the ``kvguard`` logger (stderr, by Python's last
    resort) gets one line naming the kind, the call site and the file. Without a log file it
    gets the whole report, as before; after ``stop()`` too."""
    path = tmp_path / "kvg.jsonl"
    env = {"KVGUARD": "1", "KVGUARD_LOG": str(path), "KVGUARD_REGISTER": EXAMPLE}
    assert staging.start(env)
    a = LinkedFreeList(8)
    ids = a.allocate(3)
    with caplog.at_level(logging.WARNING, logger="kvguard"):
        a.free([ids[0], ids[0]])
    (message,) = [r.getMessage() for r in caplog.records if r.name == "kvguard"]
    assert "\n" not in message and message.startswith("kvguard: duplicate-id of block 0 on ")
    assert "SUMMARY: kvguard: duplicate-id " in message and message.endswith(
        f"(full report in {path})")
    (violation,) = [r for r in lines(path) if r["event"] == "violation"]
    assert violation["violation"]["call_stack"], "the full report is in the file"
    staging.stop()
    caplog.clear()
    b = LinkedFreeList(8)
    kvguard.guard(b, LINKED_FREE_LIST_SPEC, on_violation="log")
    ids = b.allocate(2)
    with caplog.at_level(logging.WARNING, logger="kvguard"):
        b.free([ids[1], ids[1]])
    (message,) = [r.getMessage() for r in caplog.records if r.name == "kvguard"]
    assert message.startswith("==") and "was called here" in message


def test_a_guard_collected_before_exit_writes_its_stats_line_once(tmp_path):
    """A short-lived allocator's guard writes its stats line when it is collected (a weakref
    finalizer), not at exit when it is gone; ``stop()`` writes the living guards' lines and
    none again for the collected one."""
    env = {"KVGUARD": "1", "KVGUARD_LOG": str(tmp_path / "kvg-{pid}.jsonl"),
           "KVGUARD_REGISTER": f"{EXAMPLE}(size=_num_blocks)"}
    gc.collect()  # other tests' guards, gone before this one starts
    early = LinkedFreeList(4)
    early_guard = kvguard.guard(early, LINKED_FREE_LIST_SPEC, on_violation="log")
    assert staging.start(env)
    early.free(early.allocate(1))  # guarded before staging started: tracked too
    a = LinkedFreeList(8)
    name = kvguard.guard_of(a).name
    ids = a.allocate(3)
    a.free(ids[1:])
    a.free([ids[0], ids[0]])  # log mode: recorded, forwarded
    kept = LinkedFreeList(8)
    kept.free(kept.allocate(2))
    path = tmp_path / f"kvg-{os.getpid()}.jsonl"

    kept_name = kvguard.guard_of(kept).name
    ours = {name, early_guard.name, kept_name}

    def stats_lines():
        return {r["guard"]["name"]: r["stats"] for r in lines(path)
                if r["event"] == "stats" and r["guard"]["name"] in ours}

    assert stats_lines() == {}
    del a
    gc.collect()
    assert list(stats_lines()) == [name]
    assert stats_lines()[name]["free_calls"] == 2 and stats_lines()[name]["violations"] == {
        "duplicate-id": 1}
    staging.stop()
    names = [r["guard"]["name"] for r in lines(path) if r["event"] == "stats"]
    assert sorted(n for n in names if n in ours) == sorted(ours)  # each once
    written = len(lines(path))
    del early, kept
    gc.collect()
    assert len(lines(path)) == written  # stopped: nothing more


def test_start_is_once_and_a_bad_setting_leaves_the_process_unguarded(caplog):
    with caplog.at_level(logging.ERROR, logger="kvguard"):
        assert not staging.start({"KVGUARD": "1", "KVGUARD_MODE": "loud"})
        assert not staging.start({"KVGUARD": "1", "KVGUARD_MODE": "loud"})
    assert caplog.text.count("staging not started: KVGUARD_MODE='loud'") == 1
    assert not registry.instrumented() and staging.active() is None
    staging.stop()  # forgets the failure
    assert staging.start({"KVGUARD": "1"})
    assert staging.start({"KVGUARD": "1", "KVGUARD_MODE": "raise"}), "already on: unchanged"
    assert staging.active().config.mode == "log"
    staging.stop()
    assert not staging.start({"KVGUARD": "0"}) and not registry.instrumented()


def test_a_class_in_kvguard_register_without_a_spec_gets_its_builtin_or_the_default():
    ds = "deepspeed.inference.v2.ragged.blocked_allocator.BlockedAllocator"
    assert staging.start({"KVGUARD": "1", "KVGUARD_REGISTER": f"{ds}, {EXAMPLE}"})
    assert registry.registered()[ds].free_arg == "blocks", "the built-in spec is kept"
    assert registry.registered()[EXAMPLE] == kvguard.AllocatorSpec()


# --- the sink ---------------------------------------------------------------------------------

def guarded(n=8, **options):
    a = LinkedFreeList(n)
    return a, kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log", **options)


def test_sink_logs_each_call_site_once_per_n_and_counts_exactly(tmp_path, caplog):
    sink = JsonLinesSink(str(tmp_path / "s-{pid}.jsonl"), every=100)
    unsubscribe = kvguard.subscribe(sink)
    a, g = guarded()
    try:
        with caplog.at_level(logging.CRITICAL, logger="kvguard"):
            for _ in range(250):
                with pytest.raises(ValueError, match="already free"):
                    a.free([5])  # foreign-id, forwarded (log mode): the allocator's own error
    finally:
        unsubscribe()
    sink.close([g])
    records = lines(sink.path)
    occurrences = [r["occurrence"] for r in records if r["event"] == "violation"]
    assert occurrences == [1, 100, 200]
    (stats,) = [r for r in records if r["event"] == "stats"]
    assert stats["stats"]["violations"] == {"foreign-id": 250}


@pytest.mark.parametrize("violation", [False, True])
def test_a_process_lines_begin_with_its_start_in_the_file_and_in_time(tmp_path, monkeypatch,
                                                                       violation):
    """The start line is written when the first line is, and that line is stamped before the
    file is opened: the start line's time must not be later than it (sorted by time, as a
    log store shows them, a stats line came before its process's start)."""
    from kvguard.staging import sink as sink_module
    ticks = iter(float(n) for n in range(1000, 2000))
    monkeypatch.setattr(sink_module.time, "time", lambda: next(ticks))
    sink = JsonLinesSink(str(tmp_path / "k.jsonl"), every=1)
    unsubscribe = kvguard.subscribe(sink)
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    a.free(a.allocate(2))
    if violation:
        with pytest.raises(ValueError):
            a.free([0])
    unsubscribe()
    sink.close([g])
    records = lines(tmp_path / "k.jsonl")
    assert [r["event"] for r in records] == ["start"] + ["violation"] * violation + ["stats"]
    times = [r["time"] for r in records]
    assert times == sorted(times)


def test_sink_stops_at_its_size_cap_and_still_writes_stats(tmp_path):
    sink = JsonLinesSink(str(tmp_path / "cap.jsonl"), every=1, max_bytes=1)
    unsubscribe = kvguard.subscribe(sink)
    a, g = guarded()
    try:
        for b in (5, 6, 7):
            with pytest.raises(ValueError):
                a.free([b])  # foreign-id; the allocator refuses it itself
    finally:
        unsubscribe()
    sink.close([g])
    records = lines(tmp_path / "cap.jsonl")
    assert [r["event"] for r in records] == ["start", "violation", "stats"]
    assert records[-1]["dropped"] == 2 and records[-1]["stats"]["violations"] == {"foreign-id": 3}


def test_sink_io_failure_is_logged_once_and_never_reaches_the_caller(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sink = JsonLinesSink(str(blocker / "sub" / "x-{pid}.jsonl"))
    unsubscribe = kvguard.subscribe(sink)
    a, g = guarded()
    try:
        with caplog.at_level(logging.ERROR, logger="kvguard"):
            for b in (5, 6):
                with pytest.raises(ValueError):
                    a.free([b])
            ids = a.allocate(2)
            a.free(ids)
    finally:
        unsubscribe()
    assert caplog.text.count("cannot write violation reports") == 1
    assert g.stats.violations["foreign-id"] == 2 and g.stats.internal_errors == 0
    assert a.free_blocks == 8 and sink.failed
    sink.close([g])  # still quiet


def test_log_path_forms(tmp_path):
    pid = os.getpid()
    assert staging.log_path(str(tmp_path)) == str(tmp_path / f"kvguard-{pid}.jsonl")
    assert staging.log_path("/x/new/") == f"/x/new/kvguard-{pid}.jsonl"
    assert staging.log_path("/x/{pid}-{pid}.jsonl", pid=7) == "/x/7-7.jsonl"
    assert staging.log_path("/x/all.jsonl") == "/x/all.jsonl"
    assert "{host}" not in staging.log_path("/x/{host}.jsonl")


def test_a_log_setting_names_a_directory_the_same_way_for_the_environment_and_kvguard_run(
        tmp_path, monkeypatch):
    """``KVGUARD_LOG=logs`` and ``kvguard run --log logs`` both make a directory of files;
    ``logs.jsonl`` is one file for both (``logs`` was one file here and a directory there)."""
    pid = os.getpid()
    assert staging.log_path("/x/logs") == f"/x/logs/kvguard-{pid}.jsonl"
    assert staging.log_path("/x/all.log") == "/x/all.log"
    assert staging.log_path("/x/{pid}", pid=7) == "/x/7"
    monkeypatch.chdir(tmp_path)
    seen = {}
    for given in ("logs", "all.jsonl", "all.log", "runs/{pid}.jsonl", "made/"):
        script = tmp_path / "show.py"
        script.write_text("import os, sys\nprint(os.environ['KVGUARD_LOG'])\n")
        out = subprocess.run([sys.executable, "-m", "kvguard", "run", "--log", given, "--",
                              sys.executable, str(script)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "KVGUARD": "0"})
        assert out.returncode == 0, out.stderr
        seen[given] = out.stdout.strip()
    assert seen["logs"] == str(tmp_path / "logs" / "kvguard-{pid}.jsonl")
    assert seen["all.jsonl"] == str(tmp_path / "all.jsonl")
    assert seen["all.log"] == str(tmp_path / "all.log")
    assert seen["runs/{pid}.jsonl"] == str(tmp_path / "runs" / "{pid}.jsonl")
    assert seen["made/"] == str(tmp_path / "made" / "kvguard-{pid}.jsonl")
    for given, used in seen.items():  # what one process of the run writes to, either way
        assert str(tmp_path / staging.log_path(given, pid=1)) == used.replace("{pid}", "1")


def test_stats_lines_say_when_ids_were_learned(tmp_path):
    a = LinkedFreeList(8)
    early = a.allocate(3)  # blocks out before the guard comes
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    assert g._learn
    sink = JsonLinesSink(str(tmp_path / "l.jsonl"))
    unsubscribe = kvguard.subscribe(sink)
    try:
        a.free(early[:2])  # learned, no false alarm
        with pytest.raises(ValueError, match="already free"):
            a.free(early[:1])  # a true double free of a learned id (the allocator refuses it)
    finally:
        unsubscribe()
    sink.close([g])
    records = lines(tmp_path / "l.jsonl")
    (violation,) = [r for r in records if r["event"] == "violation"]
    assert violation["violation"]["kind"] == "double-free"
    assert violation["guard"]["learning"] and violation["guard"]["learned"] == 2
    (stats,) = [r for r in records if r["event"] == "stats"]
    assert stats["guard"]["learned"] == 2 and stats["stats"]["learned"] == 2


# --- sampled stacks (the core hook behind KVGUARD_SAMPLE) ---------------------------------------

def test_without_sampling_the_hot_path_keeps_the_plain_capture():
    a, g = guarded()
    assert g.sample == 1 and g._capture is guard_module._capture


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "10"])
def test_sample_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="sample must be an int >= 1"):
        kvguard.guard(LinkedFreeList(2), LINKED_FREE_LIST_SPEC, sample=bad)


def test_sampling_keeps_one_stack_in_n_and_checks_every_call():
    state = random.getstate()
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log", stacks="full", sample=20)
    with_stack = 0
    for _ in range(2000):
        (b,) = a.allocate(1)
        with_stack += bool(g.ledger().block(b).allocated_at)
        a.free([b])
    assert random.getstate() == state, "the program's own random sequence is untouched"
    assert 40 <= with_stack <= 200, with_stack  # ~100 expected; the draw is seeded
    assert (g.stats.alloc_calls, g.stats.free_calls) == (2000, 2000)
    with pytest.raises(ValueError, match="already free"):
        a.free([b])  # a double free on an unsampled call: caught, with this call's own stack
    (v,) = g.violations
    assert v.kind == "double-free" and "test_staging.py" in v.summary()


def test_sampling_still_records_the_owner():
    a = LinkedFreeList(64)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, stacks="cheap", sample=1000)
    with kvguard.owner("req-1"):
        ids = a.allocate(1) + a.allocate(1) + a.allocate(1)
    assert {g.live[b].owner for b in ids} == {"req-1"}
    with pytest.raises(kvguard.LeakError):
        g.assert_no_leaks(owner="req-1")


# --- the start-up hook ------------------------------------------------------------------------

@pytest.mark.parametrize("value, starts", [
    (None, False), ("", False), ("0", False), ("off", False), ("FALSE", False), ("no", False),
    ("1", True), ("yes", True),
])
def test_pth_line_starts_staging_only_when_asked(monkeypatch, value, starts):
    calls = []
    monkeypatch.setattr(staging, "start", lambda environ=None: calls.append(1))
    if value is None:
        monkeypatch.delenv("KVGUARD", raising=False)
    else:
        monkeypatch.setenv("KVGUARD", value)
    exec(PTH_LINE, {})
    assert calls == ([1] if starts else [])
    assert staging.enabled({"KVGUARD": value} if value is not None else {}) == starts


def test_pth_line_is_one_import_line():
    assert PTH_LINE.startswith("import ") and PTH_LINE.count("\n") == 1
    assert PTH_LINE.endswith("\n")
