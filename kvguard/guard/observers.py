"""Observers: the allocator's other public methods that change its state, watched.

Part of the guard's self-check (``selfcheck``): a method the spec does not name, whose source
changes the allocator's state, is wrapped on the instance (not as a guarded method: no class
dispatcher, no checks of its arguments). When the allocator's free count, or with ``refcounts``
its reference counts, moves inside it and the ledger does not follow (the guarded calls it made
do not explain the move), the guard resynchronizes and names the method and the keyword.
The wrapper holds no lock while the method runs, so the guarded calls it makes are checked.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
import weakref

from ..spec import read
from . import baseline
from .arguments import MISSING
from .instances import engine_method
from .selfcheck import drop, notes, remember, say

MUTATORS = frozenset({
    "append", "extend", "pop", "popleft", "appendleft", "clear", "insert", "remove", "add",
    "discard", "update", "setdefault", "popitem", "fill_", "zero_", "copy_", "index_fill_",
    "put", "put_nowait", "push", "sort", "reverse",
})


def observe(guard) -> None:
    """Watch the allocator's public methods that change its state and that the spec does not
    name (read from their source): a free-count move inside one, unexplained by the guarded
    calls it made, is resynchronized and named. Needs the spec's ``free_count``."""
    try:
        _observe(guard)
    finally:
        remember(guard)


def _observe(guard) -> None:
    spec = guard.spec
    allocator = guard.allocator
    if spec.free_count is None or allocator is None:
        return
    skip = set(spec.methods()) | set(spec.extra_methods()) | set(vars(allocator))
    skip |= {v for v in (spec.free_count, spec.size, spec.live_ids, spec.refcounts)
             if isinstance(v, str)}
    for name in mutating_methods(type(allocator)):
        if name in skip:
            continue
        original = engine_method(allocator, name)
        observer = _observer(guard, name, original)
        observer.__kvguard_hook__ = guard  # the guard's, but not a guarded method: no dispatch
        own = vars(allocator)
        guard._originals.setdefault(name, own.get(name, MISSING))
        own[name] = observer
        notes(guard).installed[name] = observer


def mutating_methods(cls) -> list:
    """Public plain functions of ``cls`` (and its bases) whose body changes ``self``'s
    state: assigns or deletes an attribute or item of it, or calls a mutating method on one."""
    out, seen = [], set()
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        for name, func in vars(klass).items():
            if name in seen or name.startswith("_") or not inspect.isfunction(func):
                continue
            seen.add(name)
            if changes_self(func):
                out.append(name)
    return out


PARSING = threading.Lock()
"""CPython 3.11's AST builder keeps its recursion depth per interpreter: two threads parsing
at once raise ``SystemError('AST constructor recursion depth mismatch')``, and guards are made
on any thread (found by tests/kvguard/test_churn.py)."""


_BY_FUNCTION: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_BY_SOURCE: dict = {}
"""What ``changes_self`` found, per function, and per source text (a class made again from the
same source, as a factory or a test does): reading a method's source and parsing it is most of
what attaching a guard costs, so each is done once."""
_SOURCES_KEPT = 4096


def changes_self(func) -> bool:
    """Whether ``func``'s body changes its first parameter's state (see ``mutating_methods``);
    read from its source once per function and per source text."""
    code = getattr(func, "__code__", None)
    try:
        known = _BY_FUNCTION.get(func)
    except TypeError:
        known = None
    if known is not None and known[0] is code:
        return known[1]
    try:
        source = textwrap.dedent(inspect.getsource(func))
    except (OSError, TypeError, SyntaxError):
        return False
    found = _BY_SOURCE.get(source)
    if found is None:
        found = _reads_as_changing(source)
        if len(_BY_SOURCE) < _SOURCES_KEPT:
            _BY_SOURCE[source] = found
    try:
        _BY_FUNCTION[func] = (code, found)
    except TypeError:
        pass
    return found


def _reads_as_changing(source: str) -> bool:
    try:
        with PARSING:
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
        return False
    me = fn.args.args[0].arg
    for node in ast.walk(fn):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in MUTATORS:
            targets = [node.func.value]
        if any(_rooted_at(t, me) for t in targets):
            return True
    return False


def _rooted_at(node, name) -> bool:
    seen_attr = False
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        seen_attr = seen_attr or isinstance(node, ast.Attribute)
        node = node.value
    return seen_attr and isinstance(node, ast.Name) and node.id == name


