"""The run's settings: command-line options over their ini twins over the defaults.

A bad ini value or ``kvguard_allocators`` line stops the run before any test with one line
naming the setting (``pytest.UsageError``), as a bad command-line choice does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

MODES = ("raise", "log")
STACKS = ("off", "cheap", "full")
LEAKS = ("off", "summary", "warn", "fail")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
STYLES = ("short", "full")
"""``--kvguard-report`` values that are a style, not a path (``./short`` is a file)."""

_BOOL_KEYWORDS = ("tensor_ok", "refcounted", "iterator_ok")
_POSITION_KEYWORDS = ("free_arg", "pool_arg")
_OPTIONAL_KEYWORDS = ("alloc", "pool_arg", "share", "id_attr", "refcount_attr", "size",
                      "free_count", "live_ids")


@dataclass
class Settings:
    mode: str = "raise"
    stacks: str = "cheap"
    leaks: str = "summary"
    report: str | None = None
    """Absolute path of the JSON report, or None."""
    style: str = "full"
    """How a failing test shows its violations: ``full`` reports, or ``short`` (SUMMARY lines)."""
    allocators: list = field(default_factory=list)
    """``(dotted class name, AllocatorSpec)`` from ini ``kvguard_allocators``."""

    @classmethod
    def from_config(cls, config: pytest.Config) -> "Settings":
        def pick(option: str, ini: str, choices) -> str:
            value = config.getoption(option)
            if value is None:
                value = (config.getini(ini) or "").strip()
                if value not in choices:
                    raise pytest.UsageError(f"ini {ini} = {value!r}: choose one of "
                                            f"{', '.join(choices)}")
            return value

        given = config.getoption("kvguard_report")
        if given is None:
            given = (config.getini("kvguard_report") or "").split()
        style, report = "full", None
        for value in (v.strip() for v in given):
            if value in STYLES:
                style = value
            elif value and report is not None:
                raise pytest.UsageError(f"--kvguard-report {value}: one JSON report per run "
                                        f"(already {report}); the styles are "
                                        f"{', '.join(STYLES)}")
            elif value:
                report = value
        if report is not None:
            report = os.path.join(str(config.invocation_params.dir), os.path.expanduser(report))
            folder = os.path.dirname(report) or "."
            if not os.path.isdir(folder):
                raise pytest.UsageError(f"--kvguard-report {report}: folder {folder} does not "
                                        "exist")
        return cls(
            mode=pick("kvguard_mode", "kvguard_mode", MODES),
            stacks=pick("kvguard_stacks", "kvguard_stacks", STACKS),
            leaks=pick("kvguard_leaks", "kvguard_leaks", LEAKS),
            report=report,
            style=style,
            allocators=[parse_allocator_line(line) for line in config.getini("kvguard_allocators")
                        if line.strip() and not line.strip().startswith("#")],
        )


def parse_allocator_line(line: str):
    """``package.module:Class size=num_blocks free_count=free_blocks refcounted=true`` ->
    ``("package.module.Class", AllocatorSpec(...))``. Never imports the module."""
    from kvguard import AllocatorSpec

    def bad(why: str) -> pytest.UsageError:
        return pytest.UsageError(f"ini kvguard_allocators line {line.strip()!r}: {why}")

    target, *pairs = line.split()
    module, colon, qualname = target.partition(":")
    parts = module.split(".") + qualname.split(".")
    if not colon or not all(p.isidentifier() for p in parts):
        raise bad("start with the class as 'package.module:Class'")
    keywords = {}
    known = AllocatorSpec.keywords()
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not value:
            raise bad(f"{pair!r} is not key=value")
        if key == "skip":
            raise bad("skip takes a callable: register this class with kvguard.register() in "
                      "a conftest.py instead")
        if key not in known:
            raise bad(f"unknown keyword {key!r} (AllocatorSpec takes "
                      f"{', '.join(k for k in known if k != 'skip')})")
        if key in keywords:
            raise bad(f"{key} given twice")
        keywords[key] = _value(key, value, bad)
    try:
        spec = AllocatorSpec(**keywords)
    except (TypeError, ValueError) as exc:
        raise bad(str(exc)) from None
    return f"{module}.{qualname}", spec


def _value(key: str, text: str, bad):
    lowered = text.lower()
    if key in _BOOL_KEYWORDS:
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise bad(f"{key} takes true or false, not {text!r}")
    if key in _OPTIONAL_KEYWORDS and lowered == "none":
        return None
    if key in _POSITION_KEYWORDS and text.isdigit():
        return int(text)
    return text
