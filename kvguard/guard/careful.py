"""The careful path of a guarded call: read the ids exactly, check, decide, forward, commit.

Every call the fast path in ``shadowing`` cannot take comes here, and so does every call of an
extra freeing method (``roles``). The walk goes one way: the ids are read by ``kvguard.ids``,
checked against the ledger by ``checker``, settled by ``decisions`` (raise, log, repair, step
aside), forwarded to the allocator and committed by ``bookkeeping``.
"""

from __future__ import annotations

from ..ids import normalize
from ..owners import ACTIVE_OWNER, holder_now
from .arguments import MISSING
from .bookkeeping import commit_allocation, commit_release, follow_allocator
from .checker import check_release
from .decisions import contain, drains, protect, reject_faults, route_free
from .readers import UNSIZED_READ, one_shot


def free_slow(guard, original, args, kwargs, value):
    """A free() the fast path did not take. (Called by the wrapper: the site is 2 frames up.)"""
    if value is MISSING:  # no ids at all: the allocator's own TypeError says it best
        return original(*args, **kwargs)
    method = guard.spec.free
    try:
        site = guard._capture(2, guard._depth)
        plan = plan_release(guard, method, args, kwargs, value, f"{method}()", site)
    except Exception as exc:
        contain(guard, exc)
        return original(*args, **kwargs)
    return forward_release(guard, original, args, kwargs, plan)


def share_slow(guard, original, args, kwargs):
    """A share() the fast path did not take: a share hands a block out, so it has an owner."""
    value = guard._share_param.get(args, kwargs)
    method = guard.spec.share
    try:
        site = guard._capture(2, guard._depth, ACTIVE_OWNER.get())
        plan = plan_release(guard, method, args, kwargs, value, f"{method}()", site)
    except Exception as exc:
        contain(guard, exc)
        return original(*args, **kwargs)
    if plan.norm.consumed or plan.norm.forward is not None:
        args, kwargs = guard._share_param.put(args, kwargs, plan.norm.materialized if
                                              plan.norm.consumed else plan.norm.forward)
    if plan.aside:
        return forward_aside(guard, original, args, kwargs, plan)
    result = original(*args, **kwargs)
    protect(guard, commit_release, guard, plan)
    return result


def plan_release(guard, method, args, kwargs, value, what, site):
    """Read and check the ids of a release (``method``: the spec's free or share, or an extra
    freeing method); settle its faults. Returns the plan it is forwarded and committed by."""
    spec = guard.spec
    pool = guard._pool_of(method, args, kwargs)
    ledger = guard.ledger(pool)
    norm = normalize(value, tensor_ok=spec.tensor_ok, id_attr=spec.id_attr, skip=spec.skip,
                     iterator_ok=spec.iterator_ok, consume=drains(guard), what=what)
    plan = check_release(ledger, norm, method=method, pool=pool, site=site, what=what,
                         share=method == spec.share, learn_shares=guard._learn_shares,
                         refcount_attr=spec.refcount_attr, holder=holder_now())
    if plan.faults:
        reject_faults(guard, plan)
    return plan


def forward_release(guard, original, args, kwargs, plan):
    """Forward a planned release as ``decisions.route_free`` says, then commit it."""
    if plan.aside:
        return forward_aside(guard, original, args, kwargs, plan)
    args, kwargs, forward = protect(guard, route_free, guard, plan, args, kwargs) or (
        args, kwargs, True)
    result = original(*args, **kwargs) if forward else None
    protect(guard, commit_release, guard, plan)
    return result


def forward_aside(guard, original, args, kwargs, plan):
    """A bad call the guard stepped aside for reaches the allocator untouched. Whatever the
    allocator did with it, or refused to do by raising, the ledger then follows."""
    try:
        result = original(*args, **kwargs)
        commit_release(guard, plan)
    finally:
        follow_allocator(guard)
    return result


def alloc_slow(guard, capture, args, kwargs, result, depth, up=1):
    """An allocation's careful tail: the site captured ``up`` frames above this one (1 for the
    compiled wrapper, which has no frame of its own; 2 for the closure, which calls this), the
    result read once and committed."""
    try:
        site = capture(up, depth, ACTIVE_OWNER.get())
    except Exception as exc:
        site = contain(guard, exc)
    seen, result = one_shot(result, read_bound(guard, args, kwargs))
    protect(guard, commit_allocation, guard, args, kwargs, seen, site)
    return result


def read_bound(guard, args, kwargs) -> int:
    """How many ids of a lazy allocation result the guard reads: one more than the call's pool
    has blocks (a result that long repeats an id or leaves the pool, and the ledger names it),
    never the whole of an endless iterator."""
    try:
        size = guard.ledger(guard._pool_of(guard.spec.alloc, args, kwargs)).size
    except Exception:
        size = None
    return UNSIZED_READ if size is None else size + 1
