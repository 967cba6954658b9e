"""``kvguard report DIR|FILES...``: one summary from the JSON lines of many processes.

Staging writes one file per process (multi-GPU workers, Ray actors, xdist workers): a ``start``
line, a ``violation`` line for the first occurrence of each (kind, call site) and then one per
``KVGUARD_LOG_EVERY``, and a ``stats`` line per guard at exit. The merge counts each kind exactly
where a process left its stats line, and otherwise from the occurrence numbers of its lines (a
lower bound, shown as such). Bare ``Violation.to_dict()`` lines are read too.

Files may be rotated and compressed (``kvguard.staging.logfiles``): a process is one process
across its rotation set, and many hosts' directories merge into one summary, per host as well as per kind.
``--since`` keeps the records written from a time on.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from .. import kinds
from .logfiles import DESCRIPTION, collect_files, open_log, parse_since, rotation_set
from .records import FORMAT_VERSION, is_bare_violation, is_kvguard, newer, parse, problem

__all__ = ["Records", "collect_files", "load", "normalized", "of_run", "render", "since",
           "summarize"]


MAX_PROBLEMS_LISTED = 100
"""Skipped lines a JSON summary names one by one (all are counted)."""


@dataclass
class Records:
    """Every kvguard line read, grouped by event, each tagged with its process and file."""

    violations: list = field(default_factory=list)
    stats: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    files: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    """``(file, line, why)`` of every line skipped (line 0: the whole file could not be read)."""
    formats: Counter = field(default_factory=Counter)
    """Records read per format version (0: bare violations)."""
    newer: Counter = field(default_factory=Counter)
    """Records skipped per format version newer than this kvguard reads."""
    since: float | None = None
    """``--since``: only records written from this time on are here."""

    @property
    def skipped(self) -> int:
        """Lines skipped: not JSON, another program's JSON, or an ill-formed kvguard record."""
        return len(self.problems)

    def skip(self, path: str, line: int, why: str) -> None:
        self.problems.append((path, line, why))


def load(files) -> Records:
    """Read kvguard records from JSON-lines files. A line that is not a well-formed kvguard
    record, or a file that cannot be read, is skipped and named in ``Records.problems``; every
    other line is still read."""
    records = Records(files=list(files))
    instances: dict = {}  # rotation set -> {(host, pid): start time}, followed file to file
    for path in files:
        logged_as = (rotation_set(path) or (path, 0))[0]
        instance = instances.setdefault(logged_as, {})
        number = 0
        try:
            with open_log(path) as f:
                for number, line in enumerate(f, 1):
                    line = line.strip()
                    if line:
                        _read_line(records, instance, path, logged_as, number, line)
        except (OSError, EOFError, zlib.error) as exc:
            past = f" past line {number}" if number else ""
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            if isinstance(exc, EOFError):
                why = "compressed data ends early (still being written, or cut short)"
            records.skip(path, 0, f"cannot read the file{past}: {why}")
    return records


def of_run(records: Records, run: str) -> Records:
    """Only the records of the processes one ``kvguard run`` started (their start lines carry
    its ``KVGUARD_RUN`` id)."""
    mine = {r["process"] for r in records.starts if r.get("run") == run}
    return Records(violations=[r for r in records.violations if r["process"] in mine],
                   stats=[r for r in records.stats if r["process"] in mine],
                   starts=[r for r in records.starts if r["process"] in mine],
                   files=sorted({p[3] for p in mine}), problems=list(records.problems))


def since(records: Records, cutoff: float) -> Records:
    """Only what was written from ``cutoff`` on. A process that started before it keeps its
    lines from then on but not its ``stats`` lines (they count its whole life): its counts are
    the occurrences after the last line it logged before ``cutoff`` (within ``KVGUARD_LOG_EVERY``
    of the truth), shown as a lower bound."""
    before: dict = defaultdict(int)
    kept = []
    for r in records.violations:
        key = (r["process"], (r.get("guard") or {}).get("name", ""), r["violation"]["kind"],
               _site(r["violation"]))
        if r.get("time", 0) < cutoff:
            before[key] = max(before[key], r.get("occurrence", 1))
        else:
            kept.append((key, r))
    violations = [{**r, "occurrence": max(r.get("occurrence", 1) - before[key], 1)}
                  for key, r in kept]
    stats = [r for r in records.stats if r["process"][2] >= cutoff and r.get("time", 0) >= cutoff]
    active = {r["process"] for r in violations + stats}
    starts = [r for r in records.starts
              if r["process"] in active or r.get("time", 0) >= cutoff]
    return Records(violations=violations, stats=stats, starts=starts, files=records.files,
                   problems=records.problems, formats=records.formats, newer=records.newer,
                   since=cutoff)


