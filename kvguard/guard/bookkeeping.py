"""The one place a guard's careful path changes its ledgers, counters and flight recorder.

A checked call is committed after the allocator took it (a release, a share) or handed ids out
(an allocation); a reset or resize makes the ledgers forget; a call the guard let through with
bad input makes them follow the allocator's own word. The hot paths in ``shadowing`` write the
same columns inline, in the same way; a differential test holds the two together.
"""

from __future__ import annotations

from ..ids import result_ids
from ..owners import holder_now
from ..spec import per_pool, read
from .. import kinds
from . import baseline, evidence, leases, selfcheck
from .checker import check_handout
from .decisions import received_as_given, settle
from .telemetry import internal_error


def commit_release(guard, plan) -> None:
    """Apply a checked free() or share() to the ledger, the counters and the flight recorder;
    then raise what the watchers find in blocks a share revives."""
    ledger = plan.ledger
    clock = guard._tick()
    stats = guard.stats
    share = plan.method == guard.spec.share
    if plan.learned:
        if ledger.learn_budget is not None and not share:
            ledger.learn_budget -= sum(1 for b in plan.learned if not ledger.seen(b))
            if ledger.learn_budget <= 0:
                ledger.learn = False
        ledger.adopt(plan.learned, clock)
        stats.learned += len(plan.learned)
    ids = plan.good + plan.learned
    if plan.stale and received_as_given(guard, plan):  # the allocator freed them as asked
        ids = ids + plan.stale
    site = plan.site
    if plan.held is not None:
        follow_engine_refcounts(ledger, plan)
    revived = ()
    if share:
        if guard._watchers:  # free blocks a share takes back (a prefix-cache hit)
            stamp = ledger.stamp
            revived = [b for b in ids if stamp[b] < 0]
        ledger.share(ids, clock, site, plan.holder)
        stats.share_calls += 1
        stats.blocks_shared += len(ids)
        op = "share"
    else:
        if ledger.ref is not None:
            dropping = [b for b in ids if ledger.ref[b] == 1]
        else:
            dropping = ids
        stats.blocks_freed += ledger.release(ids, clock, site, plan.holder)
        stats.free_calls += 1
        op = "free"
        for watcher in guard._watchers:
            watcher.on_free(guard, plan.pool, dropping)
    if guard.history is not None:
        # The flight recorder keeps what the allocator received (log mode forwards a faulty
        # call untouched), so `kvguard replay` can find where the allocator went wrong.
        received = plan.norm.ids if received_as_given(guard, plan) else ids
        evidence.record(guard.history, (clock, received, site, plan.pool, op), plan.faulty)
    if revived:
        settle(guard, watched(guard, "on_share", plan.method, plan.pool, ledger, revived))


def commit_allocation(guard, args, kwargs, result, site, method=None) -> None:
    """Check and apply what an allocation handed out (the careful path: any form of result);
    raise what is wrong with it, or what the watchers find in the fresh blocks."""
    spec = guard.spec
    method = method or spec.alloc
    pool = guard._pool_of(method, args, kwargs)
    ledger = guard.ledger(pool)
    norm = result_ids(result, spec.id_attr, spec.skip)
    fresh, faults = check_handout(ledger, norm, method)
    if faults:  # what the allocator's own state explains is the spec's gap, not a fault
        fresh, faults = selfcheck.review_handout(guard, ledger, norm, fresh, faults, method, site)
    violations = [evidence.violation(guard, f.kind, f.block_ids, f.message, method, pool, ledger,
                                     f.block_ids) for f in faults]
    for v in violations:
        if v.kind == kinds.FREE_IN_FLIGHT:  # name the steps still using the block
            v.extra["in_flight_steps"] = [repr(step) for step in leases.steps_using(
                guard, ledger, v.block_ids[0])]
    clock = guard._tick()
    ledger.allocate(fresh, clock, site, holder_now())
    guard.stats.alloc_calls += 1
    guard.stats.blocks_allocated += len(fresh)
    if guard.history is not None:
        evidence.record(guard.history, (clock, norm.ids, site, pool, "allocate"), faults)
    violations += watched(guard, "on_alloc", method, pool, ledger, fresh)
    settle(guard, violations)


def watched(guard, hook, method, pool, ledger, ids) -> list:
    """What the watchers' ``hook`` (``on_alloc``, ``on_share``) finds in blocks handed out by
    ``method``. ``on_share`` is optional in the watcher protocol."""
    found = []
    for watcher in guard._watchers:
        check = getattr(watcher, hook, None)
        for kind, block_ids, message, extra in (check(guard, pool, ids) or ()) if check else ():
            v = evidence.violation(guard, kind, block_ids, message, method, pool, ledger,
                                   block_ids)
            v.extra.update(extra)
            found.append(v)
    return found


def follow_engine_refcounts(ledger, plan) -> None:
    """[refcount_attr] Before a release is committed, each live block's count in the ledger
    becomes the engine's: references the engine took or dropped behind the guard (vLLM's
    copy-on-write ``ref_cnt += 1``) are no longer missing. The release then drops one, as the
    engine is about to. Learned blocks keep their learned count of 1."""
    ref = ledger.ref
    if ref is None:
        return
    good = set(plan.good)
    uncertain = ledger.uncertain
    for b, count in zip(plan.norm.ids, plan.held):
        if b in good and type(count) is int and count > 0 and ref[b] != count:
            ref[b] = count
            if uncertain:
                uncertain.discard(b)


def forget_all(guard, site) -> None:
    """The allocator took every block back (a reset): each live block becomes free."""
    clock = guard._tick()
    for pool, ledger in guard._ledgers.items():
        live = ledger.reset(clock, site)
        guard._quarantine.forget(pool)  # the reset gave the held blocks back already
        if live and guard.history is not None:
            guard.history.append((clock, tuple(live), site, pool, "reset"))
        for watcher in guard._watchers:
            watcher.on_free(guard, pool, live)


def follow_resize(guard, site) -> None:
    """The allocator was given another size and took every block back: the ledgers forget every
    live block, take the new size and ``check()`` counts from the rebuilt pool."""
    forget_all(guard, site)
    spec = guard.spec
    allocator = guard.allocator
    if spec.size is not None:
        sizes = read(allocator, spec.size)
        for pool, ledger in guard._ledgers.items():
            size = per_pool(sizes, pool)
            if ledger.size is not None and size is not None:
                ledger.resize(int(size))
    baseline.rebase(guard, allocator)


def follow_allocator(guard) -> None:
    """Take the allocator's word after a call the guard let through with bad input: the
    live ids it reports (the spec's ``live_ids``) become the ledger's, and ``check()``
    compares its free count from here on. Never raises: the allocator's own exception, if
    any, is what the caller must see."""
    allocator = guard.allocator
    if allocator is None:
        return
    spec = guard.spec
    try:
        if spec.live_ids is not None:
            live = read(allocator, spec.live_ids)
            if live is not None:
                pools = live.items() if isinstance(live, dict) else [
                    (guard._default_pool(), live)]
                clock = guard._tick()
                for pool, ids in pools:
                    guard.ledger(pool).follow(result_ids(ids, spec.id_attr, spec.skip).ids,
                                              clock)
        baseline.rebase(guard, allocator)
    except Exception as exc:
        internal_error(guard, exc)
