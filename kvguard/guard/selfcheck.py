"""The guard checks itself, never the user: when its view and the allocator's part ways.

A guard sees the calls its spec names. When the allocator's own observable state (its free
count, its reference counts) moves in a way none of those calls explains, the spec is
incomplete, not the user's code wrong: the guard resynchronizes and says so once, naming the
method that moved it and the keyword that would cover it. Three ways it notices:

- observers (``observers``): the allocator's other public methods that change its state (read
  from their source) are watched on the instance; a free-count move inside one, with the
  ledger not following, is named at once (``clear()`` changed the free count from 3 to 8; add
  ``reset="clear"``);
- at a violation about to be reported (``review``): a block handed out while the ledger holds
  it live, when the allocator's free count shows it had it to give, or its own reference count
  shows a new reference (an allocation that also shares); a double free of a block whose own
  reference count is still positive (a share the spec does not name);
- its own wrappers (``verify``): one removed from the instance (an engine that assigns, then
  deletes, an attribute named like the guarded method) is re-installed; one rebound to another
  method of the allocator wraps that one; one replaced by something else is said to be
  unchecked while it stays. Checked at every careful-path call, at ``check()``, ``stats``-like
  reads (``snapshot``, ``live``, ``violations``), and by the class-level dispatcher.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter

from .. import dispatch, kinds
from ..logger import emit
from ..marks import ATTR
from ..spec import read
from . import baseline, descriptors
from .arguments import MISSING
from .instances import engine_method

SHARE_LIKE = ("share", "fork", "touch", "incref", "inc_ref", "add_ref", "retain", "acquire",
              "ref", "reference", "copy_on_write", "cow", "pin")


class Notes:
    """One guard's self-check state: what it said (once each) and what it still owes."""

    __slots__ = ("said", "lines", "surplus", "installed", "busy", "tainted", "unseen",
                 "extra_refs", "token", "classed")

    def __init__(self) -> None:
        self.said: set = set()
        self.lines: list = []
        self.surplus = 0
        """Blocks the allocator took back outside any call the guard saw, not yet re-handed."""
        self.installed: dict = {}
        """Method name -> the guard's wrapper last seen on the instance."""
        self.busy = False
        self.tainted = False
        self.unseen = False
        """A wrapper was found replaced or removed: calls went by unseen."""
        self.token = None
        self.classed: tuple = ()
        """The guarded methods as the class held them (``descriptors.class_view``)."""
        """What holds this guard's class-level dispatchers (``kvguard.dispatch``)."""
        self.extra_refs: Counter = Counter()
        """(pool, block) -> references an allocation took that a non-refcounted ledger
        cannot hold: that many later double frees of the block are the other holders'."""
        """A faulty call reached the allocator as given (log mode): its free count no longer
        witnesses what the spec missed, so it excuses nothing from then on."""


class SelfChecked:
    """The part of ``Guard`` that answers for the guard itself (a base class of ``Guard``)."""

    def verify(self) -> None:
        """Check that the guard's wrappers are still on the instance: one an engine removed is
        re-installed, one rebound to another method of the allocator wraps that, one replaced
        by anything else is said to be unchecked; each said once (``notes``). Also run at every
        careful-path call and by ``check()``, ``live``, ``violations``, ``snapshot()``."""
        verify(self)

    def routed(self, name: str):
        """The guard's wrapper of method ``name``, for a call that reached the class's function
        (the class-level dispatcher): verified first, so a wrapper an engine removed is back;
        while one is replaced by something else, calls that reach the class still go through
        the guard. None when the guard does not wrap ``name``."""
        verify(self)
        allocator = self.allocator
        present = vars(allocator).get(name) if allocator is not None else None
        if _ours(self, present) and getattr(present, "__kvguard__", None) is self:
            return present
        wrapper = notes(self).installed.get(name)
        return wrapper if getattr(wrapper, "__kvguard__", None) is self else None

    @property
    def notes(self) -> list:
        """What the guard said about itself, once each: a spec that misses a method, a
        wrapper an engine replaced or removed."""
        verify(self)
        return list(notes(self).lines)


