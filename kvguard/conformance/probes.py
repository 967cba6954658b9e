"""The bad calls of the conformance clauses: each makes one from the current state of a run.

A probe first makes the state it needs (a live block to repeat, a freed block to free again,
two live blocks for a bool to be read as), so every probe the search draws is made, and the
shrunk sequence shows the calls it needed. Then it hands ``Run.probe`` the call, and the ids an
allocator that accepts it must free (none: it must be rejected). torch and numpy are imported
only by the probes that pass their values, and those are skipped where they are not installed.
"""

from __future__ import annotations

import sys


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
    ids = ids + [twice] if variant % 2 == 0 else [twice] + ids
    value, form = run.as_passed(ids)
    run.probe("duplicate-id", ids, value, form)


def _probe_dead(run, clause: str, picks) -> None:
    dead = _some_dead(run)
    if not dead:
        return
    b = dead[picks[0] % len(dead)] if picks else dead[0]
    ids = _companions(run, picks[1:]) + [b]
    value, form = run.as_passed(ids)
    run.probe(clause, ids, value, form)


def _probe_double_free(run, picks, variant=0) -> None:
    _probe_dead(run, "double-free", picks)


def _probe_past_zero(run, picks, variant=0) -> None:
    _probe_dead(run, "release-past-zero", picks)


def _probe_foreign(run, picks, variant=0) -> None:
    size = run.size
    ledger = run.ledger
    if variant % 4 == 0:
        limit = size if size is not None else max(run.live(), default=0) + 1
        never = [b for b in range(limit) if not ledger.seen(b) and b not in run.driver.reserved]
        if not never:
            return
        b = never[(picks[0] if picks else 0) % len(never)]
    elif variant % 4 == 1:
        b = -1
    else:
        if size is None:
            return
        b = size if variant % 4 == 2 else size + 1000
    thing = run.block(b)
    if thing is None:
        return  # objects cannot be made up for this pool (no Driver.block)
    ids = _companions(run, picks[1:]) + [b]
    value, form = run.as_passed(ids[:-1])
    if form == "tensor":
        import torch
        value = torch.tensor(ids, dtype=torch.int64)
    else:
        value = value + [thing]
    run.probe("foreign-id", ids, value, form)


def _probe_bool(run, picks, variant=0) -> None:
    if len(run.live()) < 2:  # a bool coerces to id 0 or 1: with blocks live, that frees one
        run.allocate(2 - len(run.live()))
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
    if variant % 2 == 0 and "torch" in sys.modules:
        import torch
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


PROBES = {
    "duplicate-id": _probe_duplicate,
    "double-free": _probe_double_free,
    "foreign-id": _probe_foreign,
    "bool-id": _probe_bool,
    "bool-mask": _probe_mask,
    "tensor-id": _probe_tensor,
    "generator": _probe_generator,
    "release-past-zero": _probe_past_zero,
}
