"""The lifecycle fuzzer's search: a hypothesis state machine whose rules are request events.

One ``Run`` is one fresh engine behind its driver, the events sent so far, the steps in flight
and their leases. After every event it checks ``check_invariants`` and the violations kvguard's
guard recorded on the engine's allocator; the first problem ends the run with a
``LifecycleViolation`` carrying the events, which hypothesis then shrinks to the fewest events
that still show a problem of the same kind.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .lifecycle import check_invariants


@dataclass
class Problem:
    """What broke: a kind (a kvguard violation kind, or ``engine-error`` for an exception the
    engine raised on a valid event sequence), the block, and one line that says it."""

    kind: str
    block: object
    message: str


class LifecycleViolation(Exception):
    """A run broke an invariant; ``events`` is the whole sequence that led there."""

    def __init__(self, problem: Problem, events: list) -> None:
        super().__init__(f"{problem.kind}: {problem.message}")
        self.problem = problem
        self.events = list(events)


@dataclass
class Run:
    """One event sequence on one fresh engine."""

    driver: object
    guard_mode: str = "raise"
    events: list = field(default_factory=list)
    in_flight: deque = field(default_factory=deque)
    leases: dict = field(default_factory=dict)
    requests: list = field(default_factory=list)
    steps: int = 0
    guard: object = None
    seen_violations: int = 0
    ignore: frozenset = frozenset()
    """Problem kinds not reported (known, triaged): the run goes on past them."""
    failed: bool = False

    def __post_init__(self) -> None:
        pool = self.driver.allocator()
        if pool is not None:
            import kvguard
            spec = getattr(self.driver, "allocator_spec", lambda: None)()
            self.guard = kvguard.guard(pool, spec, on_violation=self.guard_mode, stacks="off")

    # --- what the rules may do -------------------------------------------------------------

    def can_schedule(self) -> bool:
        limit = self.driver.max_in_flight if self.driver.async_scheduling else 1
        return len(self.in_flight) < limit

    def alive(self) -> list:
        return [rid for rid in self.requests if self.driver.generation(rid) is not None]

    # --- events ------------------------------------------------------------------------------

    def add(self, doc: int, length: int, max_tokens: int) -> None:
        rid = f"r{len(self.requests)}"
        self.requests.append(rid)
        length = self.driver.prompt_length(length)
        self._do(("add", rid, doc, length, max_tokens),
                 lambda: self.driver.add(rid, doc, length, max_tokens), rid)

    def schedule(self) -> None:
        self.steps += 1
        step = self.steps
        got = []
        self._do(("schedule", step), lambda: got.append(self.driver.schedule()))
        if got and got[0] is not None:
            handle, reads = got[0]
            self.in_flight.append((step, handle))
            self.leases[step] = {rid: (self.driver.generation(rid), frozenset(ids))
                                 for rid, ids in reads.items()}
            begin = getattr(self.guard, "begin_step", None)
            if begin is not None and self.driver.leases_outlive_requests:
                # The guard's leases say "no reuse until processed", whoever ends the request:
                # opened only where the engine promises that (else check_invariants judges).
                for rid, ids in reads.items():
                    begin((step, rid), sorted(set(ids)), request=rid)
        else:
            self.events[-1] = ("schedule", 0)  # nothing was scheduled: no step, no lease
            self.steps -= 1
        self._check()

    def process(self, eos_mask: int) -> None:
        ran = sorted(self.leases.get(self.in_flight[0][0], {}))
        self.process_eos(tuple(rid for i, rid in enumerate(ran) if eos_mask >> i & 1))

    def process_eos(self, eos: tuple) -> None:
        step, handle = self.in_flight.popleft()
        self._do(("process", step, eos), lambda: self.driver.process(handle, set(eos)),
                 closes=step)

    def abort(self, which: int) -> None:
        alive = self.alive()
        if alive:
            self.abort_rid(alive[which % len(alive)])

    def abort_rid(self, rid: str) -> None:
        self._do(("abort", rid), lambda: self.driver.abort(rid), rid)

    def reset_prefix_cache(self) -> None:
        self._do(("reset",), self.driver.reset_prefix_cache)

    def close(self) -> None:
        self.driver.close()
        if self.guard is not None:
            self.guard.unguard()

    def drain(self) -> None:
        """Process every step in flight, abort every request, and check nothing stays held."""
        while self.in_flight:
            self.process(0)
        for rid in self.alive():
            self._do(("abort", rid), lambda rid=rid: self.driver.abort(rid), rid)
        while self.in_flight:
            self.process(0)
        for _ in range(4):  # the engine keeps stepping while KV transfers are pending, or
            if not self.driver.transfers() and not self.alive():  # aborts are queued (HF)
                break
            self.schedule()
            while self.in_flight:
                self.process(0)
        held = self.driver.held()
        if held:
            self.events.append(("end",))
            self._fail(Problem("leak", held[0], (
                f"block(s) {held} still referenced after every request ended and every step "
                "was processed")))

    def _fail(self, problem: Problem) -> None:
        if problem.kind not in self.ignore:
            self.failed = True
            raise LifecycleViolation(problem, self.events)

    # --- the checks --------------------------------------------------------------------------

    def _do(self, event, call, rid=None, closes=None) -> None:
        self.events.append(event)
        try:
            if rid is not None:
                with self.driver.owner(rid):
                    call()
            else:
                call()
        except LifecycleViolation:
            raise
        except Exception as exc:
            kind = getattr(exc, "kind", None) or "engine-error"
            if kind in self.ignore:  # the engine's state is unknown now: drop the example
                from hypothesis import reject
                self.failed = True
                reject()
            self.failed = True
            raise LifecycleViolation(Problem(kind, None, f"{type(exc).__name__}: {exc}"),
                                     self.events) from exc
        if closes is not None:
            ran = self.leases.pop(closes, {})
            end = getattr(self.guard, "end_step", None)
            if end is not None and self.driver.leases_outlive_requests:
                for rid in ran:
                    end((closes, rid))
        if event[0] != "schedule":
            self._check()

    def _check(self) -> None:
        if self.guard is not None:
            found = self.guard.violations
            if len(found) > self.seen_violations:
                v = found[self.seen_violations]
                self.seen_violations = len(found)
                self._fail(Problem(v.kind, list(v.block_ids), v.message))
        d = self.driver
        broken = check_invariants(d.tables(), d.refcount, self.leases, d.generation,
                                  d.leases_outlive_requests, d.held(), d.transfers())
        if broken is not None:
            self._fail(Problem(*broken))


def machine_for(make_run):
    """The state machine class: one ``Run`` per example, rules for each event."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

    probe = make_run()
    docs, prompt, tokens = (probe.driver.documents, probe.driver.max_prompt,
                            probe.driver.max_tokens)
    probe.close()

    class LifecycleMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.run = make_run()

        @rule(doc=st.integers(0, docs - 1), length=st.integers(1, prompt),
              max_tokens=st.integers(1, tokens))
        def add(self, doc, length, max_tokens):
            self.run.add(doc, length, max_tokens)

        @precondition(lambda self: self.run.can_schedule())
        @rule()
        def schedule(self):
            self.run.schedule()

        @precondition(lambda self: bool(self.run.in_flight))
        @rule(eos=st.integers(0, 15))
        def process(self, eos):
            self.run.process(eos)

        @precondition(lambda self: bool(self.run.requests))
        @rule(which=st.integers(0, 7))
        def abort(self, which):
            self.run.abort(which)

        @rule()
        def reset_prefix_cache(self):
            self.run.reset_prefix_cache()

        def teardown(self):
            try:
                if not self.run.failed:  # a failed run keeps its own problem, not the drain's
                    self.run.drain()
            finally:
                self.run.close()

    return LifecycleMachine


