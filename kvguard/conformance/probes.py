"""The bad calls of the conformance clauses: each makes one from the current state of a run.

A probe first makes the state it needs (a live block to repeat, a freed block to free again,
two live blocks for a bool to be read as), so every probe the search draws is made, and the
shrunk sequence shows the calls it needed. Then it hands ``Run.probe`` the call, and the ids an
allocator that accepts it must free (none: it must be rejected). torch and numpy are imported
only by the probes that pass their values, and those are skipped where they are not installed.
"""

from __future__ import annotations


def _some_live(run) -> list:
    """Live blocks for a probe to name: one is allocated first when none is (so every probe the
    search draws is made, and the shrunk sequence shows the allocation it needs)."""
    if not run.live():
        run.allocate(1)
    return run.live()


def _some_dead(run) -> list:
    """Blocks freed already: one is allocated and freed first when there is none."""
    if not run.tombstones():
        _some_live(run)
        if run.live():
            run.free((0,))
    return run.tombstones()


def _companions(run, picks, exclude=()) -> list:
    live = [b for b in run.live() if b not in exclude]
    return run.pick(live, picks) if live and picks else []


def _probe_duplicate(run, picks, variant=0) -> None:
    live = _some_live(run)
    if not live:
        return
    ids = run.pick(live, picks)
    twice = ids[0]
    if run.spec.refcounted:
        _probe_repeat_releases(run, ids, twice, variant)
        return
    ids = ids + [twice] if variant % 2 == 0 else [twice] + ids
    value, form = run.as_passed(ids)
    run.probe("duplicate-id", ids, value, form)


def _probe_repeat_releases(run, ids, twice, variant) -> None:
    """On a refcounted pool a block named k times is k releases, legal while it holds k
    references (a block queued for two sequences): half the variants give it a second
    reference first (``share``), as a prefix hit does. A repeat past the count is a release
    past zero, that clause's call."""
    if variant % 2 == 0 and run.spec.share and run.ledger.refcount(twice) < 2:
        run.share_ids([twice])
    refs = run.ledger.refcount(twice)
    if refs < 2:
        return
    ids = ids + [twice] * (refs - 1)
    value, form = run.as_passed(ids)
    run.probe("duplicate-id", ids, value, form, effect=ids)


def _probe_dead(run, clause: str, picks, variant=0) -> None:
    """Free a block already freed: through ``free``, or (half the variants, where the pool has
    one) through its own reference-count release of the block object."""
    dead = _some_dead(run)
    if not dead:
        return
    b = dead[picks[0] % len(dead)] if picks else dead[0]
    if variant % 2 == 1 and run.driver.release is not None and b in run.objects:
        run.probe(clause, [b], run.objects[b], "release", via_release=True)
        return
    ids = _companions(run, picks[1:]) + [b]
    value, form = run.as_passed(ids)
    run.probe(clause, ids, value, form)


def _probe_double_free(run, picks, variant=0) -> None:
    _probe_dead(run, "double-free", picks, variant)


def _probe_past_zero(run, picks, variant=0) -> None:
    """A release of a block at zero references: one already released, or (half the
    variants) a live block named once more than it has references."""
    if variant % 2 == 0:
        _probe_dead(run, "release-past-zero", picks, 0)
        return
    live = _some_live(run)
    if not live:
        return
    ids = run.pick(live, picks)
    ids = ids + [ids[0]] * run.ledger.refcount(ids[0])
    value, form = run.as_passed(ids)
    run.probe("release-past-zero", ids, value, form)


def _probe_foreign(run, picks, variant=0) -> None:
    """An in-range block the pool never handed out: one still free, or (a quarter of the
    variants) a reserved one, the padding slot callers put in their tables."""
    size = run.size
    ledger = run.ledger
    limit = size if size is not None else max(run.live(), default=0) + 1
    reserved = [b for b in run.driver.reserved if 0 <= b < limit]
    never = [b for b in range(limit) if not ledger.seen(b) and b not in run.driver.reserved]
    pool = reserved if variant % 4 == 3 and reserved else never
    if not pool:
        return
    b = pool[(picks[0] if picks else 0) % len(pool)]
    thing = run.block(b)
    if thing is None:
        return  # objects the pool never handed out cannot be had (no Driver.block)
    _probe_with(run, "foreign-id", _companions(run, picks[1:]), b, thing)


def _probe_with(run, clause, companions, b, thing) -> None:
    """Free the live ``companions`` and ``b`` (passed as ``thing``) in the API's own form."""
    ids = companions + [b]
    value, form = run.as_passed(companions)
    if form == "tensor":
        import torch
        value = torch.tensor(ids, dtype=torch.int64)
    elif form == "objects":
        value = value + [thing]
    elif run.driver.typed and type(b) is int:
        import numpy
        value = numpy.asarray(ids, dtype=numpy.int64)
        form = "array"
    else:
        value = value + [thing]
    run.probe(clause, ids, value, form, intent=list(companions))