def notes(guard) -> Notes:
    found = guard.__dict__.get("_selfcheck")
    if found is None:
        found = guard.__dict__["_selfcheck"] = Notes()
    return found


def say(guard, key, message: str) -> None:
    """Say ``message`` once per guard and ``key``: logged (WARNING) and kept in
    ``Guard.notes``."""
    state = notes(guard)
    if key in state.said:
        return
    state.said.add(key)
    line = f"kvguard: {guard.name}: {message}"
    state.lines.append(line)
    emit(logging.WARNING, "%s", line)


# --- the guard's own wrappers -----------------------------------------------------------------

def remember(guard) -> None:
    """Note the wrappers on the instance now (after attach, after a re-install)."""
    allocator = guard.allocator
    if allocator is None:
        return
    own = vars(allocator)
    state = notes(guard)
    for name in guard._originals:
        present = own.get(name)
        if _ours(guard, present):
            state.installed[name] = present
    if state.token is None:
        state.token = object()
        weakref.finalize(guard, dispatch.let_go, state.token)
    dispatch.hold(type(allocator), [n for n, w in state.installed.items()
                                    if getattr(w, "__kvguard__", None) is guard], state.token)
    state.classed = descriptors.class_view(allocator, guard.spec.methods())


def let_go(guard) -> None:
    """The guard no longer holds its class-level dispatchers (``unguard()``)."""
    token = notes(guard).token
    if token is not None:
        dispatch.let_go(token)


def _ours(guard, value) -> bool:
    return getattr(value, "__kvguard__", None) is guard or \
        getattr(value, "__kvguard_hook__", None) is guard


def verify(guard) -> None:
    """Every wrapper still where the guard put it; see the module docstring for what it does
    when one is not. Cheap when all is well (every careful-path call runs it): one dict read
    per wrapped method."""
    state = guard.__dict__.get("_selfcheck")
    allocator = guard._allocator()
    if state is None or allocator is None or state.busy:
        return
    own = getattr(allocator, "__dict__", None)
    if own is None or own.get(ATTR) is not guard:
        return
    get = own.get
    for n, w in state.installed.items():
        if get(n) is not w:
            break
    else:
        for held, n, attr in state.classed:
            if held.get(n) is not attr:
                break
        else:
            return
    if not guard._originals:
        return
    lost = [n for n, w in state.installed.items() if own.get(n) is not w]
    state.busy = True
    try:
        with guard.lock:
            for name in descriptors.follow_class(guard, allocator, state.classed):
                say(guard, ("class", name, id(getattr(type(allocator), name, None))), (
                    f"{type(allocator).__qualname__}.{name} was rebound on the class; the "
                    f"guard now forwards to what it holds now"))
            _repair(guard, allocator, own, state, lost)
    finally:
        state.busy = False


def _repair(guard, allocator, own, state, lost) -> None:
    spec_methods = set(guard.spec.methods())
    rebuild = False
    what = type(allocator).__qualname__
    for name in lost:
        present = own.get(name, MISSING)
        if _ours(guard, present) and any(present is w for n, w in state.installed.items()
                                         if n != name):
            present = present.__wrapped__  # rebound to another method the guard wraps
        elif _ours(guard, present):
            state.installed[name] = present  # rebuilt by the guard itself (quarantine, ...)
            continue
        state.unseen = True
        if present is MISSING:
            if name in spec_methods:
                guard._bound[name] = engine_method(allocator, name)
                rebuild = True
            else:
                own[name] = state.installed[name]
            say(guard, ("removed", name), (
                f"{what}.{name} was removed from the instance (by code that assigned and then "
                f"deleted an attribute named {name!r}); the guard re-installed its wrapper, so "
                f"{name}() is checked again"))
        elif name in spec_methods and getattr(present, "__self__", None) is allocator:
            guard._bound[name] = present
            guard._originals[name] = present
            rebuild = True
            say(guard, ("rebound", name, id(present)), (
                f"{what}.{name} was rebound on the instance to "
                f"{getattr(present, '__qualname__', present)!r}; the guard now wraps that"))
        else:
            say(guard, ("replaced", name), (
                f"{what}.{name} was replaced on the instance by {_describe(present)}: calls "
                f"through it are not checked while it stays; the guard re-installs its "
                f"wrapper when it is removed"))
    if rebuild:
        guard._install(guard)
    remember(guard)