def replay(make_run, events: list):
    """The ``LifecycleViolation`` that ``events`` (possibly with some removed) raise on a fresh
    engine, or None: request ids and step numbers are renumbered as they are made again, and a
    sequence that no longer makes sense (a step processed that was never scheduled) is None."""
    run = make_run()
    rids: dict = {}
    steps: dict = {}
    try:
        for event in events:
            kind = event[0]
            if kind == "add":
                rids[event[1]] = f"r{len(run.requests)}"
                run.add(*event[2:])
            elif kind == "schedule":
                if not run.can_schedule():  # a step dropped: the engine never schedules so
                    return None
                before = run.steps
                run.schedule()
                if event[1]:
                    if run.steps == before:
                        return None
                    steps[event[1]] = run.steps
            elif kind == "process":
                if not run.in_flight or steps.get(event[1]) != run.in_flight[0][0]:
                    return None
                run.process_eos(tuple(rids[r] for r in event[2] if r in rids))
            elif kind == "abort":
                if event[1] not in rids:
                    return None
                run.abort_rid(rids[event[1]])
            elif kind == "reset":
                run.reset_prefix_cache()
            else:
                run.drain()
    except LifecycleViolation as found:
        return found
    finally:
        run.close()
    return None


def shorten(make_run, found: LifecycleViolation, until: float | None = None
            ) -> LifecycleViolation:
    """Drop events (a step together with its processing) while the same kind of problem still
    shows: hypothesis shrinks its choices, which is not always the fewest events. Past
    ``until`` it keeps the shortest found so far."""
    kind = found.problem.kind
    changed = True
    while changed and (until is None or time.monotonic() < until):
        changed = False
        events = found.events
        for i, event in enumerate(events):
            drop = {i}
            if event[0] == "schedule" and event[1]:
                drop |= {j for j, e in enumerate(events) if e[0] == "process" and
                         e[1] == event[1]}
            got = replay(make_run, [e for j, e in enumerate(events) if j not in drop])
            if got is not None and got.problem.kind == kind and len(got.events) < len(events):
                found, changed = got, True
                break
    return found


CHUNK = 50
"""Examples per hypothesis run: the budget is checked between runs, never inside one (a rule
that behaved differently past a deadline would make hypothesis's replays inconsistent)."""


def search(make_run, *, examples: int, steps: int, seed: int, deadline: float,
           keep: dict | None = None):
    """The shrunk ``LifecycleViolation`` hypothesis finds, ``"budget"`` when time ran out
    first, or None. ``keep["found"]`` holds the violation before it is shortened (a search
    stopped while shortening keeps it)."""
    from hypothesis import HealthCheck, Phase, Verbosity, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.stateful import get_state_machine_test

    machine = machine_for(make_run)
    done, chunk = 0, 0
    while done < examples:
        if time.monotonic() > deadline:
            return "budget"
        size = min(CHUNK, examples - done)
        test = get_state_machine_test(machine, settings=settings(
            max_examples=size, stateful_step_count=steps, deadline=None, database=None,
            report_multiple_bugs=False, verbosity=Verbosity.quiet, print_blob=False,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.explicit, Phase.generate, Phase.shrink)))
        try:
            hypothesis_seed(seed * 1_000_003 + chunk)(test)()
        except LifecycleViolation as found:
            if keep is not None:
                keep["found"] = found
            return shorten(make_run, found, until=deadline + 1.0)
        done += size
        chunk += 1
    return None
