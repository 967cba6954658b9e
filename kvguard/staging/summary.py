"""One summary from the JSON lines of many processes (``kvguard report``'s data; the text and
the command are ``kvguard.staging.report``).

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

import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from .. import kinds
from . import raysummary
from .logfiles import MAX_LINE_CHARS, bounded_lines, collect_files, open_log, rotation_set
from .records import (
    FORMAT_VERSION, as_data, is_bare_violation, is_kvguard, newer, parse, printable, problem,
)

__all__ = ["Records", "collect_files", "load", "normalized", "of_run", "since", "summarize"]


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
        self.problems.append((printable(path), line, printable(why)))


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
                for number, line in enumerate(bounded_lines(f), 1):
                    if line is None:
                        records.skip(path, number, f"longer than {MAX_LINE_CHARS:,} "
                                     "characters: skipped unread")
                        continue
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
    record["file"] = printable(path)
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
        return None, f"ill-formed {printable(str(record.get('event')))} record: {why}"
    return as_data(record), None


def _site(violation: dict) -> str:
    stack = violation.get("call_stack") or []
    if stack:
        top = stack[0]
        return f"{top.get('file')}:{top.get('line')} in {top.get('function')}"
    summary = violation.get("summary") or ""
    where = summary.replace(f"SUMMARY: kvguard: {violation['kind']}", "").strip()
    return where or "<no stack recorded>"


UNLOGGED_SITE = "(occurrences between logged lines, at the call sites above)"
"""Where ``top_sites`` puts what a guard's exact count adds to its lines' occurrences when
the kind was logged at several call sites of that guard (which of them is not known)."""


def _site_counts(occurrences: dict, counts: Counter) -> dict:
    """``(process, guard, kind, site) -> count``, adding up per kind to ``counts`` (what
    ``by_kind`` shows): the lines' occurrence numbers are lower bounds, and a guard's exact
    figure (its stats line) goes to the call site when the kind was logged at one site of
    that guard, else the rest to ``UNLOGGED_SITE``."""
    out = dict(occurrences)
    logged: dict = defaultdict(list)
    for proc, name, kind, site in occurrences:
        logged[(proc, name, kind)].append(site)
    for key, total in counts.items():
        seen = logged.get(key, [])
        rest = total - sum(occurrences[(*key, site)] for site in seen)
        if rest <= 0:
            continue
        where = seen[0] if len(seen) == 1 else UNLOGGED_SITE
        out[(*key, where)] = out.get((*key, where), 0) + rest
    return out


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
    final: set = set()                     # (proc, guard) with a final stats line
    for rec in records.stats:
        key = (rec["process"], (rec.get("guard") or {}).get("name", ""))
        guard_info[key] = {**guard_info.get(key, {}), **(rec.get("guard") or {})}
        stats[key] = rec.get("stats") or {}  # the last one: checkpoints, then the final line
        if rec.get("final") is not False:
            final.add(key)
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
            if key not in final:
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
    for (proc, name, kind, site), n in _site_counts(occurrences, counts).items():
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

    ray_of = raysummary.contexts(records)
    ended = raysummary.endings(records)
    calls: Counter = Counter()
    for (proc, _name), s in stats.items():
        calls[proc] += sum(s.get(k, 0) for k in ("alloc_calls", "free_calls", "share_calls"))
    found_in: dict = defaultdict(Counter)
    for (proc, _name, kind), c in counts.items():
        found_in[proc][kind] += c

    def proc_dict(proc):
        host, pid, _started, path = proc
        out = {"host": host, "pid": pid, "file": path, "argv": processes[proc]["argv"],
               "violations": sum(found_in[proc].values()), "final": ended.get(proc)}
        if proc in ray_of:
            out["ray"] = ray_of[proc]
        return out

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
        "by_ray_actor": raysummary.by_actor(ray_of, ended, calls, found_in),
        "by_ray_node": raysummary.by_node(ray_of, found_in),
        "top_sites": [{**e, "processes": len(e["processes"])} for e in top_sites],
        "first": {k: {"pid": rec.get("pid"), "host": rec.get("host", ""), "file": rec["file"],
                      "guard": rec.get("guard") or {}, "violation": rec["violation"],
                      "ray": {**ray_of.get(rec["process"], {}), **(rec.get("ray") or {})}}
                  for k, rec in first.items()},
    }