def _read_line(records: Records, instance: dict, path: str, logged_as: str, number: int,
               line: str) -> None:
    record, why = parse(line)
    if record is not None:
        version = newer(record) if is_kvguard(record) else None
        if version is not None:
            records.newer[version] += 1
        record, why = normalized(record)
    if record is None:
        records.skip(path, number, why)
        return
    records.formats[record["kvguard"]] += 1
    who = (record.get("host", ""), record.get("pid", 0))
    if record["event"] == "start":
        instance[who] = record.get("time", 0)
    record["process"] = (*who, instance.get(who, 0), logged_as)
    record["file"] = path
    getattr(records, {"start": "starts", "stats": "stats",
                      "violation": "violations"}[record["event"]]).append(record)


def normalized(record: dict):
    """``(record, None)`` for a well-formed staging record (a bare ``Violation.to_dict()`` is
    wrapped into one), else ``(None, why)``."""
    if is_bare_violation(record):
        alloc = record.get("allocator")
        alloc = alloc if isinstance(alloc, dict) else {}
        record = {"kvguard": 0, "event": "violation", "time": record.get("time", 0),
                  "pid": record.get("pid", 0), "host": "", "occurrence": 1,
                  "guard": {"name": alloc.get("name", ""), "class": alloc.get("class", "")},
                  "violation": record}
    elif not is_kvguard(record):
        return None, "not a kvguard record"
    version = newer(record)
    if version is not None:
        return None, (f"format version {version}, written by a newer kvguard (this one reads "
                      f"up to {FORMAT_VERSION}): upgrade kvguard to read it")
    why = problem(record)
    if why is not None:
        return None, f"ill-formed {record.get('event')} record: {why}"
    return record, None


def _site(violation: dict) -> str:
    stack = violation.get("call_stack") or []
    if stack:
        top = stack[0]
        return f"{top.get('file')}:{top.get('line')} in {top.get('function')}"
    summary = violation.get("summary") or ""
    where = summary.replace(f"SUMMARY: kvguard: {violation['kind']}", "").strip()
    return where or "<no stack recorded>"


