"""``kvguard replay FILE``: re-run a report's flight recorder against a model allocator, offline.

Every report carries the allocator's last operations (``history=``, ``KVGUARD_HISTORY``): what
each call handed out or took back, and where it was called from. In log mode the recorder keeps
what the allocator really received, faulty calls included. The replay merges the windows of all
reports of one allocator instance (the guard numbers its calls, so windows line up and gaps show)
and checks each operation against ``ModelAllocator``, the state a correct allocator must be in:
the first operation the model rejects is where the allocator's state first went wrong, which is
often several calls before the report that drew attention to it.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass, field

from .replaymodel import ModelAllocator, describe_ids as _ids

from ..violation import EMPTY


@dataclass
class Step:
    """One recorded operation and what the model found wrong with it."""

    call: int
    op: str
    ids: list
    pool: object = None
    site: dict | None = None
    problems: list = field(default_factory=list)
    """``(kind, message)`` pairs, in kvguard's violation kinds."""
    gap_before: int = 0
    """Calls missing from the record just before this one."""
    count: int = 1
    """The calls it stands for: an ``empty`` step counts calls with no ids, the last
    numbered ``call``."""
    reported: bool = False
    """Not in any recorded window: a report's own call, known from the report alone (its ids
    are the ones it names, its problems the report's)."""

    @property
    def first_call(self) -> int:
        return self.call - self.count + 1

    def where(self) -> str:
        s = self.site
        return f"{s['file']}:{s['line']} in {s['function']}" if s else "<no site recorded>"

    def to_dict(self) -> dict:
        return {"call": self.call, "op": self.op, "ids": self.ids, "pool": self.pool,
                "site": self.site, "gap_before": self.gap_before, "count": self.count,
                "reported": self.reported,
                "problems": [{"kind": k, "message": m} for k, m in self.problems]}


def _short(violation: dict) -> str:
    """A report in a few words: its kind and blocks, who the call was for and who holds the
    blocks, the steps in flight that use them (the rest is in the file)."""
    ids = violation.get("block_ids") or []
    shown = f" of {_ids(ids)}" if ids else ""
    return f"{violation.get('kind')}{shown}{_holders(violation)}"


def _holders(violation: dict) -> str:
    """``", a call for 'R'; held by 'Q'; in flight in step(s) [41]"``: the request the violating
    call was made for, the holders of its blocks, and the leases that cover them."""
    parts = []
    if violation.get("holder") is not None:
        parts.append(f"a call for {violation['holder']!r}")
    held = list(dict.fromkeys(repr(b["holder"]) for b in violation.get("blocks") or ()
                              if isinstance(b, dict) and b.get("holder") is not None))
    if held:
        parts.append(f"held by {', '.join(held)}")
    steps = (violation.get("extra") or {}).get("in_flight_steps")
    if steps:  # a list, or its text where the record kept it as one
        parts.append(f"in flight in step(s) {steps if isinstance(steps, str) else list(steps)}")
    return f" ({'; '.join(parts)})" if parts else ""


