"""The violation model on its own: the AddressSanitizer-style text, the SUMMARY line a script
greps, the JSON form and its way back, and how many blocks a report details."""

from __future__ import annotations

import json

import pytest

import kvguard
from kvguard import ledger
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.stacks import Frame
from kvguard.violation import MAX_BLOCKS_DETAILED, BlockHistory, Operation, Violation

CALL = [Frame("/srv/engine/sched.py", 40, "Scheduler.finish"),
        Frame("/srv/engine/loop.py", 12, "step")]
FREED = [Frame("/srv/engine/sched.py", 31, "Scheduler.preempt")]
ALLOCATED = [Frame("/srv/engine/sched.py", 22, "Scheduler.admit")]


def double_free(**changes) -> Violation:
    fields = dict(
        kind="double-free", block_ids=(5,), message="free() got block 5, already free",
        allocator="eng.BlockPool", allocator_name="BlockPool#1", allocator_address="0x7f00",
        method="free", pool="gpu", call_stack=CALL,
        blocks=[BlockHistory(5, "free", 0, "req-7", 9, ALLOCATED, FREED)],
        owner="req-9", history=[Operation("allocate", (5, 6), ALLOCATED, "gpu", 3),
                                Operation("free", (5,), FREED, "gpu", 9)],
        thread="MainThread", pid=4242, time=1.5,
    )
    return Violation(**{**fields, **changes})


def test_render_reads_like_an_asan_report():
    assert double_free().render().splitlines() == [
        "==4242==ERROR: kvguard: double-free of block 5 on BlockPool#1 in pool 'gpu' "
        "(eng.BlockPool at 0x7f00)",
        "free() got block 5, already free",
        "free() was called here (thread 'MainThread'):",
        "    #0 Scheduler.finish /srv/engine/sched.py:40",
        "    #1 step /srv/engine/loop.py:12",
        "",
        "block 5 was freed here by call #9:",
        "    #0 Scheduler.preempt /srv/engine/sched.py:31",
        "",
        "block 5 was last allocated here (free, owner 'req-7'):",
        "    #0 Scheduler.admit /srv/engine/sched.py:22",
        "",
        "last operations on this allocator, oldest first:",
        "    #3 allocate [5, 6]  at /srv/engine/sched.py:22 in Scheduler.admit",
        "    #9 free [5]  at /srv/engine/sched.py:31 in Scheduler.preempt",
        "",
        "SUMMARY: kvguard: double-free /srv/engine/sched.py:40 in Scheduler.finish",
    ]
    assert str(double_free()) == double_free().render()


def test_a_live_block_shows_its_last_free_before_the_allocation():
    block = BlockHistory(5, "live", 1, None, 12, ALLOCATED, FREED)
    text = double_free(kind="write-after-free", blocks=[block], history=[]).render()
    assert ("block 5 was last freed here before it was handed out again:\n"
            "    #0 Scheduler.preempt /srv/engine/sched.py:31\n\n"
            "block 5 was allocated here by call #12 (live):\n") in text
    assert "last operations" not in text


def test_the_summary_line_names_the_first_user_frame():
    assert double_free().summary() == (
        "SUMMARY: kvguard: double-free /srv/engine/sched.py:40 in Scheduler.finish")
    internal = (ledger.Ledger.release.__code__, 200)
    user = (test_the_summary_line_names_the_first_user_frame.__code__, 77)
    v = double_free(call_stack=[internal, user])
    assert v.summary() == f"SUMMARY: kvguard: double-free {__file__}:77 in " \
                          "test_the_summary_line_names_the_first_user_frame"
    assert [f["function"] for f in v.to_dict()["call_stack"]] == [
        "test_the_summary_line_names_the_first_user_frame"]
    assert double_free(call_stack=()).summary() == "SUMMARY: kvguard: double-free"
    assert "    <no stack recorded: stacks='off'>" in double_free(call_stack=()).render()


def test_headline_lists_ids_up_to_sixteen():
    assert "of blocks [1, 2, 3] on" in double_free(block_ids=(1, 2, 3)).headline()
    many = double_free(block_ids=tuple(range(20)), pool=None).headline()
    assert "of blocks [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ... (20 in all)]" \
        " on BlockPool#1 (eng.BlockPool at 0x7f00)" in many
    assert double_free(kind="inconsistent", block_ids=()).headline() == (
        "inconsistent on BlockPool#1 in pool 'gpu' (eng.BlockPool at 0x7f00)")


