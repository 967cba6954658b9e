"""Call sites, captured cheaply on every guarded call and resolved only when a report is drawn.

A site is a short tuple of ``(code object, line)`` pairs interned to a small int, so the ledger
stores 4 bytes per block for "where was this allocated" and "where was it freed". No global
tracer is installed: a capture walks ``frame.f_back`` a few times and does one dict lookup.
File names, function names and source lines are looked up only when a report is rendered.
"""

from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass

_getframe = sys._getframe

DEPTH = {"off": 0, "cheap": 4, "full": 48}
"""Frames kept per site for each ``stacks=`` setting."""

UNKNOWN = 0
"""The site number of "not recorded" (``stacks="off"``, or before the guard was attached)."""

_KVGUARD_DIR = os.path.dirname(os.path.abspath(__file__))
_MACHINERY = frozenset(
    os.path.join(_KVGUARD_DIR, f"{name}.py")
    for name in ("guard", "ids", "ledger", "stacks", "report", "registry", "cache", "tables",
                 "staging")
)


@dataclass(frozen=True)
class Frame:
    """One resolved frame of a report's stack."""

    filename: str
    lineno: int
    function: str

    @property
    def source(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def to_dict(self) -> dict:
        return {"file": self.filename, "line": self.lineno, "function": self.function}

    def __str__(self) -> str:
        return f"{self.filename}:{self.lineno} in {self.function}"


def resolve(pairs) -> list[Frame]:
    """Turn raw ``(code, line)`` pairs into printable frames."""
    return [
        Frame(code.co_filename, line, getattr(code, "co_qualname", code.co_name))
        for code, line in pairs
    ]


def raw_stack(depth: int, limit: int = 64) -> tuple:
    """The ``(code, line)`` pairs of the caller ``depth`` frames up, innermost first."""
    try:
        frame = _getframe(depth + 1)
    except ValueError:
        return ()
    pairs = []
    while frame is not None and len(pairs) < limit:
        pairs.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(pairs)


def is_internal(code) -> bool:
    """True for the guard machinery's own frames, which reports leave out (the example
    allocators and the demo live in kvguard/ too, and their frames do belong in reports)."""
    filename = code.co_filename
    internal = _internal_files.get(filename)
    if internal is None:
        internal = _internal_files[filename] = os.path.abspath(filename) in _MACHINERY
    return internal


_internal_files: dict = {}


class SiteTable:
    """Interns call sites; bounded so a long-running server cannot grow it without limit.

    Keys use ``id(code)`` (cheap to hash; a code object's own hash walks its constants) and the
    table keeps every interned code object alive, so an id can never be reused for another one.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._index: dict[tuple, int] = {}
        self._pairs: list[tuple] = [()]

    def __len__(self) -> int:
        return len(self._pairs) - 1

    def capture(self, depth: int, limit: int) -> int:
        """Intern the stack of the caller ``depth`` frames above the caller of this method."""
        if not limit:
            return UNKNOWN
        top = frame = _getframe(depth + 1)
        key = []
        append = key.append
        for _ in range(limit):
            if frame is None:
                break
            append(id(frame.f_code))
            append(frame.f_lineno)
            frame = frame.f_back
        key = tuple(key)
        site = self._index.get(key)
        if site is None:
            site = self._intern(top, limit, key)
        return site

    def _intern(self, frame, limit: int, key: tuple) -> int:
        pairs = []
        while frame is not None and len(pairs) < limit:
            pairs.append((frame.f_code, frame.f_lineno))
            frame = frame.f_back
        if len(self._pairs) > self.capacity:
            return self._intern_when_full(pairs)
        return self._add(key, tuple(pairs))

    def _add(self, key: tuple, pairs: tuple) -> int:
        site = len(self._pairs)
        self._pairs.append(pairs)
        self._index[key] = site
        return site

    def _intern_when_full(self, pairs: list) -> int:
        """Past capacity keep only the innermost frame, so new sites still name a file:line."""
        code, line = pairs[0]
        key = (id(code), line)
        site = self._index.get(key)
        if site is not None:
            return site
        if len(self._pairs) > 2 * self.capacity:
            return UNKNOWN
        return self._add(key, ((code, line),))

    def pairs(self, site: int) -> tuple:
        return self._pairs[site] if 0 < site < len(self._pairs) else ()

    def frames(self, site: int) -> list[Frame]:
        return resolve(self.pairs(site))


SITES = SiteTable()
"""One table per process: sites repeat across allocators, and reports compare them."""
