"""A broken clause made a finding: its calls, the harm shown after the break, and a
regression test that is run against the allocator before it is shown.

A test that would pass on the allocator as it is shows nothing, so it is not emitted (the
finding says no standalone test could show it). The test is run in this process with the
allocator's class (and, when the factory could not be written as an expression, the factory
itself) bound in its namespace, with instrumentation paused so that a guard never stands
between the test and the allocator.
"""

from __future__ import annotations

from . import harm as harms
from .clauses import CLAUSES, Broken, requirement
from .contain import note
from .probes import PROBES
from .judge import judge
from .run import Run
from .report import Finding


def describe(run: Run) -> list:
    """The steps of ``run`` as calls on ``a``, with what each returned or raised."""
    from .regression import Writer
    writer = Writer(run, None)
    calls = []
    for s in run.steps:
        if s.op == "refcount":
            calls.append(f"reference count of block {s.ids[0]} -> {s.outcome}  <- the harm")
            continue
        if s.op == "count":
            calls.append(f"free count -> {s.free_after} (the ledger: {s.expect_free})  "
                         "<- the harm")
            continue
        label = f"  <- the {s.op} call" if s.op in PROBES else ""
        if s.harm and s is run.steps[-1]:
            label = "  <- the harm"
        if s.op == "allocate":
            calls.append(f"{writer.call('allocate', n=s.n)} -> {s.outcome}{label}")
            continue
        value = s.form if s.form in ("bool-list", "bool") else ""
        shown = repr(s.value) if s.form == "bool" else f"{value} {s.ids}".strip()
        if s.form not in ("list", "bool", "bool-list"):
            shown = f"{s.form} {s.ids}"
        tail = f"; the caller then overwrites its tensor with {s.mutate_to}" \
            if s.mutate_to is not None else ""
        call = writer.call("free" if s.op in PROBES else s.op, shown) if not s.via_release \
            else writer.source["release"].format(obj=writer.item(s.value))
        calls.append(f"{call} -> {s.outcome}{tail}{label}")
    return calls


def finding(run: Run, clause: str, promised: bool, make, seed, *, tier="promise",
            rejects_with="", factory=None) -> Finding:
    """The finding for ``run``, which broke ``clause``: the harm shown, the test checked."""
    broken: Broken = run.steps[-1].broken
    if broken.check in CLAUSES and not CLAUSES[broken.check].probe:
        harm = harms.of_break(run, broken)  # a valid call shows it (or a later one did)
    else:
        run, harm = _harm_of(run, factory)
    from .regression import regression_test
    test = regression_test(run, make=make, origin=f"Found by kvguard.testing (seed {seed}).",
                           rejects_with=rejects_with, harm=harm.text if harm else "")
    if not fails(test, type(run.allocator), factory):
        test = ""
    return Finding(clause, promised, broken.did, broken.required or requirement(clause,
                   run.spec), describe(run), test, harm=harm.text if harm else "",
                   harm_key=harm.key if harm else (), tier=tier)


def _harm_of(run: Run, factory):
    """Drive on from the break: on a replay first with an allocation per count (the shorter
    test), when that shows a block handed out twice or not a block; else one block at a time
    on ``run`` itself. A harm the same calls show without the bad one is not its harm."""
    if factory is not None:
        replay = judge(factory, run.spec, run.ops, run.steps[-1].broken.clause, run.driver)
        if replay is not None:
            harm = harms.drive_on(replay, batched=True)
            if harm is not None and harm.kind in (harms.TWO_OWNERS, harms.NOT_A_BLOCK,
                                                  harms.NEGATIVE_COUNT) \
                    and not _shown_without(replay, factory, harm):
                return replay, harm
    harm = harms.drive_on(run)
    if harm is not None and factory is not None and _shown_without(run, factory, harm):
        harm = None
    return run, harm


def _shown_without(run: Run, factory, harm) -> bool:
    """Whether the same calls without the bad one end on the same harm: then it is the
    allocator's with or without the bad call, and not the bad call's to show."""
    note()
    control = Run(factory(), run.spec, run.driver, dry=True)
    try:
        control.run(run.ops)
        again = harms.drive_on(control)
    except Exception:
        return False
    return again is not None and again.key == harm.key


def fails(test: str, cls: type, factory=None) -> bool:
    """Whether ``test`` fails on ``cls`` as it is: by an assertion, pytest's "DID NOT RAISE",
    or the allocator's own error, never by a mistake of the test (a name it lacks)."""
    import pytest

    from ..registry import unguarded
    lines = test.splitlines()
    own = f"from {cls.__module__} import {cls.__qualname__.split('.')[0]}"
    namespace = {cls.__name__: cls, "make_allocator": factory}
    code = "\n".join(line for line in lines if line != own)
    try:
        exec(compile(code, "<emitted>", "exec"), namespace)
    except Exception:
        return False
    tests = [f for name, f in namespace.items() if name.startswith("test_") and callable(f)]
    if len(tests) != 1:
        return False
    note()
    try:
        with unguarded():
            tests[0]()
    except (NameError, ImportError, SyntaxError, UnboundLocalError):
        return False
    except (Exception, pytest.fail.Exception):
        return True
    return False


def contract_error(factory, spec, driver) -> str:
    """The built-in exception class the allocator raises, by a ``raise`` of its own, to reject
    the plainest bad free (a block freed twice or past zero, else an id past the pool) and
    atomically: the class its contract names, which the emitted tests then expect ("" when
    there is none: an ``IndexError`` out of numpy's indexing names no contract)."""
    release = "release-past-zero" if spec.refcounted else "double-free"
    for ops in ([("allocate", 1), ("free", (0,)), (release, (0,), 0)],
                [("invalid-id", (0,), 1)]):
        try:
            note()
            run = Run(factory(), spec, driver, checks=())
            note(run)
            run.run(ops)
        except Exception:
            continue
        step = run.steps[-1] if run.steps else None
        if step is None or step.error is None or not step.rejected:
            continue
        error = step.error
        if type(error).__module__ == "builtins" and not isinstance(error, AssertionError) \
                and step.free_after == step.free_before and _raised_by_own_code(error):
            return type(error).__name__
    return ""


def _raised_by_own_code(error: BaseException) -> bool:
    import linecache
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    line = linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).strip()
    return line.startswith("raise ")