def test_only_the_first_blocks_are_detailed_but_all_are_kept():
    blocks = [BlockHistory(b, "free", 0, None, b, ALLOCATED, FREED) for b in range(10)]
    v = double_free(block_ids=tuple(range(10)), blocks=blocks)
    text = v.render()
    detailed = [b for b in range(10) if f"block {b} was freed here" in text]
    assert detailed == list(range(MAX_BLOCKS_DETAILED))
    assert f"blocks [{', '.join(map(str, range(10)))}]" in text.splitlines()[0]
    assert [b["id"] for b in v.to_dict()["blocks"]] == list(range(10))


def test_to_dict_is_json_and_from_dict_gives_the_same_report_back():
    v = double_free(extra={"learned": 2, "handle": object()}, owner=("tuple", "label"))
    d = v.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["summary"] == v.summary() and d["allocator"] == {
        "class": "eng.BlockPool", "name": "BlockPool#1", "address": "0x7f00"}
    assert d["owner"] == "('tuple', 'label')" and d["extra"]["handle"].startswith("<object")
    assert d["blocks"][0] == {"id": 5, "state": "free", "refcount": 0, "owner": "req-7", "holder": None,
                              "last_call": 9, "allocated_at": [ALLOCATED[0].to_dict()],
                              "freed_at": [FREED[0].to_dict()]}
    assert d["history"][0] == {"op": "allocate", "ids": [5, 6], "pool": "gpu", "call": 3,
                               "site": ALLOCATED[0].to_dict()}
    again = Violation.from_dict(json.loads(json.dumps(d)))
    assert again.to_dict() == d
    text = v.render()
    assert again.render() == text
    assert "note: the guard attached while blocks were out; 2 id(s) were taken as live" in text


def test_a_fold_of_empty_calls_renders_as_a_count_and_survives_the_round_trip():
    v = double_free(history=[Operation("allocate", (5,), ALLOCATED, "gpu", 3),
                             Operation("empty", (), (), None, 60, count=57),
                             Operation("empty", (), (), None, 62, count=1),
                             Operation("free", (5,), FREED, "gpu", 63)])
    d = v.to_dict()
    assert d["history"][1] == {"op": "empty", "ids": [], "pool": None, "call": 60, "site": None,
                               "count": 57}
    assert "count" not in d["history"][0]
    assert Violation.from_dict(json.loads(json.dumps(d))).to_dict() == d
    assert "    #3 allocate [5]  at /srv/engine/sched.py:22 in Scheduler.admit\n" \
           "    ... 57 empty calls (#4..#60) ...\n    ... 1 empty call (#62) ...\n" \
           "    #63 free [5]  at " in v.render()


def test_a_real_guards_violation_survives_the_round_trip():
    pool = LinkedFreeList(8)
    kvguard.guard(pool, LINKED_FREE_LIST_SPEC)
    ids = pool.allocate(2)
    pool.free(ids)
    with pytest.raises(kvguard.DoubleFreeError) as info:
        pool.free([ids[1]])
    v = info.value.violation
    again = Violation.from_dict(json.loads(json.dumps(v.to_dict())))
    assert again.render() == v.render()
    assert again.summary().endswith(
        "in test_a_real_guards_violation_survives_the_round_trip")
    assert again.blocks[0].state == "free" and again.blocks[0].freed_at[0].lineno > 0


def test_from_dict_refuses_what_is_not_a_violation():
    with pytest.raises(ValueError, match="not a kvguard violation: kind 'segfault'"):
        Violation.from_dict({"kind": "segfault"})
    with pytest.raises(ValueError, match="kind None"):
        Violation.from_dict({"event": "stats"})


def test_a_call_with_several_faults_raises_the_first_and_carries_the_others():
    import kvguard
    from kvguard.examples import LinkedFreeList
    pool = LinkedFreeList(8)
    g = kvguard.guard(pool)
    pool.allocate(3)
    with pytest.raises(kvguard.BoolIdError) as info:
        pool.free([0, 0, 7, True])
    assert [v.kind for v in g.violations] == ["bool-id", "duplicate-id", "foreign-id"]
    assert info.value.violation is g.violations[0]
    assert list(info.value.others) == g.violations[1:]
    assert pool.free_blocks == 5, "nothing was freed"
