"""The shape of staging's JSON records, checked before ``kvguard report`` or ``replay`` reads one.

Staging files come from many processes, versions and crashes: a line may be cut short, written by
another program, edited by hand, or hold a value of the wrong type (a guard named with a tuple is
written as a JSON list). The readers trust a record only after ``problem()`` has found nothing
wrong with it; every other line is skipped and named (file, line, why), so one bad line never
costs the rest of a report.

Each record type is described by a table of its fields: a field may be absent (the readers supply
defaults), but when present it has the type given here.
"""

from __future__ import annotations

import json
import math
import re

from .. import kinds

EVENTS = ("start", "stats", "violation")

FORMAT_VERSION = 1
"""The ``"kvguard"`` field staging writes in every record. It goes up on an incompatible change
of the records (a field removed, retyped or given another meaning, a new required one); a new
optional field keeps it. ``kvguard/schema/log-v{N}.json`` is each version's JSON Schema."""

FORMATS = {0: "a bare Violation.to_dict() line", 1: "start/violation/stats records"}
"""The format versions the readers know; a record of a newer one is skipped and counted."""


def schema(version: int = FORMAT_VERSION) -> dict:
    """The JSON Schema of one format version's records, as shipped in the package (format 0, a
    bare violation, is the ``violation_report`` definition of version 1)."""
    from importlib import resources
    text = resources.files("kvguard").joinpath("schema", f"log-v{version}.json").read_text(
        encoding="utf-8")
    return json.loads(text)


def newer(record: dict):
    """The format version of a record written by a newer kvguard than this one, else None."""
    version = record.get("kvguard")
    return version if _count(version) and version > FORMAT_VERSION else None


MAX_DEPTH = 24
"""Deepest nesting a record may have; the deepest real field (a frame of a block's allocation
stack) is six levels down. Deeper lines are junk, and would cost the readers their stack."""


def _int(value) -> bool:
    return type(value) is int


def _count(value) -> bool:
    return type(value) is int and value >= 0


def _positive(value) -> bool:
    return type(value) is int and value >= 1


def _str(value) -> bool:
    return type(value) is str


def _bool(value) -> bool:
    return type(value) is bool


def _time(value) -> bool:
    """Seconds since the epoch that ``time.localtime`` can show (finite, year < 10000)."""
    return type(value) in (int, float) and math.isfinite(value) and 0 <= value < 253402300799


def _scalar(value) -> bool:
    """What the guard writes for a pool or an owner: a JSON scalar (hashable)."""
    return value is None or type(value) in (bool, int, str) or (
        type(value) is float and math.isfinite(value))


def _dict(value) -> bool:
    return type(value) is dict


def _strings(value) -> bool:
    return type(value) is list and all(type(x) is str for x in value)


def _ids(value) -> bool:
    return type(value) is list and all(type(x) is int for x in value)


def _frame_problem(value):
    if type(value) is not dict:
        return f"is not an object ({_short(value)})"
    return _fields(value, FRAME, required=("file", "line", "function"))


def _frames_problem(value):
    if type(value) is not list:
        return f"is not a list ({_short(value)})"
    for n, frame in enumerate(value):
        why = _frame_problem(frame)
        if why:
            return f"[{n}] {why}"
    return None


def _each(table, required=()):
    """A checker for a list of objects of one table."""
    def check(value):
        if type(value) is not list:
            return f"is not a list ({_short(value)})"
        for n, item in enumerate(value):
            if type(item) is not dict:
                return f"[{n}] is not an object ({_short(item)})"
            why = _fields(item, table, required)
            if why:
                return f"[{n}] {why}"
        return None
    return check


def _table(table, required=()):
    """A checker for one nested object."""
    def check(value):
        if type(value) is not dict:
            return f"is not an object ({_short(value)})"
        return _fields(value, table, required)
    return check


def _kind(value) -> bool:
    return type(value) is str and value in kinds.MEANING


FRAME = {"file": _str, "line": _int, "function": _str}
OPERATION = {"op": _str, "ids": _ids, "pool": _scalar, "call": _int, "count": _positive,
             "site": lambda v: v is None or _frame_problem(v) is None}
BLOCK = {"id": _int, "state": _str, "refcount": _int, "owner": _scalar, "holder": _scalar,
         "last_call": _int,
         "allocated_at": _frames_problem, "freed_at": _frames_problem}
ALLOCATOR = {"class": _str, "name": _str, "address": _str}
VIOLATION = {
    "kind": _kind, "block_ids": _ids, "message": _str, "allocator": _table(ALLOCATOR),
    "method": _str, "pool": _scalar, "call_stack": _frames_problem,
    "blocks": _each(BLOCK, required=("id",)), "owner": _scalar, "holder": _scalar,
    "history": _each(OPERATION, required=("op",)), "thread": _str, "pid": _int, "time": _time,
    "expected": _bool, "extra": _dict, "summary": _str,
}
GUARD = {"name": _str, "class": _str, "address": _str, "mode": _str, "stacks": _str,
         "sample": _positive, "learning": _bool, "learned": _count, "seeded": _count}
