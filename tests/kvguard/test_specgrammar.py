"""The one spec language (kvguard.specgrammar): every spelling gives the same spec, mistakes
are one line, callables are imported only when called, and what it writes it reads back."""

from __future__ import annotations

import sys

import pytest

import kvguard
from kvguard import specgrammar
from kvguard.specgrammar import SpecSyntaxError, format_entry, parse_entries, parse_spec

EXPECTED = kvguard.AllocatorSpec(alloc="get", free="deallocate", free_arg="seq",
                                 free_ids="block_table", size=16, refcounted=True,
                                 reset=("clear", "flush"))


@pytest.mark.parametrize("text", [
    "pkg.mod.Pool(alloc=get, free=deallocate(seq.block_table), size=16, refcounted=true, "
    "reset=[clear, flush])",
    "pkg.mod:Pool alloc=get free=deallocate(seq.block_table) size=16 refcounted=yes "
    "reset=[clear,flush]",
    "pkg.mod.Pool(alloc='get', free=\"deallocate(seq.block_table)\", size=16, refcounted=TRUE,"
    " reset='clear, flush')",
    "pkg.mod.Pool(alloc=get, free=deallocate, free_arg=seq, free_ids=block_table, size=16, "
    "refcounted=true, reset=[clear, flush])",
])
def test_every_spelling_gives_the_same_spec(text):
    assert parse_entries(text) == [("pkg.mod.Pool", EXPECTED)]


def test_entries_split_on_commas_semicolons_and_lines_with_comments():
    text = "a.b.C, d.e:F alloc=x, size=3 ; g.h.I(free=put)  # a comment\n j.k.L"
    names = [name for name, _ in parse_entries(text)]
    assert names == ["a.b.C", "d.e.F", "g.h.I", "j.k.L"]
    assert parse_entries(text)[1][1] == kvguard.AllocatorSpec(alloc="x", size=3)


def test_a_callable_is_imported_at_its_first_call_only():
    (_, spec), = parse_entries("a.b.C(free_count=kvg_lazy_mod_never:count)")
    assert "kvg_lazy_mod_never" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        spec.free_count(object())


def test_what_it_writes_it_reads_back():
    from .shape_classes import SEQ_SPEC
    text, unwritable = format_entry("x.y.Z", SEQ_SPEC)
    assert unwritable == []
    assert parse_entries(text) == [("x.y.Z", SEQ_SPEC)]


@pytest.mark.parametrize("text, message", [
    ("Pool", "is not a dotted class name"),
    ("a.B(sizes=3)", "unknown keyword 'sizes'"),
    ("a.B(refcounted=maybe)", "refcounted takes true or false"),
    ("a.B(free=deallocate(seq.block_table)", "unclosed bracket"),
    ("a.B(skip=f)", "skip takes a callable"),
    ("a.B(alloc_shares=true)", "needs refcounted=True"),
    (",,,", "cannot read"),
])
def test_a_mistake_is_one_clear_line(text, message):
    with pytest.raises(SpecSyntaxError, match=None) as info:
        parse_entries(text)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_keyword_text_alone_is_a_spec():
    assert parse_spec("alloc=get free=put") == kvguard.AllocatorSpec(alloc="get", free="put")
    assert specgrammar.parse_pattern("free(0.pages)") == ("free", 0, "pages")
