"""Block ids as the guard's fast path reads them: the few shapes engines pass on every call.

A call whose ids are plain ints or numpy integers (a 1-D integer array, a scalar, or a list of
scalars) is read here in one pass into a fresh list of plain ints. Anything else (bools, floats,
tensors, nested lists, generators, broken objects) reads as ``None`` and goes to the careful
reader in ``kvguard.ids``, which names every fault. The fast path must never accept what the
careful path would reject: a reader here returns only ids that ``ids.normalize`` reads the same
way, and the guard still checks each one against its ledger (type, range, state, duplicates)
before it takes the fast path.

numpy is never imported here: a type is numpy's only if numpy is loaded already.
"""

from __future__ import annotations

import sys
from array import array
from operator import index

OTHER, ARRAY, SCALAR = 0, 1, 2

ITERATORS = frozenset({type(iter([])), type(reversed([])), type(iter(()))})
"""One-shot iterators over a list or tuple: draining them cannot fail or run user code, so a
spec with ``iterator_ok`` (vLLM's ``free_blocks(reversed(blocks))``) reads them here."""

_kinds: dict = {int: SCALAR, bool: OTHER}
"""Type -> kind, learned per type on first sight (one dict lookup afterwards)."""
_KINDS_MAX = 512
KINDS = _kinds
"""The same table, read by the compiled wrappers (``kvguard._fastpath``): a type learned here
is read there the same way; one not learned yet goes through ``plain_ids``, which learns it."""


def _kind(tp) -> int:
    kind = _kinds.get(tp)
    if kind is not None:
        return kind
    np = sys.modules.get("numpy")
    kind = OTHER
    if np is not None:
        if tp is np.ndarray:
            kind = ARRAY
        elif isinstance(tp, type) and issubclass(tp, np.integer):  # np.bool_ is not one
            kind = SCALAR
    if len(_kinds) < _KINDS_MAX:
        _kinds[tp] = kind
    return kind


def plain_ids(value):
    """Plain ints, numpy integers, or lists/tuples of either: a new list of plain ints (never
    the caller's own list, which the allocator may mutate before the ledger is updated). None
    for anything else. Negative or huge values come back as they are: the ledger rejects them."""
    tp = type(value)
    if tp is list or tp is tuple:
        for x in value:
            if type(x) is not int:
                return _scalars(value)
        return list(value)
    if tp is int:
        return [value]
    kind = _kinds.get(tp)
    if kind is None:
        kind = _kind(tp)
    if kind == ARRAY:
        if value.ndim == 1 and value.dtype.kind in "iu":
            return value.tolist()
        return None
    if kind == SCALAR:  # read as the careful path reads it (a subclass may change int())
        return [index(value)]
    return None


def _scalars(items):
    """A list mixing plain ints and numpy integer scalars (ids taken out of an array one by one):
    converted in C by ``array('q')``; None if any item is something else."""
    kinds = _kinds
    for x in items:
        kind = kinds.get(type(x))
        if kind is None:
            kind = _kind(type(x))
        if kind != SCALAR:
            return None
    try:
        return array("q", items).tolist()
    except (OverflowError, TypeError):  # a uint64 past int64: the careful path names it
        return None