def summarize(records: Records, top: int = 10) -> dict:
    """The merged summary (``--format json`` prints exactly this)."""
    occurrences: dict = defaultdict(int)   # (proc, guard, kind, site) -> highest occurrence
    guard_info: dict = {}                  # (proc, guard) -> latest guard dict
    stats: dict = {}                       # (proc, guard) -> stats dict
    dropped = 0
    first: dict = {}
    for rec in records.violations:
        v = rec["violation"]
        g = rec.get("guard") or {}
        key = (rec["process"], g.get("name", ""))
        guard_info[key] = {**guard_info.get(key, {}), **g}
        site = _site(v)
        n = rec.get("occurrence", 1)
        occurrences[(*key, v["kind"], site)] = max(occurrences[(*key, v["kind"], site)], n)
        if v["kind"] not in first or v.get("time", 0) < first[v["kind"]]["violation"].get(
                "time", 0):
            first[v["kind"]] = rec
    for rec in records.stats:
        key = (rec["process"], (rec.get("guard") or {}).get("name", ""))
        guard_info[key] = {**guard_info.get(key, {}), **(rec.get("guard") or {})}
        stats[key] = rec.get("stats") or {}
        dropped += rec.get("dropped", 0) if isinstance(rec.get("dropped"), int) else 0

    # per (process, guard, kind): exact from stats where present, else the lines' lower bound
    bound: Counter = Counter()
    for (proc, name, kind, _site_), n in occurrences.items():
        bound[(proc, name, kind)] += n
    counts: Counter = Counter()
    exact = True
    for key in set(guard_info):
        known = (stats.get(key) or {}).get("violations") or {}
        kinds_here = set(known) | {k for (p, n, k) in bound if (p, n) == key}
        for kind in kinds_here:
            counts[(*key, kind)] = max(known.get(kind, 0), bound[(*key, kind)])
            if key not in stats:
                exact = False

    by_kind: dict = {}
    for (proc, name, kind), n in counts.items():
        entry = by_kind.setdefault(kind, {"count": 0, "processes": set(),
                                          "meaning": kinds.MEANING.get(kind, "")})
        entry["count"] += n
        entry["processes"].add(proc)
    by_allocator: dict = {}
    for key, info in guard_info.items():
        proc, name = key
        cls = info.get("class") or "?"
        a = by_allocator.setdefault(cls, {
            "guards": 0, "processes": set(), "calls": 0, "violations": Counter(),
            "learning_guards": 0, "learned": 0, "seeded": 0, "internal_errors": 0,
            "sample": set(), "modes": set()})
        a["guards"] += 1
        a["processes"].add(proc)
        s = stats.get(key) or {}
        a["calls"] += sum(s.get(k, 0) for k in ("alloc_calls", "free_calls", "share_calls"))
        a["learned"] += max(s.get("learned", 0), info.get("learned", 0))
        a["seeded"] += info.get("seeded", 0)
        a["learning_guards"] += bool(info.get("learning"))
        a["internal_errors"] += s.get("internal_errors", 0)
        a["sample"].add(info.get("sample", 1))
        if info.get("mode"):
            a["modes"].add(info["mode"])
        for (p, n, kind), c in counts.items():
            if (p, n) == key:
                a["violations"][kind] += c
    sites: dict = {}
    for (proc, name, kind, site), n in occurrences.items():
        entry = sites.setdefault((kind, site), {"kind": kind, "site": site, "count": 0,
                                                "processes": set()})
        entry["count"] += n
        entry["processes"].add(proc)
    top_sites = sorted(sites.values(), key=lambda e: (-e["count"], e["kind"], e["site"]))[:top]

    processes = {}
    for rec in records.starts:
        processes.setdefault(rec["process"], {"argv": rec.get("argv", [])})
    for proc in {p for (p, _n) in guard_info}:
        processes.setdefault(proc, {"argv": []})

    def proc_dict(proc):
        host, pid, _started, path = proc
        return {"host": host, "pid": pid, "file": path, "argv": processes[proc]["argv"],
                "violations": sum(c for (p, _n, _k), c in counts.items() if p == proc)}

    by_host: dict = {}
    for proc in processes:
        by_host.setdefault(proc[0], {"processes": 0, "violations": 0, "by_kind": Counter()})
        by_host[proc[0]]["processes"] += 1
    for (proc, _name, kind), c in counts.items():
        by_host[proc[0]]["violations"] += c
        by_host[proc[0]]["by_kind"][kind] += c

    return {
        "files": records.files,
        "since": records.since,
        "formats": {str(v): n for v, n in sorted(records.formats.items())},
        "newer_formats": {str(v): n for v, n in sorted(records.newer.items())},
        "processes": [proc_dict(p) for p in sorted(processes, key=lambda p: (p[0], p[1], p[2]))],
        "violations": sum(counts.values()),
        "exact": exact,
        "lines": len(records.violations),
        "skipped_lines": records.skipped,
        "skipped": [{"file": f, "line": n, "why": why}
                    for f, n, why in records.problems[:MAX_PROBLEMS_LISTED]],
        "dropped_lines": dropped,
        "by_kind": {k: {**e, "processes": len(e["processes"])}
                    for k, e in sorted(by_kind.items(), key=lambda kv: (-kv[1]["count"], kv[0]))},
        "by_allocator": {c: {**a, "processes": len(a["processes"]),
                             "violations": dict(a["violations"]), "sample": sorted(a["sample"]),
                             "modes": sorted(a["modes"])}
                         for c, a in sorted(by_allocator.items())},
        "by_host": {h: {**e, "by_kind": dict(e["by_kind"].most_common())}
                    for h, e in sorted(by_host.items())},
        "top_sites": [{**e, "processes": len(e["processes"])} for e in top_sites],
        "first": {k: {"pid": rec.get("pid"), "host": rec.get("host", ""), "file": rec["file"],
                      "guard": rec.get("guard") or {}, "violation": rec["violation"]}
                  for k, rec in first.items()},
    }


