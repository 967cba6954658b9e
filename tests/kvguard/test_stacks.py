"""Call sites: interned once per (owner, place), kept to the configured depth, resolved to the
same frames Python's own traceback shows, and without kvguard's own machinery in reports."""

from __future__ import annotations

import os
import sys
import traceback

import kvguard
from kvguard import demo, examples, ledger, owners, violation
from kvguard.stacks import (
    DEPTH, UNKNOWN, Frame, SiteTable, is_internal, line_of, raw_stack, resolve,
)

KVGUARD_DIR = os.path.dirname(os.path.abspath(kvguard.__file__))


def capture_here(table: SiteTable, depth: int = 0, limit: int = 3, owner: int = 0) -> int:
    return table.capture(depth, limit, owner)


def one_level_up(table: SiteTable, depth: int) -> int:
    return capture_here(table, depth, 48)


def test_depth_per_stacks_setting():
    assert DEPTH == {"off": 0, "cheap": 3, "full": 48}


def captures(table: SiteTable, owners) -> list[int]:
    """One capture per owner, all from one place (the same three frames)."""
    sites = []
    for owner in owners:
        sites.append(capture_here(table, owner=owner))
    return sites


def test_one_place_interns_to_one_site_and_another_owner_or_line_to_another():
    table = SiteTable()
    first, again, other_owner = captures(table, (1, 1, 2))
    assert first == again and len(table) == 2
    other_line = table.capture(0, 3, 1)
    assert len({first, other_owner, other_line}) == 3 and len(table) == 3
    assert table.pairs(first) == table.pairs(other_owner)
    assert (table.owner(first), table.owner(other_owner), table.owner(other_line)) == (1, 2, 1)
    assert table.frames(first)[0].function.endswith("capture_here")
    assert table.frames(other_line)[0].function.endswith(
        "test_one_place_interns_to_one_site_and_another_owner_or_line_to_another")


def test_limit_zero_records_the_owner_alone():
    table = SiteTable()
    assert table.capture(0, 0, 0) == UNKNOWN and len(table) == 0
    site = table.capture(0, 0, 7)
    assert site != UNKNOWN and table.pairs(site) == () and table.owner(site) == 7
    assert table.capture(0, 0, 7) == site and len(table) == 1


def test_depth_skips_frames_and_limit_bounds_them():
    table = SiteTable()
    inner = one_level_up(table, 0)
    outer = one_level_up(table, 1)
    assert table.frames(inner)[0].function.endswith("capture_here")
    assert table.frames(outer)[0].function.endswith("one_level_up")
    functions = [f.function for f in table.frames(inner)]
    assert [f.function for f in table.frames(outer)][:len(functions) - 1] == functions[1:]
    for limit in (1, 2, 3, 5):
        assert len(table.pairs(capture_here(table, limit=limit))) == limit


def test_a_site_resolves_to_the_frames_traceback_shows():
    table = SiteTable()
    site, summaries = table.capture(0, 48), traceback.extract_stack()
    expected = list(reversed(summaries))[:48]
    frames = table.frames(site)
    assert len(frames) == len(expected) > 3
    for frame, summary in zip(frames, expected):
        assert (frame.filename, frame.lineno) == (summary.filename, summary.lineno)
        assert frame.function.split(".")[-1] == summary.name
    assert frames[0].source == "site, summaries = table.capture(0, 48), traceback.extract_stack()"


def test_past_capacity_new_sites_keep_one_frame_then_only_their_owner():
    table = SiteTable(capacity=2)
    sites = captures(table, (1, 2, 3, 4, 5, 1, 4, 0))
    first, second, third, fourth, full = sites[:5]
    assert len(table.pairs(first)) == len(table.pairs(second)) == 3
    assert [len(table.pairs(s)) for s in (third, fourth)] == [1, 1]
    assert table.frames(third)[0].function.endswith("capture_here")
    assert table.pairs(full) == () and table.owner(full) == 5
    # Sites interned before are found again; with no owner and no room, nothing is recorded;
    # a new place of owner 5 is the owner's one site.
    assert sites[5:] == [first, fourth, UNKNOWN]
    assert table.capture(0, 3, 5) == full
    assert table.capture(0, 3, 0) == UNKNOWN
    assert len(table) == 5


def test_unknown_sites_have_no_frames_and_no_owner():
    table = SiteTable()
    assert table.pairs(UNKNOWN) == () and table.frames(UNKNOWN) == []
    assert table.pairs(99) == () and table.owner(99) == 0 and table.owner(-1) == 0


def test_line_of_an_offset_is_the_line_python_reports():
    frame = sys._getframe()
    lasti, line = frame.f_lasti, frame.f_lineno
    assert line_of(frame.f_code, lasti) == line
    assert line_of(frame.f_code, 10**9) == frame.f_code.co_firstlineno


def test_resolve_and_frame_forms():
    code = test_resolve_and_frame_forms.__code__
    (frame,) = resolve([(code, code.co_firstlineno)])
    assert frame == Frame(__file__, code.co_firstlineno, "test_resolve_and_frame_forms")
    assert frame.to_dict() == {"file": __file__, "line": code.co_firstlineno,
                               "function": "test_resolve_and_frame_forms"}
    assert str(frame) == f"{__file__}:{code.co_firstlineno} in test_resolve_and_frame_forms"
    assert frame.source == "def test_resolve_and_frame_forms():"


def test_the_guard_machinery_is_internal_and_user_code_is_not():
    for code in (kvguard.Guard.check.__code__, ledger.Ledger.allocate.__code__,
                 owners.current_owner.__code__, violation.Violation.render.__code__,
                 raw_stack.__code__):
        assert is_internal(code), code.co_filename
    adapter = compile("pass", os.path.join(KVGUARD_DIR, "adapters", "some_engine.py"), "exec")
    assert is_internal(adapter)
    # The example allocators and the demo are user code a report should show.
    for code in (examples.LinkedFreeList.free.__code__, demo.run.__code__,
                 test_the_guard_machinery_is_internal_and_user_code_is_not.__code__):
        assert not is_internal(code), code.co_filename


def machinery_calling_raw_stack(limit: int):
    """Two nested functions whose code claims to live in kvguard/ledger.py: internal frames."""
    namespace = {"raw_stack": raw_stack}
    source = ("def outer(limit):\n    return inner(limit)\n"
              "def inner(limit):\n    return raw_stack(0, limit)\n")
    exec(compile(source, os.path.join(KVGUARD_DIR, "ledger.py"), "exec"), namespace)
    return namespace["outer"](limit)


def test_raw_stack_leaves_internal_frames_out_before_counting():
    here = test_raw_stack_leaves_internal_frames_out_before_counting.__code__
    (only,) = raw_stack_of_user(1)
    assert only[0].co_name == "machinery_calling_raw_stack"
    pairs = raw_stack_of_user(3)
    assert [code.co_name for code, _ in pairs[:2]] == ["machinery_calling_raw_stack",
                                                       "raw_stack_of_user"]
    assert pairs[2][0] is here
    assert not any(is_internal(code) for code, _ in raw_stack_of_user(64))
    assert raw_stack(10**6) == ()  # deeper than the stack: nothing, no error


def raw_stack_of_user(limit: int):
    return machinery_calling_raw_stack(limit)
