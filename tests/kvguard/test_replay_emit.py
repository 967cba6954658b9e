"""``kvguard replay FILE --emit-test``: a staging log's flight recorder becomes a minimal pytest
regression test that replays the calls on the real allocator class and fails before the fix."""

from __future__ import annotations

import pytest

import kvguard
from kvguard.cli import main
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList
from kvguard.staging import JsonLinesSink
from .test_conformance import FixedLinkedFreeList
from .test_replay import outside_every_window, recorded, seed_bug

pytestmark = pytest.mark.usefixtures("quiet_kvguard_log")

SPEC = "kvguard.examples.LINKED_FREE_LIST_SPEC"


def emitted(capsys, path, *extra):
    code = main(["replay", str(path), "--emit-test", "--trust", "--factory", "cls(8)", "--spec",
                 SPEC, *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _run_test(code: str, cls=None) -> None:
    namespace: dict = {}
    if cls is not None:
        code = code.replace("from kvguard.examples import LinkedFreeList",
                            f"from {cls.__module__} import {cls.__name__} as LinkedFreeList")
    exec(compile(code, "<emitted>", "exec"), namespace)
    (test,) = [f for name, f in namespace.items() if name.startswith("test_")]
    test()


def test_the_seed_bug_log_becomes_a_test_that_fails_before_the_fix(tmp_path, capsys):
    code, test, err = emitted(capsys, recorded(tmp_path, seed_bug))
    assert code == 0 and "duplicate-id: 2 of 4 recorded call(s) kept" in err
    assert "a = LinkedFreeList(8)\n    a.allocate(3)" in test
    assert "bad = [0, 0, 1]\n" in test and "a.free(bad)" in test and "r.jsonl" in test
    assert "two owners" in test  # it ends on what the repeat corrupted
    with pytest.raises(AssertionError, match="two owners"):
        _run_test(test)
    _run_test(test, FixedLinkedFreeList)


class RangeCheckedFreeList(LinkedFreeList):
    """DeepSpeed 0.19.8's validation: free() checks the range of each id, nothing else (a
    free of a block never handed out is taken too)."""

    def free(self, blocks) -> None:
        for block in blocks:
            if not 0 <= block < self._num_blocks:
                raise ValueError(f"invalid block {block}")
        for block in blocks:
            self._blocks[block] = self._head
            self._head = block
            self._free_blocks += 1


def test_the_bad_free_no_window_holds_keeps_the_allocation_before_it(tmp_path, capsys):
    """The first report's call is in no recorded window: rebuilt from the report, it keeps
    the hand-out of the blocks it frees, even where the allocator would take the repeat on
    blocks never handed out (shrinking them away would blame the caller, not the allocator)."""
    path = tmp_path / "r.jsonl"
    sink = JsonLinesSink(str(path), every=1)
    unsubscribe = kvguard.subscribe(sink)
    a = RangeCheckedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log", history=8)
    try:
        outside_every_window(a)
    finally:
        unsubscribe()
        sink.close([g])
    code, test, err = emitted(capsys, path)
    assert code == 0 and "duplicate-id: 2 of" in err
    assert "a = RangeCheckedFreeList(8)\n    a.allocate(3)  # returned [0, 1, 2]\n" \
           "    bad = [0, 0]\n" in test
    with pytest.raises(AssertionError, match="two owners"):
        _run_test(test)


def test_calls_the_violation_does_not_need_are_shrunk_away(tmp_path, capsys):
    def script(a):
        for _ in range(5):
            ids = a.allocate(2)
            a.free(ids[::-1])
        held = a.allocate(3)
        a.allocate(1)
        a.free([held[1], held[1]])
    code, test, err = emitted(capsys, recorded(tmp_path, script))
    assert code == 0 and "2 of 13 recorded call(s) kept" in err
    body = test.split('"""')[-1].split("# what that call corrupted")[0]
    assert body.count("a.allocate(") == 1 and body.count("a.free(") == 1


def test_a_caller_bug_a_correct_allocator_rejects_gives_no_test(tmp_path, capsys):
    import kvguard
    from kvguard.examples import LINKED_FREE_LIST_SPEC
    from kvguard.staging import JsonLinesSink
    path = tmp_path / "fixed.jsonl"
    sink = JsonLinesSink(str(path), every=1)
    unsubscribe = kvguard.subscribe(sink)
    a = FixedLinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="log")
    a.allocate(2)
    with pytest.raises(ValueError):
        a.free([0, 0])  # the guard logs it; the fixed allocator itself rejects it
    unsubscribe()
    sink.close([g])
    code, out, err = emitted(capsys, path)
    said, error = err.splitlines()  # that it imports the class the log names, then why not
    assert said.startswith("kvguard replay: importing tests.kvguard.test_conformance.")
    assert code == 2 and out == "" and "break no clause" in error


def test_emit_test_mistakes_are_one_line(tmp_path, capsys):
    path = recorded(tmp_path, seed_bug)
    text = path.read_text().replace("kvguard.examples.LinkedFreeList", "no_such_pkg.Pool")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    code, out, err = emitted(capsys, bad)
    assert code == 2 and "cannot import the allocator class no_such_pkg.Pool" in err
    assert main(["replay", str(path), "--emit-test", "--trust", "--spec", SPEC]) == 2
    assert "no built-in factory" in capsys.readouterr().err
    assert main(["replay", str(path), "--emit-test", "--trust", "--factory", "cls(8)"]) == 2
    assert "size= or free_count=" in capsys.readouterr().err


def test_a_stale_free_gives_no_test_and_says_who_holds_the_blocks(tmp_path, capsys):
    from .test_replay import stale_after_reuse
    code, out, err = emitted(capsys, recorded(tmp_path, stale_after_reuse))
    error = err.splitlines()[-1]
    assert code == 2 and out == ""
    assert ("the guard reported stale-free of blocks [0, 1] (a call for 'req-R'; held by "
            "'req-Q')") in error and "are the engine's to know" in error
