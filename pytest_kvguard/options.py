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

STYLES = ("short", "full")
"""``--kvguard-report`` values that are a style, not a path (``./short`` is a file)."""


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
            allocators=project_allocators(config.rootpath) + [
                parse_allocator_line(line) for line in config.getini("kvguard_allocators")
                if line.strip() and not line.strip().startswith("#")],
        )


def parse_allocator_line(line: str):
    """One ``kvguard_allocators`` line, in the one spec language (``kvguard.specgrammar``):
    ``package.module:Class size=num_blocks refcounted=true`` (the ini's own spelling) or
    ``package.module.Class(size=num_blocks, refcounted=true)`` -> ``(dotted class name,
    AllocatorSpec)``. Never imports the module."""
    from kvguard import AllocatorSpec
    from kvguard.specgrammar import SpecSyntaxError, parse_entries

    try:
        entries = parse_entries(line)
    except SpecSyntaxError as exc:
        raise pytest.UsageError(f"ini kvguard_allocators line {line.strip()!r}: {exc}") from None
    if len(entries) != 1:
        raise pytest.UsageError(f"ini kvguard_allocators line {line.strip()!r}: one class per "
                                "line")
    name, spec = entries[0]
    return name, spec if spec is not None else AllocatorSpec()


def project_allocators(rootpath) -> list:
    """``[tool.kvguard] allocators`` of the run's pyproject.toml (the ini option is read by
    pytest itself): ``(dotted class name, AllocatorSpec)`` pairs."""
    from kvguard import AllocatorSpec
    from kvguard.projectconfig import tool_texts
    from kvguard.specgrammar import SpecSyntaxError, parse_entries

    path = os.path.join(str(rootpath), "pyproject.toml")
    if not os.path.isfile(path):
        return []
    import tomllib
    try:
        with open(path, "rb") as f:
            value = tomllib.load(f).get("tool", {}).get("kvguard", {}).get("allocators")
        entries = [e for text in tool_texts(value, path) for e in parse_entries(text)]
    except (SpecSyntaxError, tomllib.TOMLDecodeError) as exc:
        raise pytest.UsageError(f"[tool.kvguard] allocators: {exc}") from None
    return [(name, spec if spec is not None else AllocatorSpec()) for name, spec in entries]
