"""``kvguard replay``: a report's flight recorder re-run against the model allocator finds where
the allocator's state first went wrong, and never blames a valid history."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.staging.replay import ModelAllocator, Step, build
from kvguard.staging import JsonLinesSink


pytestmark = pytest.mark.usefixtures("quiet_kvguard_log")


def recorded(tmp_path, script, history=32, name="r.jsonl"):
    """Run ``script(allocator)`` on a log-mode guard whose reports go to a JSON-lines file."""
    path = tmp_path / name
    sink = JsonLinesSink(str(path), every=1)
    unsubscribe = kvguard.subscribe(sink)
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log", history=history)
    try:
        script(a)
    finally:
        unsubscribe()
        sink.close([g])
    return path


def seed_bug(a):
    a.allocate(3)                 # call #2
    a.free([0, 0, 1])             # call #3: duplicate-id, forwarded: the list holds 0 twice
    a.allocate(2)                 # call #4: [1, 0]
    a.allocate(2)                 # call #5: [0, -1]: invalid-id, shared-block
    with pytest.raises(ValueError):
        a.free([-5])              # a later report (invalid-id) whose window holds call #5


def test_replay_finds_the_call_that_corrupted_the_allocator(tmp_path):
    result = build(str(recorded(tmp_path, seed_bug)))
    assert [(s.call, s.reported) for s in result.steps] == [
        (2, False), (3, False), (4, False), (5, False), (6, True)]  # #6: free([-5]), reported
    first = result.first_wrong
    assert (first.call, first.op, first.ids) == (3, "free", [0, 0, 1])
    assert first.problems == [("duplicate-id", "free() got block 0 twice in one call: a free "
                               "list now holds each twice")]
    assert [k for k, _ in result.steps[3].problems] == ["invalid-id", "shared-block"]
    assert not result.steps[2].problems, "[1, 0] is a valid hand-out for the model"
    assert [v["kind"] for _, v in result.reports] == [
        "duplicate-id", "invalid-id", "shared-block", "invalid-id"]
    text = result.render()
    assert "state first went wrong at call #3: free [0, 0, 1] at " in text
    assert "test_replay.py" in text.splitlines()[-2]


def test_one_window_alone(tmp_path):
    """Report 1's window holds call #2 only; its own call, #3, is known from the report."""
    path = str(recorded(tmp_path, seed_bug))
    alone = build(path, violation=1)
    assert [(s.call, s.reported) for s in alone.steps] == [(2, False), (3, True)]
    assert (alone.first_wrong.call, alone.first_wrong.problems[0][0]) == (3, "duplicate-id")
    with pytest.raises(ValueError, match="holds 4 report"):
        build(path, violation=9)


def test_a_report_in_raise_mode_is_not_taken_for_a_call_the_allocator_received(tmp_path):
    path = tmp_path / "r.jsonl"
    sink = JsonLinesSink(str(path), every=1)
    unsubscribe = kvguard.subscribe(sink)
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, history=8)
    a.allocate(2)
    with pytest.raises(kvguard.KVGuardError):
        a.free([0, 0])  # rejected before the allocator sees it: no call #3
    unsubscribe()
    sink.close([g])
    result = build(str(path))
    assert [s.call for s in result.steps] == [2] and result.first_wrong is None
    assert "every recorded operation is consistent" in result.render()


def outside_every_window(a):
    """The first report's call is left out of every recorded window (the next report comes
    hundreds of calls later: the log is throttled, the recorder short), and what it corrupted
    shows only there."""
    for _ in range(5):
        a.free(a.allocate(1))              # calls #2..#11
    held = a.allocate(3)                   # #12: [0, 1, 2]
    a.free([held[0], held[0], held[1]])    # #13: duplicate-id, forwarded: 0 is free twice
    for _ in range(300):
        a.free(a.allocate(1))
    a.allocate(2)                          # [1, 0]
    a.allocate(2)                          # [0, -1]: 0 handed out again, shared-block
    with pytest.raises(ValueError):
        a.free([-3])                       # a report whose window holds that hand-out


