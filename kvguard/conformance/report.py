"""What ``check_allocator`` found, as text, a dict (``--format json``) and JUnit XML.

One finding per bug: clauses whose runs end on the same harm (``kvguard.conformance.harm``)
are one finding, the others named under it as the same bug. Findings of the robustness tier
(values outside a typed API's declared input) are listed apart and never fail a check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .clauses import CLAUSES

# Which clause of a group names the bug: the plainest misuse that reaches it.
_ORDER = ("double-free", "release-past-zero", "duplicate-id", "foreign-id", "invalid-id",
          "bool-id", "bool-mask", "tensor-id", "generator")


@dataclass
class Finding:
    """One bug, shown by the shortest call sequence of the clause that names it."""

    clause: str
    promised: bool
    did: str
    required: str
    calls: list
    """The calls, one line each, as ``repr``-like text (the bad call, then the harm)."""
    test: str
    """A pytest test that fails on the allocator as it is (checked before it is shown), and
    passes once it is fixed; empty when no standalone test could show it."""
    harm: str = ""
    """What the break corrupted, shown by driving on: two owners, a later error, a count."""
    harm_key: tuple = ()
    same_bug: list = field(default_factory=list)
    """Other clauses whose runs end on the same harm: the same bug, reached another way."""
    tier: str = "promise"
    """``promise`` or ``robustness`` (a value outside a typed API's declared input)."""

    def render(self) -> str:
        lines = [f"  {self.clause} ({CLAUSES[self.clause].summary})"]
        if self.same_bug:
            lines.append(f"    same bug: {', '.join(self.same_bug)} (their runs end on the "
                         "same harm)")
        lines.append("    calls (shrunk):")
        lines += [f"      {c}" for c in self.calls]
        lines += [f"    the allocator: {self.did}"]
        if self.harm:
            lines.append(f"    the harm: {self.harm}")
        lines += [f"    the contract: {self.required}"]
        if self.test:
            lines.append("    regression test (fails on the allocator as it is):")
            lines += [f"      {line}" if line else "" for line in self.test.splitlines()]
        else:
            lines.append("    regression test: none could show it standing alone")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"clause": self.clause, "promised": self.promised, "tier": self.tier,
                "did": self.did, "harm": self.harm, "required": self.required,
                "calls": list(self.calls), "same_bug": list(self.same_bug),
                "test": self.test}


def group(findings: list) -> list:
    """One finding per harm: the clause first in ``_ORDER`` names it, the rest are listed as
    the same bug. Findings without a harm stay apart."""
    out, by_key = [], {}
    for f in sorted(findings, key=lambda f: _ORDER.index(f.clause) if f.clause in _ORDER
                    else -1):
        head = by_key.get(f.harm_key) if f.harm_key else None
        if head is None:
            if f.harm_key:
                by_key[f.harm_key] = f
            out.append(f)
        else:
            head.same_bug.append(f.clause)
            head.promised = head.promised or f.promised
    order = list(CLAUSES)
    return sorted(out, key=lambda f: order.index(f.clause))


