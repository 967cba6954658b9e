"""Verdicts on reports, and the run's results: terminal summary and JSON report.

Everything the summary shows comes off the test reports (``report.kvguard``, a JSON-ready dict,
and the ``kvguard_violations`` / ``kvguard_leaks`` user properties) plus what each process
adds at its end (violations outside any test, counters per allocator class). pytest-xdist
carries both to its controller (reports as they come, the rest in ``workeroutput``), so a run
with ``-n 2`` sums up exactly as a run without.
"""

from __future__ import annotations

import json
import os
from collections import Counter

from kvguard.violation import Violation

from .expect import kvguard_errors
from .leaks import OUTSIDE_TESTS

MAX_LISTED = 40
"""Tests listed by name in the terminal summary; the JSON report has them all."""

_REASONS = {
    "raise": "raised into the code under test, which caught it",
    "log": "recorded in log mode, the call went through",
    "repair": "recorded in repair mode, a sanitized call went through",
}


class _Crash:
    """The one line pytest's short summary and junitxml's message attribute show."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.path = ""
        self.lineno = 0


class KVGuardRepr:
    """A report's failure text: kvguard's own reports, not a Python traceback."""

    def __init__(self, text: str, message: str) -> None:
        self.text = text
        self.reprcrash = _Crash(message)

    def toterminal(self, tw) -> None:
        for line in self.text.splitlines():
            tw.line(line, red=line.startswith("==") or line.startswith("SUMMARY:"),
                    bold=line.startswith("kvguard:"))

    def __str__(self) -> str:
        return self.text


# --- on each report -------------------------------------------------------------------------


def render(violation) -> str:
    """The report, or as much as can be said if rendering it fails (a test may have
    monkeypatched kvguard itself): the plugin never turns a violation into a pytest crash."""
    try:
        return violation.render()
    except Exception as exc:
        return (f"kvguard: {getattr(violation, 'kind', '?')} of "
                f"{list(getattr(violation, 'block_ids', ()))} "
                f"on {getattr(violation, 'allocator_name', '?')} (its report could not be "
                f"rendered: {exc!r})")


def as_dict(violation, **more) -> dict:
    try:
        d = violation.to_dict()
    except Exception as exc:
        d = {"kind": getattr(violation, "kind", "?"),
             "block_ids": list(getattr(violation, "block_ids", ())),
             "message": f"(to_dict() failed: {exc!r})",
             "allocator": {"class": getattr(violation, "allocator", ""),
                           "name": getattr(violation, "allocator_name", ""),
                           "address": getattr(violation, "allocator_address", "")},
             "call_stack": [], "expected": getattr(violation, "expected", False),
             "summary": f"SUMMARY: kvguard: {getattr(violation, 'kind', '?')}"}
    d.update(more)
    return d


def _headline(violation) -> str:
    try:
        return violation.headline()
    except Exception:
        return f"{getattr(violation, 'kind', '?')} on {getattr(violation, 'allocator_name', '?')}"


def judge(report, call, records, problems, leaks, leak_mode, *, style: str = "full") -> None:
    """Put this phase's findings on its report; fail it if something unexpected happened.

    A report that passed becomes failed with kvguard's reports as its text; one that failed or
    was skipped already keeps its own text, and gets what it does not show yet in a
    ``kvguard`` section."""
    report.kvguard = {
        "violations": [as_dict(r.violation, when=r.when) for r in records],
        "leaks": [as_dict(v, when="teardown", mode=leak_mode) for v in leaks],
    }
    unexpected = [r for r in records if not r.violation.expected]
    failing = list(leaks) if leak_mode == "fail" else []
    if not (unexpected or problems or failing):
        return
    report.kvguard["failed"] = True
    shown, alongside = set(), set()
    if call.excinfo is not None:
        for error in kvguard_errors(call.excinfo.value):
            shown.add(id(error.violation))
            alongside.update(id(v) for v in getattr(error, "others", ()))
    alongside -= shown
    violations = [r.violation for r in unexpected] + failing
    first = f"kvguard: {_headline(violations[0])}" if violations else problems[0]
    more = len(violations) + len(problems) - 1
    first += f" (and {more} more)" if more > 0 else ""
    parts = []
    if unexpected:
        modes = sorted({r.mode for r in unexpected
                        if id(r.violation) not in shown and id(r.violation) not in alongside})
        reasons = [_REASONS.get(m, m) for m in modes]
        together = sum(1 for r in unexpected if id(r.violation) in alongside)
        if together:
            reasons.append(f"{together} raised with the one above, by the same call")
        why = "; ".join(reasons)
        n = len(unexpected)
        parts.append(
            f"{n} violation{'s' if n > 1 else ''} in the {call.when} phase of this test"
            + (f" ({why})" if why else "")
            + ". A misuse the test means to cause is marked expected by "
              "pytest.raises(kvguard.KVGuardError) or the kvguard fixture's expect(kind).")
    parts += [p for p in problems if p != first]
    if failing:
        blocks = sum(len(v.block_ids) for v in failing)
        parts.append(f"This test leaked {blocks} block(s), and leaks fail tests in this run.")
    lines = [summary_line(as_dict(v)) for v in violations] + problems
    if style == "short":
        text = "\n".join([first, *parts, ""] + [_short(v) for v in violations]
                         + ["(--kvguard-report=full shows the whole reports)"])
        if report.passed or shown:  # the traceback would print the raised report in full
            report.outcome = "failed"
            report.longrepr = KVGuardRepr(text, first)
        else:
            report.sections.append(("kvguard", text))
        return
    if report.passed:
        report.outcome = "failed"
        text = "\n".join([first, *parts]) + "".join("\n\n" + render(v) for v in violations)
        report.longrepr = KVGuardRepr(text, first)
        report.sections.append(("kvguard", "\n".join(lines)))
    else:
        unseen = [v for v in violations if id(v) not in shown]
        body = "\n".join(parts) + "".join("\n\n" + render(v) for v in unseen)
        report.sections.append(("kvguard", body if unseen else "\n".join(lines)))


def _short(violation) -> str:
    """A violation in two lines, as ``--kvguard-report=short`` shows it: its headline and its
    SUMMARY line (the kind and the call site a script greps)."""
    try:
        return f"{violation.headline()}\n  {violation.summary()}"
    except Exception:
        return _headline(violation)


def add_properties(item, report, records, leaks) -> None:
    """The test's totals as user properties: junitxml writes them as ``<property>``, and they
    reach the xdist controller with the report."""
    if not (records or leaks):
        return
    props = []
    unexpected = sum(1 for r in records if not r.violation.expected)
    if unexpected:
        props.append(("kvguard_violations", unexpected))
    if leaks:
        props.append(("kvguard_leaks", sum(len(v.block_ids) for v in leaks)))
    for prop in props:
        item.user_properties.append(prop)
        report.user_properties.append(prop)


def leak_warning(leaks) -> str:
    parts = []
    for v in leaks:
        frames = as_dict(v)["call_stack"]
        at = f", handed out at {_where(frames[0])}" if frames else ""
        parts.append(f"{len(v.block_ids)} block(s) of {v.allocator_name}{at}")
    return ("kvguard: this test never freed " + "; ".join(parts)
            + " (--kvguard-leaks=fail to fail it, off to ignore)")


def outside_entry(where: str, violation: Violation, worker) -> dict:
    return as_dict(violation, where=where, worker=worker)


def summary_line(v: dict) -> str:
    """``duplicate-id of block 0 on LinkedFreeList#2 at test_x.py:12 in test_free``."""
    ids = v.get("block_ids") or []
    of = (f" of block {ids[0]}" if len(ids) == 1 else f" of {len(ids)} blocks" if ids else "")
    at = f" at {_where(v['call_stack'][0])}" if v.get("call_stack") else ""
    return f"{v['kind']}{of} on {v['allocator']['name']}{at}"


