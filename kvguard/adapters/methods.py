"""Engine methods that an ``AllocatorSpec``'s three names cannot cover, guarded by the same guard.

Real allocators hand out ids from more than one method (SGLang's ``alloc``/``alloc_extend``/
``alloc_decode``, LMCache's ``allocate``/``batched_allocate``), take them back through more than
one (vLLM's ``free_blocks`` and ``unpin_blocks``), return everything at once (Hugging Face's
``CachePool.reset``), or free later what a caller already gave up (SGLang's free groups). Each
function here returns an installer; ``adapter(*installers)`` bundles them into the callable an
``AllocatorSpec(adapter=...)`` runs once its guard is attached. The installers shadow methods on
the guarded instance the way the guard shadows its own: same lock (so the allocator's calls to
itself pass through), same ledger, same checks and reports, and ``unguard()`` restores them.

This module reaches into the guard's slow path (``_plan_release``, ``_route_free``,
``_commit_release``, ``_after_alloc``): it is the guard's own machinery, split out per engine.
"""

from __future__ import annotations

import inspect

from ..guard import _MISSING, _one_shot, engine_method
from ..errors import error_for
from ..ids import normalize
from ..owners import ACTIVE_OWNER as _current_owner
from ..spec import per_pool, read
from ..stacks import SITES


def adapter(*installers):
    """The ``AllocatorSpec.adapter`` that runs each installer on a newly attached guard."""
    def install(guard) -> None:
        for installer in installers:
            installer(guard)
    install.installers = installers
    return install


def _shadow(guard, name, build):
    """Replace ``name`` on the guarded instance by ``build(original)``; unguard() restores it.
    A method the instance lacks (another version of the engine) is left alone."""
    allocator = guard.allocator
    if name in guard.spec.methods():
        raise TypeError(f"{name}() is already guarded by the spec itself")
    original = engine_method(allocator, name) if hasattr(allocator, name) else None
    if not callable(original):
        return  # another version of the engine, without this method: nothing to guard
    own = vars(allocator)
    guard._originals.setdefault(name, own.get(name, _MISSING))
    wrapper = build(original)
    wrapper.__wrapped__ = original
    wrapper.__kvguard__ = guard
    own[name] = wrapper


def allocating(name, convert=None):
    """``name`` hands out ids, like the spec's ``alloc``. ``convert(allocator, result)`` turns
    its result into the ids the ledger tracks (SGLang's paged allocator returns token slots and
    is tracked by page)."""
    def install(guard) -> None:
        def build(original):
            lock = guard._lock
            owned = lock._is_owned
            allocator = original.__self__

            def after(args, kwargs, result, site):
                ids = convert(allocator, result) if convert is not None else result
                guard._after_alloc(args, kwargs, ids, site, name)

            def wrapper(*args, **kwargs):
                if owned():
                    return original(*args, **kwargs)
                with lock:
                    result = original(*args, **kwargs)
                    site = _site(guard, _current_owner.get())
                    seen, result = _one_shot(result)
                    guard._protect(after, args, kwargs, seen, site)
                    return result
            return wrapper
        _shadow(guard, name, build)
    return install


def freeing(name):
    """``name`` takes ids back as its first argument, checked like the spec's ``free``."""
    def install(guard) -> None:
        if guard._free_param.pos != 0:
            raise TypeError(f"{name}(): extra freeing methods need the spec's free_arg at "
                            "position 0")

        def build(original):
            lock = guard._lock
            owned = lock._is_owned
            first = _first_parameter(original)

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
                        plan = guard._plan_release(name, args, kwargs, args[0], f"{name}()",
                                                   site)
                    except Exception as exc:
                        if guard.mode == "raise":
                            raise
                        guard._internal_error(exc)
                        return original(*args, **kwargs)
                    if plan.aside:
                        return guard._forward_aside(original, args, kwargs, plan)
                    routed = guard._protect(guard._route_free, plan, args, kwargs)
                    args, kwargs, forward = routed or (args, kwargs, True)
                    result = original(*args, **kwargs) if forward else None
                    guard._protect(guard._commit_release, plan)
                    return result
            return wrapper
        _shadow(guard, name, build)
    return install