def test_the_first_bad_call_is_named_when_no_window_holds_it(tmp_path):
    """The report records themselves place a reported call no window holds: the call after
    its report's window. Replay names it (#13), not the later call a window shows (#615)."""
    result = build(str(recorded(tmp_path, outside_every_window, history=8)))
    first = result.first_wrong
    assert (first.call, first.op, first.ids, first.reported) == (13, "free", [0], True)
    assert first.problems[0][0] == "duplicate-id"
    later = [s for s in result.steps if s.problems and not s.reported]
    assert [(s.call, s.op) for s in later] == [(615, "allocate")]  # what the model saw too
    text = result.render()
    assert "the first bad call is #13: free at " in text
    assert "(in no recorded window: known from its report; it names block 0)" in text
    assert json.loads(json.dumps(result.to_dict()))["first_wrong"]["reported"] is True


def test_a_gap_in_the_record_makes_the_model_forget(tmp_path):
    def script(a):
        ids = a.allocate(2)
        with pytest.raises(ValueError):
            a.free([7])  # report 1: window [#2]
        for _ in range(10):
            a.free(a.allocate(1))
        a.free(ids)  # valid, but the model last saw ids handed out before the gap
        with pytest.raises(ValueError):
            a.free([7])  # report 2: window of the last 4 calls
    result = build(str(recorded(tmp_path, script, history=4)))
    gaps = [s for s in result.steps if s.gap_before]
    assert len(gaps) == 1 and gaps[0].gap_before > 0
    assert not [s for s in result.steps if s.problems and not s.reported]
    assert "call(s) not recorded" in result.render()


def test_empty_calls_folded_in_the_record_are_counted_not_taken_for_a_gap(tmp_path):
    """Calls with no ids are one ``empty`` entry counting them; a fold that grew between two
    reports is one step, and the calls it counts are no gap: the model keeps what it knew."""
    def script(a):
        ids = a.allocate(2)                # call #2
        for _ in range(3):
            a.allocate(0)                  # #3..#5
        with pytest.raises(ValueError):
            a.free([7])                    # report 1: window #2, #3..#5
        a.free([])                         # #6..#7: the same fold, grown
        a.free([])
        a.free([ids[0], ids[0]])           # #8: duplicate-id, forwarded
        with pytest.raises(ValueError):
            a.free([7])                    # report 3: window #2, #3..#7, #8
    result = build(str(recorded(tmp_path, script)))
    assert [(s.op, s.call, s.count, s.gap_before) for s in result.steps if not s.reported] == [
        ("allocate", 2, 1, 0), ("empty", 7, 5, 0), ("free", 8, 1, 0)]
    first = result.first_wrong
    assert (first.call, first.op) == (8, "free")
    text = result.render()
    assert "calls #2..#8:" in text and "call(s) not recorded" not in text
    assert "    ... 5 empty call(s) #3..#7 (no ids" in text


def test_the_model_allocator():
    m = ModelAllocator(refcounted_pools={None})
    steps = [Step(2, "allocate", [4, 5]), Step(3, "share", [4]), Step(4, "free", [4, 5]),
             Step(5, "free", [4]), Step(6, "free", [4]), Step(7, "share", [9]),
             Step(8, "free", [9]), Step(9, "allocate", [5, 5])]
    found = [[k for k, _ in m.apply(s)] for s in steps]
    assert found == [[], [], [], [], ["double-free"], [], [], ["shared-block"]]
    plain = ModelAllocator()
    assert [k for k, _ in plain.apply(Step(2, "free", [3, -1]))] == ["invalid-id"]
    assert [k for k, _ in plain.apply(Step(3, "free", [3]))] == ["double-free"]
    assert plain.apply(Step(4, "allocate", [3])) == []


OPS = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(1, 3)), max_size=40)


@settings(max_examples=50, deadline=None)
@given(ops=OPS, bad_at=st.integers(0, 40))
def test_replay_blames_exactly_the_bad_call(tmp_path_factory, ops, bad_at):
    """A valid history replays clean; one duplicated free in it is the first step blamed."""
    expected = []

    def script(a):
        held = a.allocate(1)
        for n, (op, k) in enumerate(ops):
            if n == bad_at and held:
                b = held.pop()
                a.free([b, b])  # forwarded in log mode: the allocator is corrupt from here
                expected.append(a)
                break
            if op == "alloc" and a.free_blocks >= k:
                held += a.allocate(k)
            elif op == "free" and held:
                a.free([held.pop(k % len(held))])
        with pytest.raises(ValueError):
            a.free([-1])  # a report whose window holds everything above

    path = recorded(tmp_path_factory.mktemp("r"), script, history=64)
    result = build(str(path))
    first = result.first_wrong
    recorded_steps = [s for s in result.steps if not s.reported]
    (last,) = [s for s in result.steps if s.reported]  # free([-1]), known from its report
    assert (last.call, last.ids, last.problems[0][0]) == (recorded_steps[-1].call + 1, [-1],
                                                          "invalid-id")
    if expected:
        assert first is not None and first.ids[0] == first.ids[1] and \
            first is recorded_steps[-1]
    else:
        assert first is last