def _list_leaks(tr, leaks) -> None:
    for v in leaks[:MAX_LISTED]:
        at = f" handed out at {_where(v['call_stack'][0])}" if v["call_stack"] else ""
        tr.write_line(f"  {v['nodeid']}: {len(v['block_ids'])} block(s) of "
                      f"{v['allocator']['name']}{at}")
    if len(leaks) > MAX_LISTED:
        tr.write_line(f"  ... and {len(leaks) - MAX_LISTED} more")


def _where(frame: dict) -> str:
    return f"{frame['file']}:{frame['line']} in {frame['function']}"


# --- the run --------------------------------------------------------------------------------


class Results:
    """What the whole run found, gathered from reports and process ends."""

    def __init__(self) -> None:
        self.violations: list[dict] = []
        self.leaks: list[dict] = []
        self._outside_leaks: set = set()
        self.failed: dict[str, set] = {}
        self.outside: dict[tuple, dict] = {}
        self.allocators: dict[str, dict] = {}
        self.report_error: str | None = None
        self.sites_full = False
        self.misfits: dict[str, str] = {}
        """Dotted name -> a registered spec that fits nothing of its class (kvguard.registry)."""

    def add_report(self, report) -> None:
        payload = getattr(report, "kvguard", None)
        if not payload:
            return
        for v in payload.get("violations", ()):
            self.violations.append(dict(v, nodeid=report.nodeid))
        for v in payload.get("leaks", ()):
            self.leaks.append(dict(v, nodeid=report.nodeid))
        if payload.get("failed"):
            self.failed.setdefault(report.nodeid, set()).add(report.when)

    def add_leaks(self, entries) -> None:
        """Leaks judged at a process's end (``--kvguard-leaks=summary``), with their nodeid.
        Workers each import the same modules: blocks one takes at import time arrive once per
        worker, and are counted once."""
        for entry in entries:
            if entry["nodeid"] == OUTSIDE_TESTS:
                key = (entry.get("summary"), tuple(entry.get("block_ids", ())))
                if key in self._outside_leaks:
                    continue
                self._outside_leaks.add(key)
            self.leaks.append(entry)

    def add_outside(self, entries) -> None:
        """Workers each collect the same modules: one misuse at import time arrives once
        per worker, and is shown once."""
        for entry in entries:
            key = (entry.get("where"), entry["kind"], tuple(entry.get("block_ids", ())),
                   entry.get("summary"))
            kept = self.outside.setdefault(key, dict(entry, workers=[]))
            if entry.get("worker") is not None:
                kept["workers"].append(entry["worker"])

    def add_counters(self, table: dict) -> None:
        for cls, entry in table.items():
            mine = self.allocators.setdefault(cls, {"violations": {}})
            for name, value in entry.items():
                if name == "violations":
                    for kind, n in value.items():
                        mine["violations"][kind] = mine["violations"].get(kind, 0) + n
                else:
                    mine[name] = mine.get(name, 0) + value

    def outside_unexpected(self) -> list[dict]:
        return [e for e in self.outside.values() if not e.get("expected")]

    def _totals(self) -> dict:
        unexpected = [v for v in self.violations if not v.get("expected")]
        return {
            "allocators_guarded": sum(e.get("guards", 0) for e in self.allocators.values()),
            "alloc_calls": sum(e.get("alloc_calls", 0) for e in self.allocators.values()),
            "free_calls": sum(e.get("free_calls", 0) for e in self.allocators.values()),
            "share_calls": sum(e.get("share_calls", 0) for e in self.allocators.values()),
            "internal_errors": sum(e.get("internal_errors", 0)
                                   for e in self.allocators.values()),
            "violations": len(unexpected) + len(self.outside_unexpected()),
            "violations_by_kind": dict(Counter(v["kind"] for v in unexpected)
                                       + Counter(v["kind"] for v in self.outside_unexpected())),
            "expected_violations": len(self.violations) - len(unexpected),
            "tests_with_violations": len({v["nodeid"] for v in unexpected}),
            "leaked_blocks": sum(len(v["block_ids"]) for v in self.leaks),
            "tests_with_leaks": len({v["nodeid"] for v in self.leaks
                                     if v["nodeid"] != OUTSIDE_TESTS}),
            "tests_failed_by_kvguard": sorted(self.failed),
            "site_table_full": self.sites_full,
        }

    def write_json(self, path: str, settings) -> None:
        from kvguard import __version__

        data = {
            "kvguard": __version__,
            "settings": {"mode": settings.mode, "stacks": settings.stacks,
                         "leaks": settings.leaks},
            "summary": self._totals(),
            "allocators": self.allocators,
            "violations": self.violations,
            "leaks": self.leaks,
            "outside": list(self.outside.values()),
        }
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1, default=repr)
            os.replace(tmp, path)
        except OSError as exc:
            self.report_error = f"kvguard: could not write the JSON report to {path}: {exc}"
            if os.path.isfile(tmp):
                os.remove(tmp)

    def summary(self, tr, settings) -> None:
        t = self._totals()
        n_guards = t["allocators_guarded"]
        classes = ", ".join(f"{e.get('guards', 0)} {cls.rpartition('.')[2]}"
                            for cls, e in sorted(self.allocators.items()) if e.get("guards"))
        head = (f"kvguard: {n_guards} allocator{'s' if n_guards != 1 else ''} guarded"
                + (f" ({classes})" if classes else "")
                + f", {t['alloc_calls']} alloc / {t['free_calls']} free calls")
        expected = t["expected_violations"]
        clean = not (t["violations"] or self.leaks or t["internal_errors"] or self.sites_full
                     or self.misfits)
        if clean:
            tail = ": no violations, no leaks"
            if expected:
                tail += f" ({expected} expected violation{'s' if expected > 1 else ''})"
            tr.write_line(head + tail)
            self._report_line(tr, settings)
            return
        tr.write_sep("=", "kvguard")
        tr.write_line(head)
        for cls, e in sorted(self.allocators.items()):
            kinds_ = ", ".join(f"{k} {n}" for k, n in sorted(e.get("violations", {}).items()))
            tr.write_line(f"  {cls}: {e.get('guards', 0)} guarded, {e.get('alloc_calls', 0)} "
                          f"alloc / {e.get('free_calls', 0)} free / {e.get('share_calls', 0)} "
                          f"share calls" + (f"; violations: {kinds_}" if kinds_ else ""))
        unexpected = [v for v in self.violations if not v.get("expected")]
        if t["violations"]:
            by_kind = ", ".join(f"{k} {n}" for k, n in sorted(t["violations_by_kind"].items()))
            where = []
            if t["tests_with_violations"]:
                where.append(f"in {t['tests_with_violations']} test(s)")
            if self.outside_unexpected():
                where.append(f"{len(self.outside_unexpected())} outside any test")
            tr.write_line(f"violations: {t['violations']} ({by_kind}), {', '.join(where)}"
                          + (f"; {expected} more were expected" if expected else ""),
                          red=True, bold=True)
            for v in unexpected[:MAX_LISTED]:
                tr.write_line(f"  {v['nodeid']} [{v['when']}]: {summary_line(v)}")
            if len(unexpected) > MAX_LISTED:
                tr.write_line(f"  ... and {len(unexpected) - MAX_LISTED} more "
                              "(--kvguard-report=PATH lists them all)")
        per_test = [v for v in self.leaks if v.get("mode") != "summary"]
        if per_test:
            modes = sorted({v.get("mode") for v in per_test})
            blocks = sum(len(v["block_ids"]) for v in per_test)
            tests = len({v["nodeid"] for v in per_test})
            tr.write_line(f"leaks ({', '.join(modes)}): {blocks} block(s) in "
                          f"{tests} test(s) still live after teardown",
                          yellow="fail" not in modes, red="fail" in modes)
            _list_leaks(tr, per_test)
        late = [v for v in self.leaks if v.get("mode") == "summary"]
        if late:
            blocks = sum(len(v["block_ids"]) for v in late)
            tr.write_line(f"leaks (summary): {blocks} block(s) still live at the end of the run, "
                          "on allocators that outlived the test that took them (or the "
                          "session's own)", yellow=True)
            _list_leaks(tr, late)
        outside = self.outside_unexpected()
        if outside:
            tr.write_line(f"outside any test: {len(outside)} violation(s); they fail the run",
                          red=True, bold=True)
            for entry in outside:
                workers = f" (workers {', '.join(entry['workers'])})" if entry["workers"] else ""
                tr.write_line(f"\nduring {entry['where']}{workers}:")
                try:
                    text = render(Violation.from_dict(entry))
                except Exception:
                    text = summary_line(entry)
                for line in text.splitlines():
                    tr.write_line(line)
        for problem in self.misfits.values():
            tr.write_line(f"kvguard: configuration error: {problem}; its instances ran "
                          "unguarded (this fails the run)", red=True, bold=True)
        if t["internal_errors"]:
            tr.write_line(f"kvguard: {t['internal_errors']} internal error(s) in the guards: "
                          "those calls went through unchecked (see the 'kvguard' log)",
                          red=True)
        if self.sites_full:
            tr.write_line("kvguard: the call-site table filled up during the run: calls since "
                          "then kept their test but not their stacks, so later reports lack "
                          "allocation sites (split the run, or use --kvguard-stacks=off)",
                          yellow=True)
        self._report_line(tr, settings)

    def _report_line(self, tr, settings) -> None:
        if self.report_error:
            tr.write_line(self.report_error, red=True)
        elif settings.report:
            tr.write_line(f"kvguard: JSON report written to {settings.report}")
