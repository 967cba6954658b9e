"""Extra engine methods, guarded by their role: what ``Guard.wrap_method`` builds.

An ``AllocatorSpec`` names one allocating, one freeing and one sharing method; real engines
hand ids out, take them back, check them or return everything through others too (see
``kvguard.adapters.methods``). A role says what such a method does to the blocks, and the
wrapper built here checks it the way the guard checks its own methods: same lock (the
allocator's calls to itself pass through), same ledger, same reports; ``unguard()`` restores it.

- ``allocating``: hands ids out (``convert(allocator, result)`` turns its result into ids).
- ``freeing``: takes ids back as its first argument.
- ``checking``: takes ids whose form is checked, and frees them through the spec's own free
  (the lock is not held while it runs, so that inner call is checked and counted).
- ``resetting``: returns every block of every sub-pool; the ledgers follow.
- ``resizing``: gives the allocator another size (and every block back); the ledgers take it.
  With ``pool(args, kwargs)``: one sub-pool starts afresh with another id space.
- ``settled``: while ``when(allocator)`` holds, the frees it makes were checked when asked for.
"""

from __future__ import annotations

from ..ids import normalize
from ..owners import ACTIVE_OWNER
from ..stacks import SITES
from . import evidence
from .arguments import MISSING, first_parameter
from .bookkeeping import commit_allocation, follow_resize, forget_all
from .careful import forward_release, plan_release
from .decisions import REPAIR, contain, protect, settle
from .instances import engine_method
from .readers import one_shot

ROLES = ("allocating", "freeing", "checking", "resetting", "resizing", "settled")


def wrap_method(guard, name, role, *, convert=None, when=None, pool=None) -> None:
    """Shadow ``name`` on the guarded instance with the wrapper of ``role``. A method the
    instance lacks (another version of the engine) is left alone."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
    if role == "settled" and not callable(when):
        raise TypeError(f"{name}(): the settled role needs when=, a callable taking the "
                        f"allocator, not {when!r}")
    if role == "freeing" and guard._free_param.pos != 0:
        raise TypeError(f"{name}(): extra freeing methods need the spec's free_arg at "
                        "position 0")
    allocator = guard.allocator
    if name in guard.spec.methods():
        raise TypeError(f"{name}() is already guarded by the spec itself")
    original = engine_method(allocator, name) if hasattr(allocator, name) else None
    if not callable(original):
        return
    if role == "allocating":
        wrapper = _allocating(guard, name, original, convert)
    elif role == "freeing":
        wrapper = _freeing(guard, name, original)
    elif role == "checking":
        wrapper = _checking(guard, name, original)
    elif role == "settled":
        wrapper = _settled(guard, original, when)
    elif role == "resizing" and pool is not None:
        wrapper = _restarting(guard, original, pool)
    else:
        wrapper = _following(guard, original, follow_resize if role == "resizing" else forget_all)
    guard._shadow(name, wrapper, original)


def _allocating(guard, name, original, convert):
    lock = guard.lock
    owned = lock._is_owned
    allocator = original.__self__

    def after(args, kwargs, result, site):
        ids = convert(allocator, result) if convert is not None else result
        commit_allocation(guard, args, kwargs, ids, site, name)

    def wrapper(*args, **kwargs):
        if owned():
            return original(*args, **kwargs)
        with lock:
            result = original(*args, **kwargs)
            site = _site(guard, ACTIVE_OWNER.get())
            seen, result = one_shot(result)
            protect(guard, after, args, kwargs, seen, site)
            return result
    return wrapper


def _freeing(guard, name, original):
    lock = guard.lock
    owned = lock._is_owned
    first = first_parameter(original)

    def wrapper(*args, **kwargs):
        if owned():
            return original(*args, **kwargs)
        if not args and first in kwargs:
            kwargs = dict(kwargs)
            args = (kwargs.pop(first),)
        if not args:  # no ids at all: the allocator's own TypeError says it best
            return original(*args, **kwargs)
        with lock:
            try:
                site = _site(guard)
                plan = plan_release(guard, name, args, kwargs, args[0], f"{name}()", site)
            except Exception as exc:
                contain(guard, exc)
                return original(*args, **kwargs)
            return forward_release(guard, original, args, kwargs, plan)
    return wrapper


def _checking(guard, name, original):
    lock = guard.lock
    owned = lock._is_owned
    first = first_parameter(original)
    spec = guard.spec

    def wrapper(*args, **kwargs):
        if owned():
            return original(*args, **kwargs)
        value = args[0] if args else kwargs.get(first, MISSING)
        if value is MISSING:
            return original(*args, **kwargs)
        with lock:
            try:
                norm = normalize(value, tensor_ok=spec.tensor_ok, id_attr=spec.id_attr,
                                 skip=spec.skip, distinct=False, what=f"{name}()")
                ledger = guard.ledger(None)
                found = [evidence.violation(guard, f.kind, f.block_ids, f.message, name, None,
                                            ledger, f.block_ids) for f in norm.faults]
            except Exception as exc:
                contain(guard, exc)
                found = []
            verdict = settle(guard, found)
        if verdict == REPAIR:
            return None  # a malformed argument cannot be sanitized: the call is dropped
        return original(*args, **kwargs)
    return wrapper


def _following(guard, original, follow):
    lock = guard.lock
    owned = lock._is_owned

    def wrapper(*args, **kwargs):
        if owned():
            return original(*args, **kwargs)
        with lock:
            result = original(*args, **kwargs)
            protect(guard, follow, guard, _site(guard))
            return result
    return wrapper


def _restarting(guard, original, pool):
    lock = guard.lock

    def wrapper(*args, **kwargs):
        with lock:
            result = original(*args, **kwargs)
            guard._forget_pool(pool(args, kwargs))
            return result
    return wrapper


def _settled(guard, original, when):
    lock = guard.lock
    owned = lock._is_owned
    allocator = original.__self__

    def wrapper(*args, **kwargs):
        if owned() or not when(allocator):
            return original(*args, **kwargs)
        with lock:
            return original(*args, **kwargs)
    return wrapper


def _site(guard, owner=0) -> int:
    """The interned call site of the wrapper's caller (0 if it cannot be had: log and repair
    mode carry on without one, raise mode shows the guard's own bug)."""
    try:
        return SITES.capture(2, guard._depth, owner)
    except Exception as exc:
        return contain(guard, exc)
