"""An escape written up: the calls it stopped, and a regression test that shows it without
stopping the suite that runs it.

The test repeats the calls, then makes the one that escaped so that it cannot take the test
run with it: a ``SystemExit``, ``KeyboardInterrupt`` (which would end pytest's whole session)
or ``GeneratorExit`` is caught and failed as an assertion; a hang is stopped by a SIGALRM
timer of the test's own after the fuzzer's ``hang`` seconds. A fork gets no test (the test run
itself would be forked), nor does an escape outside a call the test can repeat (the free count
read, the harm shown). Like every emitted test it is checked before it is shown, contained:
one that passes on the allocator is not shown. The hang test is not run here (it would take
its whole timeout): it is said so.
"""

from __future__ import annotations

import re
import textwrap

from .contain import Escape, contained


def write_up(escape: Escape, make: str | None, seed: int, hang: float, factory=None,
             cls=None) -> Escape:
    """Fill in ``escape``'s calls and test (in place); returns it."""
    run = escape.run
    escape.run = None  # the report keeps no live allocator
    if run is not None and getattr(run, "steps", None):
        from .findings import describe
        calls = describe(run)
        calls[-1] = calls[-1].split(" -> ")[0] + "  <- escaped here"
        escape.calls = calls
    if escape.kind == "fork":
        escape.test_note = "a test would fork the test run itself"
        return escape
    if escape.where.startswith("its factory"):
        cls = cls or (type(run.allocator) if run is not None else None)
        text = _factory_test(escape, make, seed, hang, cls)
    elif run is not None and getattr(run, "steps", None):
        text = _call_test(escape, run, make, seed, hang)
        cls = type(run.allocator)
    else:
        text = ""
    if not text:
        escape.test_note = escape.test_note or ("it escaped outside a call the test can "
                                                "repeat")
        return escape
    if escape.kind == "hang":
        escape.test, escape.test_note = text, (f"stops itself after {hang:g} s; not run here, "
                                               "it would take that long")
        return escape
    from .findings import fails
    ok, again = contained(lambda: fails(text, cls, factory), hang=hang)
    if again is None and ok:
        escape.test, escape.test_note = text, "fails on the allocator as it is"
    else:
        escape.test_note = "none could show it standing alone"
    return escape


def _doc(escape: Escape, seed: int) -> str:
    rule = ("Every call must return within reasonable time." if escape.kind == "hang" else
            "Every call must return, or raise an Exception: SystemExit, KeyboardInterrupt "
            "and GeneratorExit end whatever runs the allocator (a server, a test run).")
    paragraphs = [f"kvguard conformance: {escape.text}.",
                  f"{rule} Found by kvguard.testing (seed {seed})."]
    return "\n\n".join(textwrap.fill(p, 88) for p in paragraphs) + "\n"


def _name(cls_name: str, escape: Escape) -> str:
    place = re.sub(r"\W+", "_", escape.where.split("(")[0] if not escape.where.startswith(
        "its factory") else "factory").strip("_").lower() or "call"
    return f"test_{cls_name.lower()}_{escape.kind.replace('-', '_')}_in_{place}"


def _guarded(call: str, escape: Escape, hang: float) -> list:
    what = escape.where if not escape.where.startswith("its factory") else "building it"
    if escape.kind == "hang":
        message = f"{what} did not return within {hang:g} s: the allocator hangs"
        return ["", "def hung(signum, frame):", f"    raise AssertionError({message!r})", "",
                "old = signal.signal(signal.SIGALRM, hung)",
                f"signal.setitimer(signal.ITIMER_REAL, {hang!r})",
                "try:", f"    {call}", "finally:",
                "    signal.setitimer(signal.ITIMER_REAL, 0)",
                "    signal.signal(signal.SIGALRM, old)"]
    prefix = f"{what} raised "
    return ["try:", f"    {call}", "except Exception:",
            "    pass  # an error is the allocator's to raise; ending its caller is not",
            "except BaseException as exc:",
            f"    raise AssertionError({prefix!r} + repr(exc) + ': it ends its caller') "
            "from None"]


def _factory_test(escape: Escape, make, seed, hang, cls) -> str:
    if not make or cls is None:
        return ""
    from .regression import docstring_literal, validated
    imports = ["import signal"] if escape.kind == "hang" else []
    if cls.__module__ not in ("__main__", "builtins"):
        imports.append(f"from {cls.__module__} import {cls.__qualname__.split('.')[0]}")
    name, doc = _name(cls.__name__, escape), _doc(escape, seed)
    body = [docstring_literal(doc)] + _guarded(f"a = {make}", escape, hang)
    text = ("\n".join(imports) + "\n\n\n" if imports else "") + f"def {name}():\n"
    text += textwrap.indent("\n".join(body), "    ") + "\n"
    try:
        return validated(text, name, doc)
    except ValueError:
        return ""


def _call_test(escape: Escape, run, make, seed, hang) -> str:
    from .probes import PROBES
    from .regression import Writer, validated
    writer = Writer(run, make)
    steps = run.steps
    for s in steps[:-1]:
        writer.step(s, False, False)
    last = steps[-1]
    if last.op == "allocate":
        call = writer.call("allocate", n=last.n)
    elif last.op in PROBES:
        writer.emit(f"bad = {writer.value(last)}")
        call = writer.source["release"].format(obj="bad") if last.via_release \
            else writer.call("free", "bad")
    elif last.op in ("free", "share"):
        call = writer.call(last.op, writer.value(last))
    else:
        return ""
    method = escape.where.split("(")[0].rsplit(".", 1)[-1]
    if f".{method}(" not in call:
        escape.test_note = f"it escaped in {escape.where}, outside the call the test repeats"
        return ""
    if escape.kind == "hang":
        writer.imports.add("import signal")
    for line in _guarded(call, escape, hang):
        writer.emit(line)
    name, doc = _name(type(run.allocator).__name__, escape), _doc(escape, seed)
    try:
        return validated(writer.assemble(name, doc), name, doc)
    except ValueError:
        return ""
