"""``kvguard report DIR|FILES...``: the merged summary of many processes' JSON lines, as text
(per kind, per allocator, top call sites, the first report of each kind in full) or JSON.
"""

from __future__ import annotations

import json
import sys
import time

from . import raysummary
from .logfiles import DESCRIPTION, collect_files, parse_since
from .records import FORMAT_VERSION, printable
from .summary import MAX_PROBLEMS_LISTED, load, since, summarize


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
    lines += raysummary.render(summary)
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
    unfinished = raysummary.unfinished_note(summary)
    if unfinished:
        notes.append(unfinished)
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
        ray = raysummary.first_label(first.get("ray"))
        lines += ["", f"first {kind} (pid {first['pid']}{ray}, {when}, {first['file']}):",
                  v.render()]
        g = first["guard"]
        if g.get("learning") or g.get("learned"):
            lines.append(f"note: {g.get('name', 'this guard')} attached to an allocator with "
                         f"blocks out and had learned {g.get('learned', 0)} id(s) lazily")
    return "\n".join(lines)


def jsonable(summary: dict) -> dict:
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
    skipped = []
    try:
        cutoff = parse_since(args.since) if args.since is not None else None
        files = collect_files(args.paths, skipped)
    except ValueError as exc:
        raise UsageError(f"kvguard report: error: {printable(str(exc))}") from None
    for path, why in skipped:  # a FIFO, a device, a symlink out of the directory
        sys.stderr.write(f"kvguard report: {printable(path)}: {printable(why)}\n")
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
        json.dump(jsonable(summary), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(summary) + "\n")
    return 1 if summary["violations"] else 0