@dataclass
class Replay:
    """The result: the steps, the reports placed among them, and the first step gone wrong."""

    guard: dict
    pid: object
    file: str
    steps: list
    reports: list
    """``(after_call, violation dict)``: each report follows the last call its window holds."""
    others: int = 0

    @property
    def first_wrong(self):
        return next((s for s in self.steps if s.problems), None)

    def to_dict(self) -> dict:
        first = self.first_wrong
        return {"guard": self.guard, "pid": self.pid, "file": self.file,
                "steps": [s.to_dict() for s in self.steps],
                "reports": [{"after_call": c, "kind": v["kind"],
                             "block_ids": v.get("block_ids", []),
                             "holder": v.get("holder"),
                             "block_holders": {str(b["id"]): b.get("holder")
                                               for b in v.get("blocks") or ()
                                               if isinstance(b, dict) and "id" in b},
                             "in_flight_steps": (v.get("extra") or {}).get("in_flight_steps"),
                             "summary": v.get("summary", "")} for c, v in self.reports],
                "first_wrong": first.to_dict() if first else None}

    def headline(self) -> str:
        """The first report in a few words, holders and leases included."""
        return _short(self.reports[0][1]) if self.reports else ""

    def render(self) -> str:
        g = self.guard
        steps = self.steps
        kept = [s for s in steps if not s.reported]
        span = f"calls #{kept[0].first_call}..#{kept[-1].call}" if kept else "no calls"
        lines = [f"kvguard replay: {g.get('name', '?')} ({g.get('class', '?')} at "
                 f"{g.get('address', '?')}), pid {self.pid}, {len(self.reports)} report(s) in "
                 f"{self.file}",
                 f"{span}: {len(kept)} recorded operation(s) replayed against a model "
                 "allocator (ids first seen in the record are given the benefit of the doubt)",
                 ""]
        by_call: dict = {}
        for after, v in self.reports:
            by_call.setdefault(after, []).append(v)
        width = max((len(str(list(s.ids))) for s in steps if s.op != EMPTY), default=0)
        width = min(width, 40)
        for v in by_call.pop(0, []):
            lines.append(f"    >> reported before the first recorded call: {_short(v)}")
        for s in steps:
            if s.gap_before:
                lines.append(f"    ... {s.gap_before} call(s) not recorded (the model forgets "
                             "what it knew)")
            if s.op == EMPTY:
                lines.append(f"    ... {s.count} empty call(s) #{s.first_call}..#{s.call} (no "
                             "ids: counted, not recorded one by one)")
            elif s.reported:
                named = f"; it names {_ids(s.ids)}" if s.ids else ""
                lines.append(f"    #{s.call:<5} {s.op:<8} {'?':<{width}}  at {s.where()}  (in no "
                             f"recorded window: known from its report{named})")
            else:
                ids = str(list(s.ids))
                lines.append(f"    #{s.call:<5} {s.op:<8} {ids:<{width}}  at {s.where()}")
            for kind, message in s.problems:
                lines.append(f"           !! {kind}: {message}")
            for v in by_call.pop(s.call, []):
                lines.append(f"    >> the guard reported on the next {v.get('method') or ''}() "
                             f"call: {_short(v)}")
        for after, vs in sorted(by_call.items()):
            for v in vs:
                lines.append(f"    >> reported after call #{after}: {_short(v)}")
        lines.append("")
        first = self.first_wrong
        if first is not None and first.reported:
            lines.append(f"the first bad call is #{first.call}: {first.op} at {first.where()} "
                         "(a reported call no recorded window holds: its report names it, "
                         "and the record does not show what the allocator did with it)")
            lines += [f"  {kind}: {message}" for kind, message in first.problems]
        elif first is not None:
            lines.append(f"state first went wrong at call #{first.call}: {first.op} "
                         f"{list(first.ids)} at {first.where()}")
            lines += [f"  {kind}: {message}" for kind, message in first.problems]
        else:
            lines.append("every recorded operation is consistent with a correct allocator: the "
                         "state went wrong at a reported call itself, or before the record "
                         "starts (a longer record: KVGUARD_HISTORY=N)")
        if self.others:
            lines.append(f"({self.others} other allocator instance(s) reported in this file: "
                         "--guard NAME or --pid PID replays another)")
        return "\n".join(lines)


def _violation_records(path: str) -> list:
    from .records import printable
    from .summary import load, normalized
    records = load([path]).violations
    if records:
        return records
    from .logfiles import MAX_LINE_CHARS, open_log
    try:  # one pretty-printed Violation.to_dict(), or a list of them (gzipped or not)
        with open_log(path) as f:
            text = f.read(MAX_LINE_CHARS + 1)  # bounded, as each line of a log is
        if len(text) > MAX_LINE_CHARS:
            return []
        data = json.loads(text)
    except (OSError, EOFError, zlib.error, ValueError, RecursionError):
        return []
    items = data if isinstance(data, list) else [data]
    out = []
    for item in items:
        rec = normalized(item)[0] if isinstance(item, dict) else None
        if rec is not None and rec["event"] == "violation":
            rec["process"] = (rec.get("host", ""), rec.get("pid", 0), 0, path)
            rec["file"] = printable(path)
            out.append(rec)
    return out


def build(path: str, *, guard: str | None = None, pid: int | None = None,
          violation: int | None = None) -> Replay:
    """Assemble and run the replay of one allocator instance's reports in ``path``.
    ``violation`` (1-based, in file order) replays that one report's window alone."""
    records = _violation_records(path)
    if not records:
        raise ValueError(f"no kvguard violation reports in {path}")
    if violation is not None:
        if not 1 <= violation <= len(records):
            raise ValueError(f"--violation {violation}: {path} holds {len(records)} report(s)")
        chosen = [records[violation - 1]]
        others = 0
    else:
        candidates = [r for r in records
                      if (guard is None or (r.get("guard") or {}).get("name") == guard)
                      and (pid is None or r.get("pid") == pid)]
        if not candidates:
            raise ValueError(f"no report in {path} matches"
                             + (f" --guard {guard}" if guard else "")
                             + (f" --pid {pid}" if pid is not None else ""))
        first = candidates[0]
        key = (first["process"], (first.get("guard") or {}).get("name"))
        chosen = [r for r in candidates
                  if (r["process"], (r.get("guard") or {}).get("name")) == key]
        others = len({(r["process"], (r.get("guard") or {}).get("name")) for r in records}) - 1
    if not any(r["violation"].get("history") for r in chosen):
        raise ValueError(f"the reports in {path} carry no recorded operations (none came "
                         "before them, or the flight recorder was off: KVGUARD_HISTORY=0)")
    ops: dict = {}
    reports = []
    for rec in chosen:
        history = rec["violation"].get("history") or []
        for op in history:
            count = _count(op)
            first = op.get("call", 0) - count + 1
            if first not in ops or count > _count(ops[first]):  # a fold grows between reports
                ops[first] = op
        reports.append((max((op.get("call", 0) for op in history), default=0),
                        rec["violation"]))
    steps = [Step(op.get("call", 0), op.get("op", "?"), list(op.get("ids", [])), op.get("pool"),
                  op.get("site"), count=_count(op)) for _, op in sorted(ops.items())]
    model = ModelAllocator({s.pool for s in steps if s.op == "share"})
    previous = None
    for s in steps:
        if previous is not None and s.first_call > previous + 1:
            s.gap_before = s.first_call - previous - 1
            model.forget()
        s.problems = model.apply(s)
        previous = max(s.call, previous or 0)
    steps = sorted(steps + reported_calls(steps, reports, chosen), key=lambda s: s.call)
    return Replay(chosen[0].get("guard") or {}, chosen[0].get("pid"), path, steps, reports,
                  others)