def _observer(guard, name, original):
    owned = guard.lock._is_owned

    def observed(*args, **kwargs):
        if owned():  # inside a guarded call: the guard's own bookkeeping covers it
            return original(*args, **kwargs)
        before = _free_total(guard), _ref_total(guard)
        result = original(*args, **kwargs)
        after = _free_total(guard), _ref_total(guard)
        if before[0] is not None and after[0] is not None and before[0] != after[0]:
            with guard.lock:
                explain(guard, name, before[0], after[0])
        elif before[1] != after[1]:
            with guard.lock:
                explain_refs(guard, name, before[1], after[1])
        return result
    observed.__wrapped__ = original
    return observed


def _ref_total(guard):
    """The sum of the allocator's own reference counts (the spec's ``refcounts``), or None."""
    if guard.spec.refcounts is None:
        return None
    try:
        table = read(guard.allocator, guard.spec.refcounts)
        return sum(table.values()) if isinstance(table, dict) else int(sum(table))
    except Exception:
        return None


def explain_refs(guard, method, before, after) -> None:
    """Reference counts moved inside ``method()`` with the free count still: when the ledger
    disagrees with the allocator's counts, take the allocator's and name the method."""
    if guard.spec.pool_arg is not None:
        return
    ledger = guard.ledger(None)
    if ledger.ref is None:
        return
    table = read(guard.allocator, guard.spec.refcounts)
    pairs = table.items() if isinstance(table, dict) else enumerate(table)
    clock = guard._tick()
    moved = []
    for b, c in pairs:
        c = int(c)
        if c == ledger.refcount(b) or not ledger.in_range(b) or not ledger.grow(b + 1):
            continue
        moved.append(b)
        if c > 0:
            if ledger.stamp[b] <= 0:
                ledger.stamp[b] = clock
            ledger.ref[b] = c
        else:
            ledger.release([b], clock, 0) if ledger.ref[b] == 1 else drop(ledger, [b], clock, 0)
    if not moved:
        return
    keyword = f'share="{method}(...)"' if after > before else f'also_free="{method}(...)"'
    say(guard, ("refs", method), (
        f"spec incomplete: {method}() changed the allocator's reference counts (of block(s) "
        f"{moved[:8]}) from a total of {before} to {after}, and no call the spec names explains "
        f"it; add {keyword} (the argument that carries the ids). The guard took the "
        "allocator's counts"))


def _free_total(guard):
    try:
        value = baseline.free_count(guard, guard.allocator)
    except Exception:
        return None
    return sum(value.values()) if isinstance(value, dict) else value


def explain(guard, method, before, after) -> None:
    """The free count moved from ``before`` to ``after`` inside ``method()``: if the ledger
    did not follow (the guarded calls inside it do not explain it), resynchronize and name it."""
    figures = baseline.compare(guard, guard.allocator)
    if all(theirs == ours for theirs, ours in figures.values()):
        return
    gap = sum(theirs - ours for theirs, ours in figures.values())
    size = _size(guard)
    if after > before and size is not None and after >= size:
        keyword = f'reset="{method}"'
        from .bookkeeping import forget_all
        forget_all(guard, 0)
    elif after > before:
        keyword = f'also_free="{method}(...)"  (the argument that carries the ids)'
        notes(guard).surplus += max(gap, 0)
    else:
        keyword = f'also_alloc="{method}"'
        _learn_more(guard, -min(gap, 0))
    _resync(guard)
    say(guard, ("moved", method), (
        f"spec incomplete: {method}() changed the free count from {before} to {after}, and no "
        f"call the spec names explains it; add {keyword} to the AllocatorSpec. The guard "
        "resynchronized with the allocator"))


def _size(guard):
    try:
        size = read(guard.allocator, guard.spec.size)
    except Exception:
        return None
    if isinstance(size, (list, tuple)):
        return sum(size)
    if isinstance(size, dict):
        return sum(size.values())
    return size if isinstance(size, int) else None


def _learn_more(guard, n) -> None:
    """``n`` blocks went out unseen: that many unknown ids are learned on their first free."""
    if n <= 0:
        return
    for ledger in guard._ledgers.values():
        ledger.learn = True
        ledger.learn_budget = (ledger.learn_budget or 0) + n


def _resync(guard) -> None:
    from .bookkeeping import follow_allocator
    follow_allocator(guard)