STATS = {"alloc_calls": _count, "free_calls": _count, "share_calls": _count,
         "blocks_allocated": _count, "blocks_freed": _count, "blocks_shared": _count,
         "learned": _count, "internal_errors": _count,
         "violations": lambda v: type(v) is dict and all(_count(n) for n in v.values())}
RAY = {"node_id": _str, "job_id": _str, "worker_id": _str, "actor_id": _str, "actor_class": _str,
       "actor_name": _str, "task": _str}
"""A Ray worker's (or driver's) context, on every record it writes (optional, format 1)."""
COMMON = {"kvguard": _count, "event": lambda v: v in EVENTS, "time": _time, "pid": _int,
          "host": _str, "ray": _table(RAY)}
RECORDS = {
    "start": {**COMMON, "ppid": _int, "argv": _strings, "python": _str, "version": _str,
              "config": _dict, "run": _str},
    "violation": {**COMMON, "occurrence": _positive, "guard": _table(GUARD),
                  "violation": _table(VIOLATION, required=("kind",))},
    "stats": {**COMMON, "guard": _table(GUARD), "stats": _table(STATS), "dropped": _count,
              "final": _bool},
}
"""Every field the readers use, per record type. Fields not listed are carried unread."""
REQUIRED = {"start": ("kvguard", "event"), "stats": ("kvguard", "event"),
            "violation": ("kvguard", "event", "violation")}


def _fields(record: dict, table: dict, required=()):
    for name in required:
        if name not in record:
            return f"has no {name!r}"
    for name, check in table.items():
        if name not in record:
            continue
        verdict = check(record[name])
        if verdict is True or verdict is None:
            continue
        if isinstance(verdict, str):  # a nested field's own complaint, naming its value
            return f"{name!r} {verdict}"
        return f"{name!r} has the wrong type ({_short(record[name])})"
    return None


def _short(value, limit: int = 40) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _depth(value, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (iteratively: a deep line costs no stack)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if type(item) is dict:
            stack.extend((v, depth + 1) for v in item.values())
        elif type(item) is list:
            stack.extend((v, depth + 1) for v in item)
    return False


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                          "\u2066-\u2069]")
MAX_FIELD_CHARS = 16384
"""A longer string in a record is cut there (and says so): no field kvguard writes is that
long."""


def printable(text: str) -> str:
    """``text`` with control characters (and the bidirectional overrides, which reorder what
    a terminal shows) escaped as ``\\xNN``/``\\uNNNN``: a field of a log printed to a terminal
    cannot move the cursor, clear the screen, or start a line of its own that reads like one
    of the report's."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100
                            else f"\\u{ord(m[0]):04x}", text)


def as_data(record):
    """A copy of a parsed record with every string (keys too) made ``printable`` and cut at
    ``MAX_FIELD_CHARS``: what the readers show is data, never terminal control. Iterative:
    ``problem()`` has bounded the depth already."""
    def clean(text):
        if len(text) > MAX_FIELD_CHARS:
            text = text[:MAX_FIELD_CHARS] + f"...[{len(text) - MAX_FIELD_CHARS:,} more]"
        return printable(text)

    def copy(value):
        if type(value) is str:
            return clean(value)
        if type(value) is dict:
            return {}
        if type(value) is list:
            return []
        return value

    top = copy(record)
    stack = [(record, top)]
    while stack:
        src, dst = stack.pop()
        pairs = src.items() if type(src) is dict else enumerate(src)
        for key, value in pairs:
            new = copy(value)
            if type(dst) is dict:
                dst[clean(key) if type(key) is str else key] = new
            else:
                dst.append(new)
            if type(value) in (dict, list):
                stack.append((value, new))
    return top


def parse(line: str):
    """``(record, None)`` for a line holding a JSON object, else ``(None, why)``."""
    try:
        record = json.loads(line)
    except RecursionError:
        return None, "nested too deeply to read"
    except ValueError as exc:
        return None, f"not JSON ({exc.msg if hasattr(exc, 'msg') else exc})"
    if type(record) is not dict:
        return None, f"not a JSON object ({type(record).__name__})"
    return record, None


def problem(record: dict):
    """What is wrong with a staging record (a ``start``/``violation``/``stats`` line), or None.
    ``record`` is a JSON object that claims to be one (see ``is_kvguard``)."""
    if _depth(record, MAX_DEPTH):
        return f"nested deeper than {MAX_DEPTH} levels"
    event = record.get("event")
    if event not in RECORDS:
        return f"unknown event {_short(event)}"
    return _fields(record, RECORDS[event], REQUIRED[event])


def is_kvguard(record: dict) -> bool:
    """Whether a JSON object claims to be a staging record (another program's JSON is not)."""
    return "kvguard" in record and record.get("event") in EVENTS


def is_bare_violation(record: dict) -> bool:
    """A ``Violation.to_dict()`` on its own (a pytest report, a saved report)."""
    return "summary" in record and "kind" in record and "kvguard" not in record