@dataclass
class ConformanceReport:
    """What ``check_allocator`` found."""

    allocator: str
    seed: int
    examples: int
    seconds: float
    findings: list = field(default_factory=list)
    """One per bug, robustness tier excluded."""
    passed: list = field(default_factory=list)
    not_run: list = field(default_factory=list)
    """``(clause, why)``: it does not apply, is off (robustness), never got to make its call,
    or the budget ran out before it finished."""
    robustness: list = field(default_factory=list)
    """Findings of the robustness tier: reported apart, never a broken promise."""
    harmless: list = field(default_factory=list)
    """Bad calls accepted (or not rejected atomically) where driving on showed no harm: told,
    never counted as a broken promise (a maintainer would ask what it breaks)."""
    escapes: list = field(default_factory=list)
    """What the allocator did to the process, contained (``kvguard.conformance.contain``): a
    hang, an exit, a ``KeyboardInterrupt``/``GeneratorExit``, a fork. Each fails the check."""
    interrupted: str = ""
    """Set when the user's Ctrl-C stopped the check: the report holds what finished."""

    @property
    def broken_promises(self) -> list:
        return [f for f in self.findings if f.promised]

    @property
    def unprotected(self) -> list:
        return [f for f in self.findings if not f.promised]

    @property
    def broken(self) -> set:
        """Every clause broken, the ones named as the same bug included."""
        return {c for f in self.findings for c in (f.clause, *f.same_bug)}

    def render(self) -> str:
        lines = [f"kvguard conformance: {self.allocator}: {len(self.broken_promises)} broken "
                 f"promise(s), {len(self.unprotected)} unprotected clause(s)"
                 + (f", {len(self.escapes)} escape(s)" if self.escapes else "")
                 + f"; {self.examples} examples per clause, seed {self.seed}, "
                 f"took {self.seconds:.2f} s" + (f"; {self.interrupted}" if self.interrupted
                                                 else "")]
        if self.escapes:
            lines += ["", "escaped the fuzzer (contained; each call must return, or raise an "
                      "Exception):"]
            lines += [e.render() for e in self.escapes]
        if self.broken_promises:
            lines += ["", "breaks a promise it makes:"]
            lines += [f.render() for f in self.broken_promises]
        if self.unprotected:
            lines += ["", "does not protect against (not promised):"]
            lines += [f.render() for f in self.unprotected]
        if self.robustness:
            lines += ["", "robustness (values outside its declared input; not a promise):"]
            lines += [f.render() for f in self.robustness]
        if self.harmless:
            lines += ["", "accepted without harm seen (driving on showed nothing; not counted):"]
            lines += [f"  {f.clause}: {f.did}; calls: {'; '.join(f.calls)}"
                      for f in self.harmless]
        if self.passed:
            lines += ["", f"keeps: {', '.join(self.passed)}"]
        if self.not_run:
            lines += [f"not run: {', '.join(f'{c} ({why})' for c, why in self.not_run)}"]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"allocator": self.allocator, "seed": self.seed, "examples": self.examples,
                "seconds": round(self.seconds, 3),
                "findings": [f.to_dict() for f in self.findings],
                "robustness": [f.to_dict() for f in self.robustness],
                "harmless": [f.to_dict() for f in self.harmless],
                "escapes": [e.to_dict() for e in self.escapes],
                "interrupted": self.interrupted,
                "passed": list(self.passed),
                "not_run": [{"clause": c, "why": why} for c, why in self.not_run]}

    def to_junit(self) -> str:
        """JUnit XML: a test case per clause; a broken promise fails, a clause not run is
        skipped, a clause named as the same bug fails with a pointer to its finding."""
        from xml.sax.saxutils import quoteattr

        def case(name, body=""):
            return f'    <testcase classname={quoteattr(self.allocator)} ' \
                   f'name={quoteattr(name)}>{body}</testcase>'

        cases = []
        for f in self.findings + self.robustness:
            kind = "failure" if f.promised and f.tier == "promise" else "skipped"
            text = _escape(f.render())
            cases.append(case(f.clause, f"<{kind} message={quoteattr(f.did)}>{text}</{kind}>"))
            for other in f.same_bug:
                cases.append(case(other, f"<{kind} message={quoteattr('same bug as ' + f.clause)}"
                                  f"/>"))
        for e in self.escapes:
            for c in e.clauses or ["escape"]:
                cases.append(case(c, f"<failure message={quoteattr(e.text)}>"
                                  f"{_escape(e.render())}</failure>"))
        cases += [case(c) for c in self.passed]
        cases += [case(c, f"<skipped message={quoteattr(why)}/>") for c, why in self.not_run]
        failures = sum("<failure" in c for c in cases)
        skipped = sum("<skipped" in c for c in cases)
        return ("<?xml version=\"1.0\" encoding=\"utf-8\"?>\n<testsuites>\n"
                f"  <testsuite name=\"kvguard conformance\" tests=\"{len(cases)}\" "
                f"failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\" "
                f"time=\"{self.seconds:.3f}\">\n" + "\n".join(cases)
                + "\n  </testsuite>\n</testsuites>\n")


def _escape(text: str) -> str:
    from xml.sax.saxutils import escape
    return escape(text)