def cli(*args):
    return subprocess.run([sys.executable, "-m", "kvguard", "replay", *args],
                          capture_output=True, text=True, timeout=120)


def test_replay_command(tmp_path):
    path = str(recorded(tmp_path, seed_bug))
    out = cli(path)
    assert out.returncode == 0, out.stderr
    assert "state first went wrong at call #3" in out.stdout
    data = json.loads(cli(path, "--format", "json").stdout)
    assert data["first_wrong"]["call"] == 3 and len(data["steps"]) == 5
    assert data["first_wrong"]["problems"][0]["kind"] == "duplicate-id"


def test_replay_of_a_single_pretty_printed_report(tmp_path):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    a.allocate(2)
    a.free([0, 0])
    a.allocate(1)
    with pytest.raises(ValueError):
        a.free([3])
    (tmp_path / "one.json").write_text(json.dumps(g.violations[-1].to_dict(), indent=2))
    out = cli(str(tmp_path / "one.json"))
    assert out.returncode == 0, out.stderr
    assert "state first went wrong at call #3: free [0, 0]" in out.stdout


@pytest.mark.parametrize("setup, args, message", [
    (None, ["missing.jsonl"], "no such file: missing.jsonl"),
    ("junk", ["f.jsonl"], "no kvguard violation reports in f.jsonl"),
    ("nohistory", ["f.jsonl"], "carry no recorded operations"),
    ("seed", ["f.jsonl", "--violation", "0"], "--violation 0: f.jsonl holds 4 report(s)"),
    ("seed", ["f.jsonl", "--guard", "nobody"], "no report in f.jsonl matches --guard nobody"),
    ("seed", ["f.jsonl", "--format", "xml"], "invalid choice: 'xml'"),
])
def test_replay_mistakes_are_one_line(tmp_path, monkeypatch, setup, args, message):
    monkeypatch.chdir(tmp_path)
    if setup == "junk":
        (tmp_path / "f.jsonl").write_text("not json\n{\"other\": 1}\n")
    elif setup == "nohistory":
        recorded(tmp_path, seed_bug, history=0, name="f.jsonl")
    elif setup == "seed":
        recorded(tmp_path, seed_bug, name="f.jsonl")
    out = cli(*args)
    assert out.returncode == 2
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def stale_after_reuse(a):
    with kvguard.owner("req-R"):
        mine = a.allocate(2)      # call #2
        a.free(mine)              # call #3: R finishes
    with kvguard.owner("req-Q"):
        a.allocate(2)             # call #4: Q is handed the same blocks
    with kvguard.owner("req-R"):
        a.free(mine)              # call #5: a late free on R's behalf (forwarded: log mode)


def test_replay_names_the_holder_of_the_call_and_of_its_blocks(tmp_path):
    result = build(str(recorded(tmp_path, stale_after_reuse)))
    text = result.render()
    assert ("the guard reported on the next free() call: stale-free of blocks [0, 1] "
            "(a call for 'req-R'; held by 'req-Q')") in text
    (report,) = result.to_dict()["reports"]
    assert report["holder"] == "req-R" and set(report["block_holders"].values()) == {"req-Q"}


def test_replay_names_the_steps_in_flight_of_a_free_in_flight(tmp_path):
    def script(a):
        g = kvguard.guard_of(a)
        blocks = a.allocate(2)
        g.begin_step(41, blocks, request="req-R")
        a.free(blocks)
        a.allocate(1)             # handed out again while step 41 is in flight
    result = build(str(recorded(tmp_path, script)))
    assert "free-in-flight of block 1 (in flight in step(s) ['41'])" in result.render()
    assert "41" in str(result.to_dict()["reports"][0]["in_flight_steps"])
