"""The regression test a lifecycle finding emits: the shrunk events as the engine's own calls,
the invariants checked after each one, and no kvguard import.

The driver supplies the words: ``imports`` (the engine's modules, its test utilities),
``make_source()`` (the expression building the engine as the fuzzer built it),
``helpers``
(plain functions reading the engine, the same ones the driver calls, pasted by source) and
``event_source(event)`` (one event as a statement on ``engine``; for ``("schedule", n)`` the call
alone, which the test assigns to ``s<n>`` when the step scheduled anything, n > 0).
``check_invariants`` is pasted
as well, so the test checks exactly what the fuzzer checked.
"""

from __future__ import annotations

import inspect
import re

from .lifecycle import check_invariants

HELPER_NAMES = ("tables", "refcount", "generation", "reads", "held")


def _helper(driver, role: str) -> str:
    for fn in driver.helpers:
        if fn.__name__.endswith(f"_{role}"):
            return fn.__name__
    raise ValueError(f"{type(driver).__name__}.helpers has no *_{role} function")


def test_name(problem) -> str:
    return "test_lifecycle_" + re.sub(r"\W+", "_", problem.kind).strip("_")


def generic_test(driver, events: list, problem, origin: str = "") -> str:
    """The test source for ``events`` on ``driver``'s engine."""
    names = {role: _helper(driver, role) for role in HELPER_NAMES}
    outlive = bool(driver.leases_outlive_requests)
    lines = [f'"""{problem.kind} in {driver.name}: {problem.message}.', "",
             f"{origin or 'Found by kvguard lifecycle fuzzing.'} Uses only the engine; the "
             "invariants are checked after every event.", '"""', ""]
    lines += [driver.imports, "", ""]
    for fn in (check_invariants, *driver.helpers):
        lines += [inspect.getsource(fn).rstrip(), "", ""]
    transfers = getattr(driver, "transfers_source", "None")
    lines += [f"def {test_name(problem)}():",
              f"    engine = {driver.make_source()}",
              "    leases = {}"]
    lines += [f"    {line}" for line in getattr(driver, "setup_source", ())]
    lines += ["",
              "    def check():",
              f"        problem = check_invariants({names['tables']}(engine),",
              f"                                   lambda b: {names['refcount']}(engine, b),",
              f"                                   leases, lambda rid: {names['generation']}"
              "(engine, rid),",
              f"                                   {outlive}, {names['held']}(engine), "
              f"{transfers})",
              "        assert problem is None, problem[2]",
              ""]
    for event in events:
        if event[0] == "end":
            lines.append(f"    assert not {names['held']}(engine), "
                         f"f\"blocks still held: {{{names['held']}(engine)}}\"")
            continue
        statement = driver.event_source(event)
        if not statement:
            continue
        if event[0] == "schedule" and event[1]:
            statement = f"s{event[1]} = {statement}"
        lines.append(f"    {statement}")
        extra = getattr(driver, "schedule_extra", None)
        if event[0] == "schedule" and extra is not None:
            lines.append(f"    {extra(event[1])}")
        if event[0] == "schedule" and event[1]:
            step = event[1]
            lines.append(f"    leases[{step}] = {{rid: ({names['generation']}(engine, rid), ids)"
                         f" for rid, ids in {names['reads']}(engine, s{step}).items()}}")
        elif event[0] == "process":
            lines.append(f"    leases.pop({event[1]}, None)")
            extra = getattr(driver, "process_extra", None)
            if extra is not None:
                lines.append(f"    {extra(event[1])}")
        lines.append("    check()")
    return "\n".join(lines) + "\n"