def render(summary: dict) -> str:
    """The summary as text: totals, per kind, per allocator, top call sites, then the first
    report of each kind in full."""
    from ..violation import Violation
    n = summary["violations"]
    procs = summary["processes"]
    bad = sum(1 for p in procs if p["violations"])
    hosts = sorted({p["host"] for p in procs if p["host"]})
    at_least = "" if summary["exact"] or not n else "at least "
    where = ", host " + ", ".join(hosts) if len(hosts) == 1 else f", {len(hosts)} hosts" if \
        hosts else ""
    lines = [f"kvguard report: {at_least}{n} violation(s) in {bad} of {len(procs)} process(es)"
             f" ({len(summary['files'])} file(s){where})"]
    if summary.get("since") is not None:
        lines.append("since " + time.strftime("%Y-%m-%d %H:%M:%S %z",
                                              time.localtime(summary["since"])))
    calls = sum(a["calls"] for a in summary["by_allocator"].values())
    guards = sum(a["guards"] for a in summary["by_allocator"].values())
    lines.append(f"guarded: {guards} allocator instance(s), {calls:,} calls checked")
    if summary["by_kind"]:
        lines += ["", "by kind:"]
        width = max(map(len, summary["by_kind"]))
        for kind, e in summary["by_kind"].items():
            lines.append(f"  {kind:<{width}}  {e['count']:>7,}  in {e['processes']} process(es)"
                         f"  {e['meaning']}")
    if len(summary["by_host"]) > 1:
        lines += ["", "by host:"]
        width = max(len(h or "?") for h in summary["by_host"])
        for host, e in summary["by_host"].items():
            found = ", ".join(f"{k} {c:,}" for k, c in e["by_kind"].items())
            lines.append(f"  {host or '?':<{width}}  {e['violations']:>7,}  in "
                         f"{e['processes']} process(es)  {found or 'no violations'}")
    if summary["by_allocator"]:
        lines += ["", "by allocator:"]
        for cls, a in summary["by_allocator"].items():
            ranked = sorted(a["violations"].items(), key=lambda kv: -kv[1])
            found = ", ".join(f"{k} {c:,}" for k, c in ranked)
            lines.append(f"  {cls}: {a['guards']} instance(s) in {a['processes']} process(es), "
                         f"{a['calls']:,} calls, mode {'/'.join(a['modes']) or '?'}: "
                         f"{found or 'no violations'}")
            if a["learning_guards"] or a["learned"]:
                lines.append(f"    attached to {a['learning_guards']} allocator(s) that already "
                             f"had blocks out: {a['learned']:,} id(s) learned lazily, on their "
                             "first free; until then a double free or a foreign id among them "
                             "could not be told from a block handed out before the guard came")
            if a["seeded"]:
                lines.append(f"    {a['seeded']:,} live id(s) seeded from the allocator at attach")
            if a["internal_errors"]:
                lines.append(f"    {a['internal_errors']:,} internal error(s) in the guard: those "
                             "calls were forwarded unchecked (see the kvguard logger's output)")
            sampled = [s for s in a["sample"] if s > 1]
            if sampled:
                lines.append(f"    call sites sampled 1 in {'/'.join(map(str, sampled))}: "
                             "allocation and free stacks are missing from most reports")
    if summary["top_sites"]:
        lines += ["", "top call sites:"]
        for e in summary["top_sites"]:
            lines.append(f"  {e['count']:>7,}  {e['kind']:<17} {e['site']}  "
                         f"({e['processes']} process(es))")
    notes = []
    if summary["newer_formats"]:
        versions = ", ".join(summary["newer_formats"])
        count = sum(summary["newer_formats"].values())
        notes.append(f"{count:,} record(s) written by a newer kvguard (format version "
                     f"{versions}; this one reads up to {FORMAT_VERSION}) were not read: "
                     "upgrade kvguard to count them")
    if summary.get("since") is not None and not summary["exact"] and n:
        notes.append("--since: a process that started earlier is counted from its lines "
                     "written since then (its stats line covers its whole life)")
    if not summary["exact"] and n:
        notes.append("some processes left no stats line (killed, or still running): their "
                     "counts are the lower bound their logged occurrences give")
    if summary["dropped_lines"]:
        notes.append(f"{summary['dropped_lines']:,} violation line(s) not written: the file "
                     "reached KVGUARD_LOG_MAX_MB")
    if summary["skipped_lines"]:
        notes.append(f"{summary['skipped_lines']:,} line(s) skipped: not kvguard records, or "
                     "ill-formed ones:")
        for skipped in summary["skipped"][:10]:
            where = f"{skipped['file']}:{skipped['line']}" if skipped["line"] else \
                skipped["file"]
            notes.append(f"  {where}: {skipped['why']}")
        if summary["skipped_lines"] > 10:
            notes.append(f"  ... and {summary['skipped_lines'] - 10:,} more (--format json "
                         f"lists {MAX_PROBLEMS_LISTED})")
    if notes:
        lines += ["", "notes:"] + [f"    {note}" if note.startswith("  ") else f"  - {note}"
                                   for note in notes]
    for kind, first in summary["first"].items():
        v = Violation.from_dict(first["violation"])
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v.time)) if v.time else "?"
        lines += ["", f"first {kind} (pid {first['pid']}, {when}, {first['file']}):", v.render()]
        g = first["guard"]
        if g.get("learning") or g.get("learned"):
            lines.append(f"note: {g.get('name', 'this guard')} attached to an allocator with "
                         f"blocks out and had learned {g.get('learned', 0)} id(s) lazily")
    return "\n".join(lines)


