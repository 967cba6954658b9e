"""What a guard starts from and compares against: the allocator's own free count and live ids.

At attach, the guard takes the allocator's present state: its free count (``check()`` compares
how it changes with what the ledger saw), its live ids when the spec lists them, and otherwise
how many blocks were out, which bounds how many never-seen ids are learned on their first free.
After a call the guard let through, or a resize, the comparison starts again from the present
(``rebase``).
"""

from __future__ import annotations

import logging

from ..ids import result_ids
from ..spec import per_pool, read
from .arguments import pool_key
from .telemetry import emit


def seed(guard, allocator) -> None:
    """Start from the allocator's present state: its free count, and live ids if known."""
    spec = guard.spec
    guard._baseline = free_count(guard, allocator)
    live = read(allocator, spec.live_ids) if spec.live_ids is not None else None
    if live is not None:
        pools = live.items() if isinstance(live, dict) else [(guard._default_pool(), live)]
        for pool, ids in pools:
            guard.ledger(pool).adopt(result_ids(ids, spec.id_attr, spec.skip).ids, 1)
        guard._learn = False if guard._learn is None else guard._learn
        # Blocks freed before the guard came may sit in a prefix cache, revivable by a
        # share: no spec can list those, so a refcounted pool learns them on their share.
        guard._learn_shares = spec.refcounted
        return
    out = blocks_out(guard, allocator)
    if guard._learn is None:
        guard._learn = bool(out) and any(out.values())
    guard._learn_shares = spec.refcounted and bool(guard._learn)
    # At most as many ids are learned as were out at attach (per pool): past that, an id
    # the guard never saw handed out is foreign-id again. Unknown counts: no bound.
    guard._learn_budget = out if guard._learn and out is not None else None
    for pool, ledger in guard._ledgers.items():
        ledger.learn = guard._learn
        ledger.learn_budget = budget(guard, pool)
    n = sum(out.values()) if guard._learn and out else 0
    if n:
        emit(logging.INFO, "kvguard: %s attached while %d block(s) were out: up to %d "
             "id(s) it never saw handed out are learned as live on their first free; past "
             "that, an unknown id is foreign-id", guard.name, n, n)


def blocks_out(guard, allocator):
    """How many blocks the allocator had handed out before the guard came, per pool
    (``{pool: count}``; ``None`` when its spec gives no size and free count to tell)."""
    if guard._baseline is None or guard.spec.size is None:
        return None
    try:
        size = read(allocator, guard.spec.size)
    except Exception:
        return None
    keyed = guard.spec.pool_arg is not None
    if isinstance(guard._baseline, dict):
        out = {}
        for p, c in guard._baseline.items():
            total = per_pool(size, p)
            if not isinstance(total, int):
                return None
            key = p if keyed else None
            out[key] = out.get(key, 0) + max(total - c, 0)
        return out
    if not isinstance(size, int):
        return None
    return {None: max(size - guard._baseline, 0)}


def budget(guard, pool):
    """How many never-seen ids ``pool``'s ledger may still learn (None: no bound)."""
    out = guard._learn_budget
    if out is None:
        return None
    return out.get(pool, 0)


def free_count(guard, allocator):
    """The allocator's own count of free blocks (per pool when it gives one per pool)."""
    how = guard.spec.free_count
    if how is None or allocator is None:
        return None
    value = read(allocator, how)
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        return {pool_key(k): int(v) for k, v in value.items()}
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return {n: int(v) for n, v in enumerate(value)}
    return int(value)


def rebase(guard, allocator) -> None:
    """``check()`` compares the allocator's free count from here on: its present count
    stands for the ledger's present state (after a call the guard let through, a resize)."""
    now = free_count(guard, allocator)
    if isinstance(now, dict):
        keyed = guard.spec.pool_arg is not None
        guard._baseline = {pool: count - expected_delta(guard, pool if keyed else None)
                           for pool, count in now.items()}
    elif now is not None:
        guard._baseline = now - sum(expected_delta(guard, p) for p in guard._ledgers)


def expected_delta(guard, pool) -> int:
    """How the allocator's free count should have changed since the baseline: what the ledger
    saw, less the blocks the guard holds back in quarantine."""
    ledger = guard._ledgers.get(pool)
    if ledger is None:
        return 0
    return ledger.free_delta - guard._quarantine.count(pool)


def compare(guard, allocator) -> dict:
    """``{pool: (allocator's free-count change, ledger's)}`` since the baseline."""
    now = free_count(guard, allocator)
    figures = {}
    if isinstance(now, dict):
        base = guard._baseline if isinstance(guard._baseline, dict) else {}
        for pool, count in now.items():
            key = pool if guard.spec.pool_arg is not None else None
            figures[pool] = (count - base.get(pool, count), expected_delta(guard, key))
    else:
        total = sum(expected_delta(guard, p) for p in guard._ledgers)
        figures[None] = (now - guard._baseline, total)
    return figures