def _probe_invalid(run, picks, variant=0) -> None:
    """An id that is no block of the pool: -1 (list and numpy indexing wrap it to the last
    block, so that block is made live first, and a wrapped free shows), one past the pool,
    far past it; on a list-of-ints API also a float, a string or None naming a live block."""
    size = run.size
    if run.spec.id_attr is not None:
        return
    kinds = ["negative", "past", "far"]
    if not run.spec.tensor_ok and not run.driver.typed:
        kinds += ["float", "str", "none"]
    kind = kinds[variant % len(kinds)]
    if kind == "negative" and size is not None and not run.ledger.is_live(size - 1):
        _make_live(run, [size - 1])
    if kind in ("past", "far") and size is None:
        return
    live = _some_live(run)
    if not live:
        return
    companions = _companions(run, picks[1:])
    named = live[(picks[0] if picks else 0) % len(live)]
    b = {"negative": -1, "past": size, "far": (size or 0) + 1000, "float": float(named),
         "str": str(named), "none": None}[kind]
    _probe_with(run, "invalid-id", [c for c in companions if c != named or kind in
                                    ("negative", "past", "far")], b, b)


def _make_live(run, wanted) -> None:
    """Allocate one block at a time until every block of ``wanted`` the pool can hand out is
    live (or the pool is full): pools hand ids out in their own order, high ids first too."""
    wanted = [b for b in wanted if b not in run.driver.reserved and run.ledger.in_range(b)]
    while run.expected_free() > 0 and not all(run.ledger.is_live(b) for b in wanted):
        before = len(run.steps)
        run.allocate(1)
        if len(run.steps) == before or run.steps[-1].rejected:
            return


def _probe_bool(run, picks, variant=0) -> None:
    _make_live(run, [0, 1])  # a bool is id 0 or 1 to operator.index: freeing it frees one
    if not run.live():
        return
    if variant % 3 == 0:
        run.probe("bool-id", [True], True, "bool")
    elif variant % 3 == 1:
        run.probe("bool-id", [True], [True], "bool-list")
    else:
        ids = _companions(run, picks)
        value, _ = run.as_passed(ids)
        if not isinstance(value, list):
            return
        run.probe("bool-id", ids + [False], value + [False], "bool-list")


def _probe_mask(run, picks, variant=0) -> None:
    live = _some_live(run)
    if not live or run.spec.id_attr is not None:
        return
    chosen = run.pick(live, picks)
    length = run.size if run.size is not None else max(live) + 1
    mask = [b in chosen for b in range(length)]
    torch = _optional("torch") if variant % 2 == 0 else None
    if torch is not None:  # never "whether someone imported torch": the same seed, one verdict
        value, form = torch.tensor(mask, dtype=torch.bool), "mask-tensor"
    else:
        try:
            import numpy
        except ImportError:
            return
        value, form = numpy.array(mask, dtype=bool), "mask-array"
    run.probe("bool-mask", sorted(chosen), value, form, effect=sorted(chosen))


def _probe_tensor(run, picks, variant=0) -> None:
    if run.spec.tensor_ok or run.spec.id_attr is not None:
        return
    try:
        import torch
    except ImportError:
        return
    live = _some_live(run)
    ids = run.pick(live, picks)
    others = [b for b in live if b not in ids]
    # After the call the caller reuses its tensor: a view kept inside the allocator now names
    # a live block (or one past the pool), which the next allocation shows.
    mutate = others[0] if others else (run.size if run.size is not None else -1)
    if variant % 3 == 0:
        value, form = torch.tensor(ids, dtype=torch.int64), "tensor"
        run.probe("tensor-id", ids, value, form, effect=ids, mutate_to=mutate)
    elif variant % 3 == 1:
        value = torch.tensor(ids[0], dtype=torch.int64)
        run.probe("tensor-id", ids[:1], value, "scalar-tensor", effect=ids[:1],
                  mutate_to=mutate)
    else:
        tensor = torch.tensor(ids, dtype=torch.int64)
        run.probe("tensor-id", ids, list(tensor), "tensor-elements", effect=ids)


def _probe_generator(run, picks, variant=0) -> None:
    live = _some_live(run)
    if not live:
        return
    ids = run.pick(live, picks)
    value, form = run.as_passed(ids)
    if not isinstance(value, list):
        value = value.tolist() if hasattr(value, "tolist") else list(value)
    run.probe("generator", ids, (x for x in value), "generator", effect=ids)


def _optional(name):
    try:
        return __import__(name)
    except ImportError:
        return None


PROBES = {
    "duplicate-id": _probe_duplicate,
    "double-free": _probe_double_free,
    "foreign-id": _probe_foreign,
    "invalid-id": _probe_invalid,
    "bool-id": _probe_bool,
    "bool-mask": _probe_mask,
    "tensor-id": _probe_tensor,
    "generator": _probe_generator,
    "release-past-zero": _probe_past_zero,
}