def _jsonable(summary: dict) -> dict:
    return json.loads(json.dumps(summary, default=repr))


def report_command(argv) -> int:
    """``kvguard report``: exit 0 when no violation was found, 1 when some were."""
    from ..cli import Parser, UsageError
    parser = Parser(prog="kvguard report", description=(
        "Merge the JSON lines that staging (KVGUARD=1, kvguard run) wrote in many processes "
        "into one summary: per kind, per allocator, top call sites, and the first report of "
        "each kind in full. Exit status 1 when violations were found."))
    parser.add_argument("paths", nargs="+", metavar="DIR|FILE",
                        help=f"directories (searched for {DESCRIPTION}; one per host is fine) "
                             "and files")
    parser.add_argument("--since", metavar="TIME",
                        help="only records written since TIME: an ISO time (2026-12-01T09:30, "
                             "...Z for UTC) or a span back from now (30m, 2h, 7d)")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    parser.add_argument("--top", type=int, default=10, metavar="N",
                        help="call sites to list (default 10)")
    args = parser.parse_args(argv)
    try:
        cutoff = parse_since(args.since) if args.since is not None else None
        files = collect_files(args.paths)
    except ValueError as exc:
        raise UsageError(f"kvguard report: error: {exc}") from None
    if not files:
        raise UsageError(f"kvguard report: error: no *.jsonl files in {' '.join(args.paths)} "
                         "(nor gzipped or rotated ones)")
    records = load(files)
    if not (records.violations or records.stats or records.starts):
        first = ""
        if records.problems:
            path, line, why = records.problems[0]
            first = (f" ({records.skipped} line(s) skipped; first: "
                     f"{path}{':' + str(line) if line else ''}: {why})")
        raise UsageError(f"kvguard report: error: no kvguard records in {len(files)} "
                         f"file(s){first}")
    if cutoff is not None:
        records = since(records, cutoff)
    summary = summarize(records, top=max(args.top, 0))
    if args.format == "json":
        json.dump(_jsonable(summary), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(summary) + "\n")
    return 1 if summary["violations"] else 0
