"""docs/reference.md cannot drift from the code: its tables of ``guard()`` options,
``AllocatorSpec`` keywords and violation kinds are read back and compared with what
``inspect`` and ``dataclasses`` say, defaults included. Its examples run in test_docs.py."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import kvguard
from kvguard import errors, kinds
from kvguard.guard import Guard

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"
ROW = re.compile(r"^\| `([^`]+)` \|(.*)$", re.M)


def section(title: str) -> str:
    text = REFERENCE.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def table(title: str) -> dict[str, list[str]]:
    """First column (a code span) -> the other cells, for the first table of a section."""
    text = section(title)
    body = text[text.index("\n|"):]
    body = body[:body.find("\n\n")] if "\n\n" in body else body
    rows = {}
    for name, rest in ROW.findall(body):
        rows[name] = [cell.strip() for cell in re.split(r"(?<!\\)\|", rest)[:-1]]
    return rows


def documented_default(cell: str):
    return cell.strip("`") if cell else inspect.Parameter.empty


def test_every_guard_option_is_documented_with_its_default():
    public = inspect.signature(kvguard.guard).parameters
    options = dict(public)
    del options["options"]  # **options: Guard's own keywords, listed one by one
    for name, param in inspect.signature(Guard).parameters.items():
        if param.kind is param.KEYWORD_ONLY:
            options.setdefault(name, param)
    # guard() may pass None for "not asked" (re-guarding compares only what was asked): the
    # default a user gets is then Guard's own.
    effective = inspect.signature(Guard).parameters
    rows = table("`kvguard.guard()`")
    assert list(rows) == list(options), "the option table lists exactly guard()'s parameters"
    for name, param in options.items():
        own = effective.get(name)
        if param.default is None and own is not None and own.default not in (None, own.empty):
            param = own
        default = documented_default(rows[name][0])
        expected = param.default if param.default is param.empty else repr(param.default)
        assert default == expected, f"{name}: documented {default!r}, code has {expected!r}"
    signature = section("`kvguard.guard()`")
    for name in options:
        assert f"{name}" in signature.split("| option |")[0], f"{name} missing from the synopsis"


def test_every_allocator_spec_keyword_is_documented_with_its_default_and_an_example():
    fields = dataclasses.fields(kvguard.AllocatorSpec)
    rows = table("`kvguard.AllocatorSpec`")
    assert list(rows) == [f.name for f in fields], "the keyword table lists exactly the fields"
    for f in fields:
        default, meaning, example = rows[f.name]
        assert default == f"`{f.default!r}`", f"{f.name}: documented {default}, code {f.default!r}"
        assert meaning, f.name
        assert f"AllocatorSpec({f.name}=" in example or f"{f.name}=" in example, (
            f"{f.name}: its example does not use it: {example}")


def test_examples_in_the_keyword_table_are_valid_specs():
    namespace = {"AllocatorSpec": kvguard.AllocatorSpec, "install_wrappers": lambda guard: None}
    for name, (_, _, example) in table("`kvguard.AllocatorSpec`").items():
        for call in re.findall(r"`(AllocatorSpec\(.*?\))`", example):
            spec = eval(call, namespace)  # noqa: S307 -- our own documentation
            assert isinstance(spec, kvguard.AllocatorSpec), call


def test_every_violation_kind_is_documented_with_its_exception():
    rows = table("Violation kinds and exceptions")
    assert list(rows) == list(kinds.ALL), "the kind table lists every kind, in the code's order"
    for kind, (exception, value_error, meaning) in rows.items():
        cls = errors.ERROR_FOR_KIND[kind]
        assert exception == f"`{cls.__name__}`" and getattr(kvguard, cls.__name__) is cls
        assert value_error == ("yes" if issubclass(cls, ValueError) else "no"), kind
        assert meaning, kind


def test_every_public_guard_member_is_documented():
    text = section("`Guard`")
    public = [n for cls in Guard.__mro__[:-1] for n in vars(cls) if not n.startswith("_")]
    assert {"check", "check_tables", "unguard", "wrap_method"} <= set(public)
    missing = [n for n in public if f"`{n}" not in text and f", `{n}" not in text
               and n not in ("guarded", "add_watcher", "remove_watcher", "report")]
    assert missing == [], f"Guard members missing from docs/reference.md: {missing}"