def _describe(value) -> str:
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"{name}()" if callable(value) else repr(value)[:60]


# --- review: a violation about to be reported, that the allocator's own state explains --------

def review_handout(guard, ledger, norm, fresh, faults, method, site):
    """An allocation handed out ids the ledger holds live (``shared-block``). Excused, the
    ledger following, when the allocator's own state shows the spec is incomplete: its
    reference counts grew (an allocation that also shares: ``alloc_shares``), or its free count
    shows it had the blocks to give (they came back outside any call the guard saw, or the
    allocation took new references to them: for a pool declared refcounted with no reference
    counts to tell, taken as new references, so that neither holder's later free is a false
    alarm). Returns
    ``(fresh, faults)``."""
    shared_fault = next((f for f in faults if f.kind == kinds.SHARED_BLOCK), None)
    if shared_fault is None:
        return fresh, faults
    shared = [b for b in dict.fromkeys(shared_fault.block_ids)
              if ledger.is_live(b) and norm.ids.count(b) == 1]
    if not shared:
        return fresh, faults
    counts = _counts(guard, shared, norm)
    state = notes(guard)
    if counts is not None and not all(c is not None and c > ledger.refcount(b)
                                      for b, c in zip(shared, counts)):
        return fresh, faults  # the allocator itself counts one reference: it is corrupt
    if guard.spec.alloc_shares:
        how = "share"  # declared: a live block handed out again is a new reference
    elif counts is not None:
        how = "share"
        say(guard, ("alloc-shares", method), (
            f"spec incomplete: {method}() handed out block(s) {shared[:8]} the guard holds "
            f"live, and the allocator's own reference counts grew: it takes new references to "
            f"live blocks (a prefix-cache hit); add alloc_shares=True, refcounted=True"))
    elif state.tainted:
        return fresh, faults
    elif state.surplus >= len(shared) or state.unseen:
        how = "fresh"
        state.surplus = max(state.surplus - len(shared), 0)
        say(guard, ("returned", method), (
            f"spec incomplete: {method}() handed out block(s) {shared[:8]} the guard holds "
            "live, which the allocator took back outside any call the guard saw; the guard "
            "resynchronized"))
    elif guard.spec.refcounted and _surplus(guard, len(norm.ids)) >= len(shared):
        # (a pool not declared refcounted that hands out a live block, its count saying it
        # had it to give, is corrupt: its free list holds a live block. Reported.)
        how = "share"
        say(guard, ("had-them", method), (
            f"spec incomplete: {method}() handed out block(s) {shared[:8]} the guard holds "
            "live, and the allocator's free count shows they were not taken from its free "
            "list: it takes new references to live blocks (a prefix-cache hit: add "
            "alloc_shares=True, refcounted=True; refcounts=... lets the guard tell), or a call "
            "the spec does not name returned them. The guard counts them as shared"))
    else:
        return fresh, faults
    if how == "share":
        if ledger.ref is not None:
            ledger.share(shared, guard._tick(), site)
        else:
            for b in shared:
                state.extra_refs[(ledger.pool, b)] += 1
    else:  # the old hand-out ended unseen; this one starts afresh
        drop(ledger, shared, guard._tick(), site)
        fresh = list(fresh) + shared
    rest = tuple(b for b in shared_fault.block_ids if b not in set(shared))
    faults = [f for f in faults if f is not shared_fault]
    if rest:
        faults.append(type(shared_fault)(shared_fault.kind, shared_fault.message, rest))
    return fresh, faults


