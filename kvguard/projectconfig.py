"""The project's own kvguard configuration, read by every face that needs allocator specs.

Where a user writes specs once for the whole project: ``[tool.kvguard] allocators`` in
pyproject.toml (a list of entries, one string of them, or a table of tables
``[tool.kvguard.allocators."pkg.mod.Class"]`` with keywords), and the pytest ini option
``kvguard_allocators`` (``[tool.pytest.ini_options]``, pytest.ini, tox.ini, setup.cfg). All of
it is the one spec language (``kvguard.specgrammar``). The pytest plugin, ``kvguard run`` and
``kvguard fuzz`` read it; the nearest file up from the working directory that has any wins.
"""

from __future__ import annotations

import configparser
import os
from dataclasses import dataclass, field

from . import specgrammar

INI_FILES = (("pytest.ini", "pytest"), ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest"))


@dataclass
class ProjectConfig:
    """The allocator entries one project file declares, as text and as specs."""

    path: str
    texts: list = field(default_factory=list)
    """Each entry as the user wrote it (a table-form entry written in the language)."""

    def entries(self) -> list:
        """``[(dotted class name, AllocatorSpec or None), ...]``; a mistake is one
        ``SpecSyntaxError`` line naming the file."""
        out = []
        for text in self.texts:
            try:
                out += specgrammar.parse_entries(text)
            except specgrammar.SpecSyntaxError as exc:
                raise specgrammar.SpecSyntaxError(f"{self.path}: {exc}") from None
        return out

    def spec_for(self, name: str):
        """The spec this file gives class ``name``, or None."""
        return dict(self.entries()).get(name)


def find(start: str | None = None) -> ProjectConfig | None:
    """The nearest project file, from ``start`` (the working directory) up, that declares
    allocators; None when none does."""
    here = os.path.abspath(start or os.getcwd())
    while True:
        found = read_dir(here)
        if found is not None:
            return found
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def read_dir(folder: str) -> ProjectConfig | None:
    pyproject = os.path.join(folder, "pyproject.toml")
    if os.path.isfile(pyproject):
        found = read_pyproject(pyproject)
        if found is not None:
            return found
    for name, section in INI_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            parser = configparser.ConfigParser(interpolation=None)
            try:
                parser.read(path, encoding="utf-8")
            except configparser.Error as exc:
                raise specgrammar.SpecSyntaxError(f"{path}: {exc}") from None
            text = parser.get(section, "kvguard_allocators", fallback=None)
            if text is not None:
                return ProjectConfig(path, ini_lines(text))
    return None


def ini_lines(text: str) -> list:
    """The ini option's lines (a line each, ``#`` comments and blanks dropped)."""
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def read_pyproject(path: str) -> ProjectConfig | None:
    import tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise specgrammar.SpecSyntaxError(f"{path}: {exc}") from None
    tool = data.get("tool", {})
    texts = tool_texts(tool.get("kvguard", {}).get("allocators"), path)
    ini = tool.get("pytest", {}).get("ini_options", {}).get("kvguard_allocators")
    texts += tool_texts(ini, path)
    return ProjectConfig(path, texts) if texts else None


def tool_texts(value, path: str) -> list:
    """Entry texts from a TOML value: a list of strings, one string, or a table of tables."""
    if value is None:
        return []
    if isinstance(value, str):
        return ini_lines(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [v for v in value if v.strip() and not v.strip().startswith("#")]
    if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
        out = []
        for name, table in value.items():
            name, spec = specgrammar.from_table(name, table)
            text, unwritable = specgrammar.format_entry(name, spec)
            out.append(text)
        return out
    raise specgrammar.SpecSyntaxError(
        f"{path}: allocators takes a list of entries (\"pkg.mod.Class(alloc=get, free=put)\"), "
        "or a table of tables [tool.kvguard.allocators.\"pkg.mod.Class\"]")
