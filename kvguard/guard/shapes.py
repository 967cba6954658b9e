"""Allocator shapes beyond "one method hands ids out in its result, one takes them back".

- ids carried in an argument (``free="deallocate(seq.block_table)"``: ``free_ids``,
  ``share_ids``; ``alloc="allocate(seq.block_table)"``: ``alloc_arg``/``alloc_ids``, the ids an
  allocation adds to the argument);
- an allocation that also takes references to live blocks (``alloc_shares``: a prefix-cache
  hit hands out new blocks and cached ones in one call), taken by ``selfcheck.review_handout``;
- extra methods (``also_alloc``, ``also_free``) and resets (``reset``).

The wrappers here take the careful path on every call: the fast path reads ids from one known
place, and these shapes are where engines differ. They use the guard's careful-path steps
(``careful.plan_release``, ``bookkeeping``), so the checks, the modes and the reports are the
ones every other call gets.
"""

from __future__ import annotations

from collections import Counter

from ..owners import ACTIVE_OWNER
from ..specgrammar import parse_pattern
from .arguments import MISSING, Param
from .bookkeeping import commit_allocation, commit_release
from .careful import forward_aside, plan_release
from .decisions import contain, forward_value, protect
from .instances import engine_method


class CarriedParam(Param):
    """An argument whose ids sit inside it: ``seq`` with ``path="block_table"`` gives
    ``seq.block_table``; ``path`` may be a callable of the argument. ``get`` reads the ids
    (the argument itself is read once per call), ``put`` writes a repaired list back to the
    attribute, which the allocator then reads."""

    __slots__ = ("path", "where")

    def __init__(self, method, where, path) -> None:
        super().__init__(method, where)
        self.path = path
        self.where = where

    def argument(self, args, kwargs):
        return Param.get(self, args, kwargs)

    def get(self, args, kwargs):
        holder = Param.get(self, args, kwargs)
        if holder is MISSING:
            return MISSING
        return read_path(holder, self.path)

    def put(self, args, kwargs, value):
        holder = Param.get(self, args, kwargs)
        if callable(self.path):
            raise TypeError("ids read by a callable cannot be written back")
        *parents, last = self.path.split(".")
        for part in parents:
            holder = getattr(holder, part)
        setattr(holder, last, value)
        return args, kwargs


def read_path(holder, path):
    if callable(path):
        return path(holder)
    for part in path.split("."):
        holder = getattr(holder, part)
    return holder


def param_for(method, where, path) -> Param:
    """Where one method receives its ids: a plain argument, or inside one."""
    return Param(method, where) if path is None else CarriedParam(method, where, path)


def share_param(allocator, spec):
    """Where the spec's ``share`` receives its ids (None without one)."""
    if not spec.share:
        return None
    return param_for(getattr(allocator, spec.share), spec.share_arg, spec.share_ids)


def carried(param) -> bool:
    return isinstance(param, CarriedParam)


# --- releases (free, share, also_free) --------------------------------------------------------

def wrap_release(guard, original, method, param):
    """A careful-path wrapper for a method that releases (or, the spec's ``share``, shares)
    ids read through ``param``; repair mode writes the sanitized ids back where they came
    from, or drops a call whose ids a callable read (they cannot be written back)."""
    lock = guard.lock
    owned = lock._is_owned
    share = method == guard.spec.share

    def release(*args, **kwargs):
        if owned():
            return original(*args, **kwargs)
        value = _safe_get(guard, param, args, kwargs)
        if value is MISSING:
            return original(*args, **kwargs)
        with lock:
            try:
                site = guard._capture(1, guard._depth, ACTIVE_OWNER.get() if share else 0)
                plan = plan_release(guard, method, args, kwargs, value, f"{method}()", site)
            except Exception as exc:
                contain(guard, exc)
                return original(*args, **kwargs)
            if plan.aside:
                return forward_aside(guard, original, args, kwargs, plan)
            forward = True
            if plan.faulty and guard.mode == "repair":
                ids = plan.good + plan.learned
                try:
                    args, kwargs = param.put(args, kwargs, forward_value(guard, plan, ids))
                    forward = bool(ids) or bool(plan.norm.passthrough)
                except Exception:  # no place to write them back: the call is dropped
                    forward = False
            elif plan.norm.consumed:
                args, kwargs = param.put(args, kwargs, plan.norm.materialized)
            result = original(*args, **kwargs) if forward else None
            if forward:
                protect(guard, commit_release, guard, plan)
            return result

    release.__wrapped__ = original
    release.__kvguard__ = guard
    return release


def _safe_get(guard, param, args, kwargs):
    try:
        return param.get(args, kwargs)
    except Exception as exc:  # seq without its block_table: the allocator will say so
        contain(guard, exc)
        return MISSING


# --- allocations ------------------------------------------------------------------------------