CALL_KINDS = frozenset({"double-free", "duplicate-id", "bool-id", "tensor-id", "invalid-id",
                        "foreign-id", "consumed-iterable", "shared-block", "stale-free",
                        "free-in-flight"})
"""Kinds reported on an allocator call, before it is recorded (a leak, a table, a count that
disagrees, a cache written after free are found elsewhere, or after the call is recorded)."""

NOT_CALLS = frozenset({"check", "check_tables", "assert_no_leaks"})
"""Guard methods whose reports name no allocator call (``check_tables``' shared-block)."""


def reported_calls(steps, reports, chosen) -> list:
    """The reported calls no recorded window holds, as steps of their own (with the report's
    problems). A report is drawn before its call is recorded: in log mode (or when the guard
    stepped aside) the call then reaches the allocator as made and, taken, is the next one
    numbered, the call after the report's window. When throttled logging left it out of
    every later window, only the report itself says where the first bad call was (whether
    the allocator took it, the record cannot show: one it refused is numbered by no one)."""
    recorded = set()
    for s in steps:
        recorded.update(range(s.first_call, s.call + 1))
    out: dict = {}
    for (after, violation), rec in zip(reports, chosen):
        forwarded = (rec.get("guard") or {}).get("mode") == "log" or \
            (violation.get("extra") or {}).get("stepped_aside")
        kind = violation.get("kind")
        method = violation.get("method") or ""
        call = after + 1
        if not after or not forwarded or call in recorded or kind not in CALL_KINDS or \
                method in NOT_CALLS:
            continue
        if call not in out:
            frames = violation.get("call_stack") or []
            op = method if method in ("allocate", "free", "share") else \
                "allocate" if kind == "shared-block" else "free"
            out[call] = Step(call, op, [], violation.get("pool"), frames[0] if frames else None,
                             reported=True)
        step = out[call]
        step.ids += [b for b in violation.get("block_ids") or ()
                     if type(b) is int and b not in step.ids]
        step.problems.append((kind, violation.get("message", "")))
    return list(out.values())


def _count(op: dict) -> int:
    """How many calls a recorded operation stands for (an ``empty`` one counts several)."""
    count = op.get("count", 1) if op.get("op") == EMPTY else 1
    return count if type(count) is int and count >= 1 else 1


def replay_command(argv) -> int:
    """``kvguard replay FILE``."""
    from ..cli import Parser, UsageError
    parser = Parser(prog="kvguard replay", description=(
        "Re-run the flight recorder of the reports in FILE (staging's JSON lines, plain, "
        "gzipped or rotated, or one "
        "Violation.to_dict()) against a model allocator, and show where the allocator's state "
        "first went wrong."))
    parser.add_argument("file", metavar="FILE", help="a staging log (kvguard-PID.jsonl, "
                        "gzipped or rotated too) or a file holding one Violation.to_dict()")
    parser.add_argument("--guard", metavar="NAME", help="the allocator instance (its guard's "
                        "name, as reports show it); default: the first one reported")
    parser.add_argument("--pid", type=int, help="only reports from this process")
    parser.add_argument("--violation", type=int, metavar="N",
                        help="replay only the N-th report's window (1-based, in file order)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--emit-test", action="store_true", help="replay the calls on a fresh "
                        "instance of the allocator class the log names, shrink them to the "
                        "fewest that still break the contract, and print them as a pytest "
                        "regression test")
    parser.add_argument("--factory", metavar="EXPR", help="with --emit-test: an expression "
                        "building the allocator, the class bound to `cls` (default: the "
                        "built-in factory of `kvguard fuzz`)")
    parser.add_argument("--spec", metavar="MODULE.NAME", help="with --emit-test: the "
                        "kvguard.AllocatorSpec to read it with (default: its registered spec)")
    parser.add_argument("--trust", action="store_true", help="with --emit-test: import the "
                        "allocator class the log names even if it is not registered with "
                        "kvguard (importing a module runs its code: only for a log you trust)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.file):
        raise UsageError(f"kvguard replay: error: no such file: {args.file}")
    try:
        result = build(args.file, guard=args.guard, pid=args.pid, violation=args.violation)
    except (ValueError, OSError) as exc:
        raise UsageError(f"kvguard replay: error: {exc}") from None
    if args.emit_test:
        from ..cli import hand_off
        return hand_off("replay --emit-test", result, args)
    if args.format == "json":
        json.dump(result.to_dict(), sys.stdout, indent=2, default=repr)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(result.render() + "\n")
    return 0