def checking(name):
    """``name`` takes ids whose form is checked (bools, floats, 2-D tensors, negative ids) but
    leaves the bookkeeping to the spec's ``free``, which it calls itself: the lock is not held
    while it runs, so that inner call is checked and counted. (SGLang's paged ``free()`` takes
    token slots and releases pages through ``_release_page_ids``; a bool mask must be named as
    such before ``// page_size`` turns it into page 0.)"""
    def install(guard) -> None:
        def build(original):
            lock = guard._lock
            owned = lock._is_owned
            first = _first_parameter(original)
            spec = guard.spec

            def wrapper(*args, **kwargs):
                if owned():
                    return original(*args, **kwargs)
                value = args[0] if args else kwargs.get(first, _MISSING)
                if value is _MISSING:
                    return original(*args, **kwargs)
                with lock:
                    try:
                        violations = _form_violations(guard, name, value, spec)
                    except Exception as exc:
                        if guard.mode == "raise":
                            raise
                        guard._internal_error(exc)
                        violations = []
                    aside = bool(violations) and guard._stepping_aside(violations[0].kind)
                    for v in violations:
                        if aside:
                            v.extra["stepped_aside"] = True
                        guard._record(v)
                if violations and guard.mode == "raise" and not aside:
                    raise error_for(violations[0])
                if violations and guard.mode == "repair":
                    return None  # a malformed argument cannot be sanitized: the call is dropped
                return original(*args, **kwargs)
            return wrapper
        _shadow(guard, name, build)
    return install


def _form_violations(guard, name, value, spec) -> list:
    norm = normalize(value, tensor_ok=spec.tensor_ok, id_attr=spec.id_attr, skip=spec.skip,
                     what=f"{name}()")
    ledger = guard.ledger(None)
    return [guard._violation(f.kind, f.block_ids, f.message, name, None, ledger, f.block_ids)
            for f in norm.faults]


def resetting(name, follow=None):
    """``name`` returns every block of every sub-pool to the allocator (Hugging Face's
    ``CachePool.reset()``, SGLang's ``clear()``): the ledgers follow, so blocks handed out
    again afterwards are not mistaken for blocks handed out twice."""
    follow = follow or _forget_all

    def install(guard) -> None:
        def build(original):
            lock = guard._lock
            owned = lock._is_owned

            def wrapper(*args, **kwargs):
                if owned():
                    return original(*args, **kwargs)
                with lock:
                    result = original(*args, **kwargs)
                    guard._protect(follow, guard, _site(guard))
                    return result
            return wrapper
        _shadow(guard, name, build)
    return install


def resizing(name):
    """``name`` gives the allocator another size and returns every block (SGLang's
    ``resize(config)``, which ends in its own ``clear()``, a pass-through under the lock): the
    ledgers forget every live block, take the new size (an id past it is then out of range, new
    ids are unseen) and ``check()`` counts from the rebuilt pool."""
    return resetting(name, _follow_resize)


def _follow_resize(guard, site) -> None:
    _forget_all(guard, site)
    spec = guard.spec
    allocator = guard.allocator
    if spec.size is not None:
        sizes = read(allocator, spec.size)
        for pool, ledger in guard._ledgers.items():
            size = per_pool(sizes, pool)
            if ledger.size is not None and size is not None:
                ledger.resize(int(size))
    guard._rebase(allocator)


def _forget_all(guard, site) -> None:
    clock = guard._tick()
    for pool, ledger in guard._ledgers.items():
        live = ledger.live_ids()
        stamp, freed_at, ref = ledger.stamp, ledger.freed_at, ledger.ref
        for b in live:
            stamp[b] = -clock
            freed_at[b] = site
            if ref is not None:
                ref[b] = 0
        guard._quarantine.pop(pool, None)  # the reset gave the held blocks back already
        if live and guard.history is not None:
            guard.history.append((-clock, tuple(live), site, pool, "reset"))
        for watcher in guard._watchers:
            watcher.on_free(guard, pool, live)


def settled(name, when):
    """While ``when(allocator)`` holds, the frees ``name`` makes were already checked and
    counted when the caller asked for them: hold the guard's lock across it so the allocator's
    inner calls pass through. Otherwise those inner calls are checked like any other (SGLang's
    ``free_group_end()`` releases the frees deferred since ``free_group_begin()``; called
    again without an open group, before sglang#36739 it freed the same ids a second time)."""
    def install(guard) -> None:
        def build(original):
            lock = guard._lock
            owned = lock._is_owned
            allocator = original.__self__

            def wrapper(*args, **kwargs):
                if owned() or not when(allocator):
                    return original(*args, **kwargs)
                with lock:
                    return original(*args, **kwargs)
            return wrapper
        _shadow(guard, name, build)
    return install


def _site(guard, owner=0) -> int:
    """The interned call site of the wrapper's caller (0 if it cannot be had: log and repair
    mode carry on without one, raise mode shows the guard's own bug)."""
    try:
        return SITES.capture(2, guard._depth, owner)
    except Exception as exc:
        if guard.mode == "raise":
            raise
        guard._internal_error(exc)
        return 0


def _first_parameter(method):
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return None
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return None
