"""Every raise/log/repair decision of a guard, in one place.

``on_violation``: ``raise`` rejects a bad call before the allocator sees it; ``log`` records and
forwards the call untouched, and nothing the guard does, its own bugs included, raises into the
caller; ``repair`` records and forwards a sanitized call (plain ints, each once, only live ids).
While ``step_aside_when``'s predicate holds, raise mode records and forwards instead, as in log
mode. Assertions the user calls (``check()``, ``assert_no_leaks()``) raise in every mode.
"""

from __future__ import annotations

from ..errors import ERROR_FOR_KIND, KVGuardError, error_for
from ..ids import like
from .. import kinds
from . import evidence, selfcheck
from .telemetry import internal_error, record

MODES = ("raise", "log", "repair")

LOGGED, REPAIR, ASIDE = "log", "repair", "aside"
"""What ``settle`` tells its caller to do with a call that had violations (raise mode raises)."""

_step_aside: list = [None]
"""The predicate ``step_aside_when`` installed, or None."""


def step_aside_when(predicate):
    """While ``predicate(error_class)`` is true, a raise-mode guard steps aside for a bad call
    rather than raise ``error_class`` (the ``KVGuardError`` subclass of its first violation): it
    records the violations (marked ``extra["stepped_aside"]``) and forwards the call untouched,
    as in log mode; then the ledger follows what the allocator did (``live_ids`` when the spec has
    it) and ``check()`` compares from there. The pytest plugin sets this while a test expects
    an exception kvguard's error is not (``assertRaises(AssertionError)`` around an engine's own
    debug check), so the engine's own defence is what the test sees. Returns a function that
    removes it."""
    _step_aside[0] = predicate

    def remove() -> None:
        if _step_aside[0] is predicate:
            _step_aside[0] = None
    return remove


def stepping_aside(guard, kind) -> bool:
    """Whether to forward a call whose first violation is ``kind`` rather than raise."""
    predicate = _step_aside[0]
    if predicate is None or guard.mode != "raise":
        return False
    try:
        return bool(predicate(ERROR_FOR_KIND[kind]))
    except Exception as exc:  # the predicate's bug: raise as usual
        internal_error(guard, exc)
        return False


def settle(guard, violations, *, aside_ok: bool = True, assertion: bool = False):
    """Record ``violations`` (most severe first) and act on them: raise mode raises the first
    (unless the guard steps aside, when ``aside_ok``); an ``assertion`` raises in every mode.
    Returns None when there is nothing to settle, else ``ASIDE``, ``LOGGED`` or ``REPAIR``: what
    the caller does with its call (forward it as is, or sanitized)."""
    if not violations:
        return None
    aside = aside_ok and stepping_aside(guard, violations[0].kind)
    for v in violations:
        if aside:
            v.extra["stepped_aside"] = True
        record(guard, v, log=guard.mode != "raise")
    if assertion or (guard.mode == "raise" and not aside):
        raise error_for(violations[0], violations[1:])
    return ASIDE if aside else REPAIR if guard.mode == "repair" else LOGGED


def flag(guard, kind, block_ids, message, method, pool=None, *, ledger=None, detail=None,
         extra=None, aside_ok: bool = False, assertion: bool = False):
    """Build one violation of ``guard``'s allocator and settle it (see ``settle``)."""
    ledger = ledger if ledger is not None else guard.ledger(pool)
    v = evidence.violation(guard, kind, block_ids, message, method, pool, ledger,
                           block_ids if detail is None else detail)
    if extra:
        v.extra.update(extra)
    return settle(guard, [v], aside_ok=aside_ok, assertion=assertion)


def reject_faults(guard, plan) -> None:
    """Settle a checked release's faults: one violation per fault, the first naming the others
    (``extra["also"]``). Sets ``plan.aside`` when the guard steps aside."""
    selfcheck.review_release(guard, plan)
    faults = plan.faults
    if not faults:
        return
    detail = [b for f in faults for b in f.block_ids]
    violations = [evidence.violation(guard, f.kind, f.block_ids, f.message + (
        selfcheck.double_free_hint(guard) if f.kind == kinds.DOUBLE_FREE else ""),
        plan.method, plan.pool, plan.ledger, detail) for f in faults]
    for v in violations[1:]:
        violations[0].extra.setdefault("also", []).append(v.headline())
    plan.aside = settle(guard, violations) == ASIDE
    if plan.aside or guard.mode == "log":
        selfcheck.notes(guard).tainted = True


def protect(guard, step, *args):
    """Run a guard step; in log/repair mode a bug in the guard never reaches the caller.
    Every careful-path call commits through here: the guard checks its own wrappers first
    (once per call, at its commit)."""
    if step.__name__.startswith("commit"):
        selfcheck.verify(guard)
    if guard.mode == "raise":
        return step(*args)
    try:
        return step(*args)
    except KVGuardError:
        raise
    except Exception as exc:
        internal_error(guard, exc)
        return None


def contain(guard, exc: BaseException) -> int:
    """The guard's own bug on the way through a call (reading ids, capturing a site): raise
    mode shows it; log and repair count it and go on, the call forwarded unchecked or with an
    unknown site (0, returned), so the caller's call and its bookkeeping complete."""
    if guard.mode == "raise":
        raise exc
    internal_error(guard, exc)
    return 0


def drains(guard) -> bool:
    """Whether a one-shot iterator passed as ids is drained to be read (repair mode forwards
    the drained list; other modes report it and leave it untouched)."""
    return guard.mode == "repair"


def received_as_given(guard, plan) -> bool:
    """Whether the allocator received a faulty call as the caller made it (log mode, or the
    guard stepping aside): the flight recorder then keeps the ids as given."""
    return plan.faulty and (guard.mode == "log" or plan.aside)


def route_free(guard, plan, args, kwargs):
    """Decide what the allocator receives: the call itself, a repaired one, or the ids
    leaving quarantine. Returns ``(args, kwargs, forward)``."""
    ids = plan.good + plan.learned
    put = guard._free_param.put
    if guard._quarantine.size and not guard.spec.refcounted:
        released = guard._quarantine.enter(plan.pool, ids, plan)
        if not released and not plan.norm.passthrough:
            return args, kwargs, False
        return (*put(args, kwargs, forward_value(guard, plan, released)), True)
    if plan.faulty and guard.mode == "repair":
        if not ids and not plan.norm.passthrough:
            return args, kwargs, False
        return (*put(args, kwargs, forward_value(guard, plan, ids)), True)
    if plan.norm.consumed:
        return (*put(args, kwargs, plan.norm.materialized), True)
    if plan.norm.forward is not None:  # the guard's own copy of what it read
        return (*put(args, kwargs, plan.norm.forward), True)
    return args, kwargs, True


def forward_value(guard, plan, ids):
    """Ids as the allocator takes them: its objects, a tensor like the caller's, or ints."""
    norm = plan.norm
    if norm.objects is not None:
        first = {}
        for b, obj in zip(norm.ids, norm.objects):
            first.setdefault(b, obj)
        held = plan.held_objects
        objects = [first[b] if b in first else held[b] for b in ids] + norm.passthrough
        return tuple(objects) if type(norm.given) is tuple else objects
    if norm.tensor is not None and guard.spec.tensor_ok:
        torch = __import__("torch")
        return torch.tensor(ids, dtype=norm.tensor.dtype, device=norm.tensor.device)
    return like(norm.given, ids)