def wrap_alloc_into(guard, original, method, param):
    """An allocation that puts its ids into an argument (``allocate(seq)`` extends
    ``seq.block_table``): the ids handed out are what the argument holds after the call and
    did not hold before."""
    lock = guard.lock
    owned = lock._is_owned

    def allocate(*args, **kwargs):
        if owned():
            return original(*args, **kwargs)
        with lock:
            try:
                before = _items(param.get(args, kwargs))
            except Exception:
                before = MISSING
            result = original(*args, **kwargs)
            try:
                site = guard._capture(1, guard._depth, ACTIVE_OWNER.get())
                after = _items(param.get(args, kwargs))
                handed = added(before, after)
            except Exception as exc:
                contain(guard, exc)
                return result
            protect(guard, commit_allocation, guard, args, kwargs, handed, site, method)
            return result

    allocate.__wrapped__ = original
    allocate.__kvguard__ = guard
    return allocate


def _items(value) -> list:
    """A snapshot of what an argument holds now (a later append must not change it)."""
    if value is MISSING or value is None:
        return []
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value)


def added(before, after) -> list:
    """Items ``after`` holds beyond ``before``: the tail when the allocation appended (the
    common case), else the multiset difference (it rebuilt the list)."""
    if before is MISSING:
        return after
    n = len(before)
    if after[:n] == before or all(a is b for a, b in zip(after, before)) and len(after) >= n:
        return after[n:]
    try:
        left = Counter(before)
        out = []
        for item in after:
            if left[item]:
                left[item] -= 1
            else:
                out.append(item)
        return out
    except TypeError:  # unhashable items: by identity
        seen = [id(x) for x in before]
        return [x for x in after if id(x) not in seen or seen.remove(id(x))]


# --- installing -------------------------------------------------------------------------------

def wrapper_for(guard, role, original):
    """The wrapper of the spec's own method of ``role`` when its shape needs one of these
    (ids in an argument, an allocation that shares), else None: the fast wrappers serve."""
    spec = guard.spec
    if role == "free" and carried(guard._free_param):
        return wrap_release(guard, original, spec.free, guard._free_param)
    if role == "share" and carried(guard._share_param):
        return wrap_release(guard, original, spec.share, guard._share_param)
    if role == "alloc" and spec.alloc_ids is not None:
        return wrap_alloc_into(guard, original, spec.alloc,
                               CarriedParam(original, spec.alloc_arg, spec.alloc_ids))
    return None


def wrappers_for(guard) -> dict:
    """Method name -> wrapper, for the spec's methods whose shape needs one of these."""
    out = {}
    for role in ("free", "share", "alloc"):
        name = getattr(guard.spec, role)
        wrapper = wrapper_for(guard, role, guard._bound[name]) if name else None
        if wrapper is not None:
            out[name] = wrapper
    return out


def install_extras(guard) -> None:
    """Guard the spec's ``reset``, ``also_alloc`` and ``also_free`` methods (none, if one is
    missing: the guard is taken off again and the error raised)."""
    try:
        _install_extras(guard)
    except BaseException:
        guard.unguard()
        raise


def _install_extras(guard) -> None:
    spec = guard.spec
    allocator = guard.allocator
    for name in spec.reset:
        _present(guard, allocator, name)
        guard.wrap_method(name, "resetting")
    for text in spec.also_free:
        name, where, path = parse_pattern(text)
        original = _present(guard, allocator, name)
        param = param_for(original, 0 if where is None else where, path)
        guard._shadow(name, wrap_release(guard, original, name, param), original)
    for text in spec.also_alloc:
        name, where, path = parse_pattern(text)
        original = _present(guard, allocator, name)
        if path is None and where is None:
            guard._shadow(name, _wrap_alloc_result(guard, original, name), original)
        else:
            param = param_for(original, where, path or (lambda holder: holder))
            guard._shadow(name, wrap_alloc_into(guard, original, name, param), original)


def _present(guard, allocator, name):
    method = getattr(allocator, name, None)
    if not callable(method):
        raise TypeError(f"cannot guard {guard.allocator_class}: it has no method {name!r} "
                        f"(AllocatorSpec names it)")
    return engine_method(allocator, name)


def _wrap_alloc_result(guard, original, name):
    """An extra method that hands ids out in its result, committed like the spec's alloc."""
    lock = guard.lock
    owned = lock._is_owned

    def allocate(*args, **kwargs):
        if owned():
            return original(*args, **kwargs)
        with lock:
            result = original(*args, **kwargs)
            try:
                site = guard._capture(1, guard._depth, ACTIVE_OWNER.get())
            except Exception as exc:
                site = contain(guard, exc)
            seen, result = _read_once(result)
            protect(guard, commit_allocation, guard, args, kwargs, seen, site, name)
            return result
    return allocate


def _read_once(result):
    """(what the ledger reads, what the caller gets): a list or other container is read in
    place; a one-shot iterator is drained and the caller gets a fresh one over its items."""
    try:
        if iter(result) is not result:
            return result, result
    except Exception:
        return result, result
    items = list(result)
    return items, iter(list(items))


def refuse_quarantine(guard, blocks) -> None:
    """Quarantine forwards held ids to the spec's free by themselves: impossible when that
    free takes them inside an argument."""
    if blocks and carried(guard._free_param):
        raise ValueError(f"quarantine needs a free() that takes ids: {guard.spec.free}() takes "
                         f"them inside its argument {guard.spec.free_arg!r}")
