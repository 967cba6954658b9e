"""What escaped the fuzzer: the ``Escape`` a report shows, and how one is told from the
stack (which of the frames is the allocator's, whether a ``KeyboardInterrupt`` was the
allocator's ``raise`` or the user's Ctrl-C). ``contain`` runs the code; this module names what
it did."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_KVGUARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NOT_OURS = {os.path.join(_KVGUARD, "examples.py"),
             os.path.join(_KVGUARD, "conformance", "lifecycle_example.py")}
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_CONTAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "contain.py")


class Interrupted(BaseException):
    """Raised by the containment's timer into the running block (``reason``: ``hang``,
    ``deadline`` or ``fork``). A BaseException, so the allocator's ``except Exception``
    cannot swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class UserInterrupt(KeyboardInterrupt):
    """The user's Ctrl-C, raised on: ``report`` holds what finished when there is one."""

    report = None


@dataclass
class Escape:
    """What the allocator did to the process, contained: a finding of its own."""

    kind: str
    """``hang``, ``exit``, ``interrupt``, ``generator-exit``, ``base-exception`` or ``fork``."""
    where: str
    """The allocator's method (``free()``), or ``its factory (Pool.__init__())``."""
    text: str
    """One line: ``the allocator exited the process (SystemExit(0)) in free()``."""
    seconds: float = 0.0
    clauses: list = field(default_factory=list)
    """The clauses (or searches) it stopped."""
    calls: list = field(default_factory=list)
    """The calls of the sequence it stopped, the last one escaping (not shrunk)."""
    test: str = ""
    test_note: str = ""
    """Why there is no test, or how the one shown stops itself."""
    run: object = None
    owner: object = None
    """The class whose method escaped, when the stack shows it (an escape in a factory)."""

    def render(self) -> str:
        lines = [f"  {self.text}"]
        if self.clauses:
            lines.append(f"    stopped: {', '.join(self.clauses)}")
        if self.calls:
            lines.append("    calls (as run, not shrunk):")
            lines += [f"      {c}" for c in self.calls]
        if self.test:
            lines.append(f"    regression test ({self.test_note}):")
            lines += [f"      {line}" if line else "" for line in self.test.splitlines()]
        elif self.test_note:
            lines.append(f"    regression test: none ({self.test_note})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "where": self.where, "text": self.text,
                "seconds": round(self.seconds, 3), "clauses": list(self.clauses),
                "calls": list(self.calls), "test": self.test, "test_note": self.test_note}


def merge(escapes: list) -> list:
    """One escape per kind and place: the same hang met by five clauses is one finding."""
    out: dict = {}
    for e in escapes:
        head = out.setdefault((e.kind, e.where), e)
        if head is not e:
            head.clauses += [c for c in e.clauses if c not in head.clauses]
            if not head.test and (e.test or e.calls and not head.calls):
                head.test, head.test_note, head.calls = e.test, e.test_note, e.calls
    return list(out.values())


# --- the running block -------------------------------------------------------------------------

USER = {"interrupted": False}
"""Set by kvguard's SIGINT handler while a contained block runs: the user pressed Ctrl-C."""


def _ours(filename: str) -> bool:
    if filename.startswith(_KVGUARD):
        return filename not in _NOT_OURS
    if filename.startswith("<") or "hypothesis" in filename.split(os.sep):
        return True
    return filename.startswith(_STDLIB) and "-packages" not in filename


def where(frames: list) -> str:
    """The allocator's method on a stack (outermost first): the first frame outside kvguard,
    hypothesis and the standard library after the fuzzer's own, a lambda passed over for the
    method it calls. "" when the stack never left the fuzzer."""
    frame = entry(frames)
    if frame is None:
        return ""
    code = frame.f_code
    return f"{code.co_name}()" if code.co_name != "__init__" else \
        f"{getattr(code, 'co_qualname', '__init__')}()"


def entry(frames: list):
    """The frame of ``where``, or None."""
    inside = False
    found = []
    for frame in frames:
        filename = frame.f_code.co_filename
        filename = filename if filename.startswith("<") else os.path.abspath(filename)
        if filename.startswith("<frozen importlib"):
            if not found:
                return None  # a module the fuzzer imports: not the allocator's code
            break  # the allocator imports something: its method is known already
        if filename == _CONTAIN:  # the containment itself (its timer's handler): no allocator
            inside = True
            continue
        ours = _ours(filename)
        if ours and filename.startswith(_KVGUARD):
            inside = True
            found = []
        elif inside and not ours:
            found.append(frame)
    named = [f for f in found if f.f_code.co_name != "<lambda>"] or found
    return named[0] if named else None


def stack(frame) -> list:
    """The stack from ``frame`` out, outermost first."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    out.reverse()
    return out


def frames_of(tb) -> list:
    out = []
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def raised_by_allocator(exc: BaseException) -> bool:
    """A KeyboardInterrupt is the allocator's, not the user's, when a ``raise`` outside kvguard
    threw it (and no Ctrl-C reached kvguard's handler)."""
    if isinstance(exc, UserInterrupt) or USER["interrupted"]:
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    name = tb.tb_frame.f_code.co_filename if tb is not None else "<>"
    if _ours(name if name.startswith("<") else os.path.abspath(name)):
        return False
    import linecache
    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
    return line.startswith("raise")


def classify(exc: BaseException, limit, frames: list, what: str):
    """The Escape for ``exc``, or None when it is not the allocator's doing (a deadline that
    came while the fuzzer itself ran: the caller reports a cut-off)."""
    who = limit.who
    found = where(frames)
    place = f"{what} ({found})" if what and found else what or found
    seconds = time.monotonic() - limit.mark
    if isinstance(exc, Interrupted) and exc.reason == "fork" or limit.forked:
        place = f"{what} ({limit.forked})" if what and limit.forked else what or limit.forked
        return Escape("fork", place, f"{who} forked the process (os.fork() in {place}); "
                      "the child was stopped before it ran on", seconds, run=limit.run)
    if isinstance(exc, Interrupted):
        if not place:
            return None
        why = f"within {limit.hang:g} s (--hang)" if exc.reason == "hang" else (
            f"when the time for this search ran out (its sequence had run {seconds:.1f} s)")
        return Escape("hang", place, f"{who} hung: {place} did not return {why}",
                      seconds, run=limit.run)
    place = place or who
    if isinstance(exc, SystemExit):
        kind, text = "exit", f"{who} exited the process ({exc!r}) in {place}"
    elif isinstance(exc, KeyboardInterrupt):
        kind, text = "interrupt", (f"{who} raised {exc!r} in {place}: to whatever runs "
                                   "it, that is a Ctrl-C")
    elif isinstance(exc, GeneratorExit):
        kind, text = "generator-exit", (f"{who} raised {exc!r} in {place}: it is meant "
                                        "for closing generators, and ends a caller's loop")
    else:
        kind, text = "base-exception", (f"{who} raised {exc!r} in {place}: a "
                                        "BaseException, which `except Exception` does not catch")
    frame = entry(frames)
    owner = frame.f_locals.get("self") if frame is not None else None
    return Escape(kind, place, text, seconds, run=limit.run,
                  owner=type(owner) if owner is not None else None)
