"""Call sites, captured cheaply on every guarded call and resolved only when a report is drawn.

A site is a short tuple of ``(code object, line)`` pairs interned to a small int, so the ledger
stores 4 bytes per block for "where was this allocated" and "where was it freed". No global
tracer is installed: a capture walks ``frame.f_back`` a few times and does one dict lookup.
File names, function names and source lines are looked up only when a report is rendered.
"""

from __future__ import annotations

import linecache
import os
import random
import sys
from dataclasses import dataclass

_getframe = sys._getframe

DEPTH = {"off": 0, "cheap": 3, "full": 48}
"""Frames kept per site for each ``stacks=`` setting."""

UNKNOWN = 0
"""The site number of "not recorded" (``stacks="off"``, or before the guard was attached)."""

_KVGUARD_DIR = os.path.dirname(os.path.abspath(__file__))
_MACHINERY = frozenset(
    os.path.join(_KVGUARD_DIR, f"{name}.py")
    for name in ("ids", "ledger", "owners", "stacks", "violation", "registry", "logger", "marks")
)
_MACHINERY_DIRS = tuple(os.path.join(_KVGUARD_DIR, name)
                        for name in ("adapters", "guard", "cache", "staging"))
"""The guard's own package, the engine adapters' wrappers and the cache and staging faces are
machinery too: a report starts at the engine's frame."""


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
    """The ``(code, line)`` pairs of the caller ``depth`` frames up, innermost first, the guard
    machinery's own frames left out before ``limit`` counts, so even ``limit=1`` names the
    user's call."""
    try:
        frame = _getframe(depth + 1)
    except ValueError:
        return ()
    pairs = []
    while frame is not None and len(pairs) < limit:
        if not is_internal(frame.f_code):
            pairs.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(pairs)


def is_internal(code) -> bool:
    """True for the guard machinery's own frames, which reports leave out (the example
    allocators and the demo live in kvguard/ too, and their frames do belong in reports)."""
    filename = code.co_filename
    internal = _internal_files.get(filename)
    if internal is None:
        path = os.path.abspath(filename)
        internal = path in _MACHINERY or os.path.dirname(path) in _MACHINERY_DIRS
        _internal_files[filename] = internal
    return internal


_internal_files: dict = {}


def line_of(code, lasti: int) -> int:
    """The source line of bytecode offset ``lasti`` (what ``frame.f_lineno`` would have said)."""
    for start, end, line in code.co_lines():
        if start <= lasti < end and line is not None:
            return line
    return code.co_firstlineno


class SiteTable:
    """Interns call sites, together with the owner active at the call, to small ints.

    The hot path keys on ``(owner, id(code), f_lasti, ...)``: ``f_lasti`` is a plain int where
    ``f_lineno`` decodes the line table, and ``id(code)`` is cheap to hash where a code object's
    own hash walks its constants. The table keeps every interned code object alive, so an id can
    never be reused for another one. Lines are worked out only when a report asks. Bounded, so a
    long-running server cannot grow it without limit.
    """

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._index: dict[tuple, int] = {(0,): UNKNOWN}
        self._raw: list[tuple] = [()]
        self._owners: list[int] = [0]
        self._lines: dict[int, tuple] = {}

    def __len__(self) -> int:
        return len(self._raw) - 1

    def capture(self, depth: int, limit: int, owner: int = 0) -> int:
        """Intern the caller ``depth`` frames above the caller of this method, ``limit`` frames
        deep, with ``owner`` (an interned owner label). ``limit=0`` records the owner alone."""
        if not limit:
            if not owner:
                return UNKNOWN
            key = (owner,)
        elif limit == 3:
            f = _getframe(depth + 1)
            c1, l1, f = f.f_code, f.f_lasti, f.f_back
            if f is None:
                key = (owner, id(c1), l1)
            else:
                c2, l2, f = f.f_code, f.f_lasti, f.f_back
                if f is None:
                    key = (owner, id(c1), l1, id(c2), l2)
                else:
                    key = (owner, id(c1), l1, id(c2), l2, id(f.f_code), f.f_lasti)
        else:
            f = _getframe(depth + 1)
            parts = [owner]
            append = parts.append
            for _ in range(limit):
                if f is None:
                    break
                append(id(f.f_code))
                append(f.f_lasti)
                f = f.f_back
            key = tuple(parts)
        site = self._index.get(key)
        if site is None:
            site = self._intern(depth + 1, limit, owner, key)
        return site

    def _intern(self, depth: int, limit: int, owner: int, key: tuple) -> int:
        frame = _getframe(depth + 1) if limit else None
        raw = []
        while frame is not None and len(raw) < limit:
            raw.append((frame.f_code, frame.f_lasti))
            frame = frame.f_back
        if len(self._raw) > self.capacity and len(raw) > 1:
            # Past capacity keep only the innermost frame, so new sites still name a file:line.
            raw = raw[:1]
            key = (owner, id(raw[0][0]), raw[0][1])
            site = self._index.get(key)
            if site is not None:
                return site
        if len(self._raw) > 2 * self.capacity:
            # Full: keep the owner alone (owners are few: test ids, bounded request labels), so
            # leak attribution keeps working when the stacks no longer fit.
            if not owner:
                return UNKNOWN
            key, raw = (owner,), []
            site = self._index.get(key)
            if site is not None:
                return site
        site = len(self._raw)
        self._raw.append(tuple(raw))
        self._owners.append(owner)
        self._index[key] = site
        return site

    def pairs(self, site: int) -> tuple:
        """``(code, line)`` pairs of a site, innermost first."""
        if not 0 < site < len(self._raw):
            return ()
        lines = self._lines.get(site)
        if lines is None:
            lines = self._lines[site] = tuple(
                (code, line_of(code, lasti)) for code, lasti in self._raw[site])
        return lines

    def owner(self, site: int) -> int:
        """The interned owner active when the site was captured."""
        return self._owners[site] if 0 <= site < len(self._owners) else 0

    def frames(self, site: int) -> list[Frame]:
        return resolve(self.pairs(site))


SITES = SiteTable()
"""One table per process: sites repeat across allocators, and reports compare them."""


def sampled_capture(every: int):
    """A site capture that keeps the stack of one call in ``every`` and only the owner for the
    rest (``sample=``; staging's ``KVGUARD_SAMPLE``). Calls are drawn at random from a private
    generator, so a periodic workload cannot hide a call site and the program's own ``random``
    sequence is left alone; the ledger and the counters still see every call."""
    draw = random.Random(every).random
    chance = 1.0 / every
    capture = SITES.capture

    def sampled(depth, limit, owner=0):
        if draw() < chance:
            return capture(depth + 1, limit, owner)
        return capture(depth + 1, 0, owner) if owner else 0
    sampled.__kvguard_sample__ = (draw, chance, capture)  # what the compiled wrappers do here
    return sampled
