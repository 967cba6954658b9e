"""The fast path's readers: the ids of a call read into plain ints in one pass, or None when the
careful path must read them (and name what is wrong). Shared by the closures of ``shadowing``
and, where the compiled wrappers read ids themselves, described to them by the same values.
"""

from __future__ import annotations

import itertools
import operator
import sys

from ..fastread import plain_ids
from ..ids import torch_tensor_type
from ..marks import THE_ALLOCATOR
from .arguments import MISSING


def fast_reader(guard, result: bool):
    """The fast path's reader of ids for this spec, or None when it has none (dotted
    ``id_attr``, a ``skip`` over plain ids). ``read(value)`` returns a new list of plain
    ints, or None: then the careful path reads the value and decides."""
    spec = guard.spec
    if spec.id_attr is not None:
        if "." in spec.id_attr:
            return None
        get = operator.attrgetter(spec.id_attr)
        skip = spec.skip
        # A skipped item (vLLM's null block) is passed through unchecked: that is the careful
        # path's business. ``skip.keeps_all(allocator, items)`` answers for a whole call at
        # once (True: no item is skipped); otherwise each item is asked.
        keeps_all = getattr(skip, "keeps_all", None)
        allocator = guard.allocator

        def read_objects(value):
            tp = type(value)
            if tp is not list and tp is not tuple:
                return None
            if skip is not None:
                if keeps_all is not None:
                    if not keeps_all(allocator, value):
                        return None
                elif any(map(skip, value)):
                    return None
            return list(map(get, value))  # an object without the id: the careful path
        return read_objects
    if spec.skip is not None:
        return None
    if not (result or spec.tensor_ok):
        return plain_ids

    def read_or_tensor(value):
        ids = plain_ids(value)
        return ids if ids is not None else int_tensor_ids(value)
    return read_or_tensor


def fast_ledger(guard, method):
    """``(main, ledger_of)``: the ``Ledger.hot`` columns of a spec without sub-pools, or
    ``ledger_of(args, kwargs)`` giving those of the call's sub-pool when its key is a plain
    int (or absent) and its ledger exists, else None (careful path)."""
    param = guard._pool_params.get(method)
    if param is None:
        return guard.ledger(guard._default_pool()).hot, None
    ledgers = guard._ledgers
    get = param.get

    def ledger_of(args, kwargs):
        key = get(args, kwargs)
        if key is MISSING:
            key = None
        elif key is not None and type(key) is not int:
            return None
        ledger = ledgers.get(key)
        return None if ledger is None else ledger.hot
    return None, ledger_of


def keeps_all_for(skip, allocator):
    """What the compiled wrapper asks before reading block objects: ``skip.keeps_all`` (called
    as the closure calls it), or, where it declares ``identities`` (``(attribute, object)``
    pairs, ``THE_ALLOCATOR`` for the allocator), those pairs, which C checks item by item
    without a Python call: every item's attribute must *be* the object. Stricter than a Python
    ``keeps_all`` that tests truth (``is_null`` being 0 is not ``False``), never looser: an
    item that fails goes to the careful path, whose verdict is the one the fast path gives."""
    keeps_all = getattr(skip, "keeps_all", None)
    try:
        pairs = tuple((sys.intern(name), allocator if want is THE_ALLOCATOR else want)
                      for name, want in getattr(keeps_all, "identities", None))
    except Exception:  # none declared, or not (str, object) pairs: call keeps_all instead
        pairs = None
    if pairs is not None:
        return pairs
    if type(keeps_all) is tuple:  # C would take a tuple for pairs: call it, as the closure
        return lambda allocator, items: keeps_all(allocator, items)
    return keeps_all


def int_tensor_ids(value):
    """A tensor's elements as a list (DeepSpeed and SGLang hand out tensors), else None. One
    ``tolist()`` (a single host sync for a CUDA tensor) and no other call into torch, whose
    attribute reads cost more than the checking: the fast path then accepts only a flat list of
    plain ints, so a bool mask (Python bools), a float or complex tensor, a 2-D one (nested
    lists) or a 0-dim one (a bare number) still goes to the careful path, which names it. An
    empty tensor has no elements to tell its dtype by: careful path too."""
    if type(value).__name__ != "Tensor" or type(value) is not torch_tensor_type():
        return None
    ids = value.tolist()
    return ids if type(ids) is list and ids else None


UNSIZED_READ = 1 << 16
"""How many ids of a lazy allocation result the guard reads from a pool of unknown size."""


def one_shot(result, bound: int = UNSIZED_READ):
    """``(what the ledger reads, what the caller gets)`` for an allocation's result. A one-shot
    iterator (a generator, ``map``, ``iter(list)``) can be read only once: the guard drains it
    into a list and the caller gets a fresh iterator over the same ids, which fails the way the
    original did, at the same point, if the allocator's iterator raised midway. It reads at
    most ``bound`` ids: past them the caller gets the rest of the original, unread (an endless
    iterator is never drained). Anything else is read in place and handed back untouched."""
    try:
        if iter(result) is not result:
            return result, result
    except Exception:
        return result, result
    items: list = []
    try:
        for item in result:
            items.append(item)
            if len(items) >= bound:
                return items, itertools.chain(list(items), result)
    except Exception as exc:
        return items, _then_raise(list(items), exc)
    return items, iter(list(items))


def _then_raise(items, exc):
    yield from items
    raise exc