def drop(ledger, ids, clock, site) -> None:
    if ledger.ref is not None:
        for b in ids:
            ledger.ref[b] = 1
    ledger.release(ids, clock, site)


def _surplus(guard, handed: int) -> int:
    """Blocks the allocator had free beyond what the ledger expects, counted before this
    allocation's ``handed`` ids were committed (0 when its free count is not known)."""
    if guard.spec.free_count is None:
        return 0
    try:
        figures = baseline.compare(guard, guard.allocator)
    except Exception:
        return 0
    return sum(theirs - ours for theirs, ours in figures.values()) + handed


def _counts(guard, ids, norm=None):
    """The allocator's own reference count of each id: ``refcount_attr`` on the block objects
    of ``norm`` (an allocation's result), or the spec's ``refcounts``; None when neither."""
    spec = guard.spec
    try:
        if spec.refcount_attr is not None and norm is not None and norm.objects is not None:
            first = {}
            for b, obj in zip(norm.ids, norm.objects):
                first.setdefault(b, obj)
            return [getattr(first[b], spec.refcount_attr, None) for b in ids]
        if spec.refcounts is None:
            return None
        table = read(guard.allocator, spec.refcounts)
    except Exception:
        return None
    return [count_of(table, b) for b in ids]


def count_of(table, b):
    try:
        value = table[b]
    except (IndexError, KeyError, TypeError):
        return 0 if isinstance(table, dict) else None
    value = getattr(value, "item", lambda: value)() if not isinstance(value, int) else value
    return value if isinstance(value, int) else None


def review_release(guard, plan) -> None:
    """A release about to be reported as a double free: when the allocator's own reference
    count of the block is still positive, the guard missed a reference (a share the spec does
    not name): the ledger takes the allocator's count and the release goes ahead."""
    if plan.method == guard.spec.share:
        return
    doubles = [f for f in plan.faults if f.kind == kinds.DOUBLE_FREE]
    if not doubles:
        return
    ids = [b for f in doubles for b in f.block_ids]
    extra = notes(guard).extra_refs
    if plan.ledger.ref is None:
        if all(extra[(plan.pool, b)] > 0 for b in ids):
            for b in ids:
                extra[(plan.pool, b)] -= 1
            plan.faults = [f for f in plan.faults if f.kind != kinds.DOUBLE_FREE]
        return
    counts = _counts(guard, ids)
    if counts is None or not all(c is not None and c > 0 for c in counts):
        return
    ledger = plan.ledger
    clock = guard._tick()
    for b, c in zip(ids, counts):
        ledger.stamp[b] = clock
        ledger.ref[b] = c
    plan.good = plan.good + ids
    plan.faults = [f for f in plan.faults if f.kind != kinds.DOUBLE_FREE]
    say(guard, ("missed-share", plan.method), (
        f"spec incomplete: {plan.method}() released block(s) {ids[:8]} the guard had counted "
        f"free, while the allocator still counts references to them ({counts[:8]}): a method "
        "the spec does not name took references; name it with share=\"...\""))


def double_free_hint(guard) -> str:
    """For a double-free report on a class that looks reference-counted but was not declared
    so: what to check in the spec."""
    spec = guard.spec
    if spec.refcounted:
        return ""
    allocator = guard.allocator
    names = [n for n in dir(type(allocator)) if not n.startswith("_") and any(
        n == w or n.startswith(w + "_") or n.endswith("_" + w) for w in SHARE_LIKE)]
    if not names:
        return ""
    return (f" (hint: {type(allocator).__qualname__} has {', '.join(n + '()' for n in names[:3])}"
            ", which looks like it takes references; if blocks are shared, the spec may be "
            f"incomplete: declare refcounted=True, share=\"{names[0]}\")")
