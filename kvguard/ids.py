"""Block ids are normalized once, at the guard's edge, into a list of plain ints.

Everything a caller may pass to ``free()`` is read here: ints, numpy integers, lists, tuples,
ranges, sets, numpy arrays, 1-D integer torch tensors on any device, objects carrying the id in
an attribute. What must not be coerced is reported instead: a bool is id 1 to ``operator.index``
but a mask to tensor indexing; a tensor's elements hash by identity so ``set()`` and ``in``
see no duplicates; a generator is consumed by the first validation loop.

torch and numpy are never imported here: a value can only be a tensor if torch is loaded.
"""

from __future__ import annotations

import operator
import sys
from collections import Counter

from . import kinds
from .arrays import read_ndarray, read_tensor, tensor_element
from .normalized import Fault, Normalized, describe, short_repr

_SEQUENCES = (list, tuple, range, set, frozenset)


def torch_tensor_type():
    torch = sys.modules.get("torch")
    return getattr(torch, "Tensor", None)


def _numpy():
    return sys.modules.get("numpy")


def fast_ids(value):
    """The hot path: a list or tuple of plain ints, returned as a list; None if not that simple."""
    tp = type(value)
    if tp is list or tp is tuple:
        for x in value:
            if type(x) is not int:
                return None
        return value[:] if tp is list else list(value)
    if tp is int:
        return [value]
    return None


def normalize(value, *, tensor_ok=False, id_attr=None, skip=None, iterator_ok=False,
              consume=False, distinct=True, what="free()") -> Normalized:
    """Read ``value`` as block ids; never raises, reports faults instead.

    A one-shot iterator is a ``consumed-iterable`` fault unless ``iterator_ok`` (the allocator
    copies its argument first). It is drained only with ``iterator_ok`` or ``consume`` (repair
    mode forwards the drained list); otherwise the caller's iterator is left untouched.
    A value whose ids cannot be read at all (a ``meta`` tensor has no values; an ``__index__``
    that raises) is ``invalid-id``, whatever its reading raised. With ``distinct`` (ids given
    back: each block once), an id given twice is ``duplicate-id``.
    """
    try:
        # A list is read from a copy: reading runs code (the collector at any allocation, and
        # finalizers that may change the caller's list; ``skip``; an item's ``__index__``)
        # and must see one state of the list, never a part of it. ``list()`` copies after its
        # own allocation, in one step (``value.copy()`` and ``value[:]`` read the length
        # first). If the list changed meanwhile, the allocator gets the copy the guard read.
        copy = list(value) if type(value) is list else value
        out = _normalize(copy, tensor_ok, id_attr, skip, iterator_ok, consume, what)
        if copy is not value and (len(copy) != len(value) or any(
                a is not b for a, b in zip(copy, value))):
            out.forward = copy
        elif out.forward is True:  # items read through the caller's own __index__
            out.forward = like(value, out.ids) if not (
                out.faults or out.objects is not None or out.passthrough) else None
    except Exception as exc:
        out = Normalized([], [Fault(kinds.INVALID_ID, (
            f"{what} got {describe(value)} whose block ids cannot be read: {exc!r}"))])
    out.given = value
    if distinct:
        _find_duplicates(out, what)
    return out


def _find_duplicates(out: Normalized, what: str) -> None:
    ids = out.ids
    if len(set(ids)) == len(ids):
        return
    counts = Counter(ids)
    dups = tuple(b for b in dict.fromkeys(ids) if counts[b] > 1)
    shown = ", ".join(f"{b} x{counts[b]}" for b in dups[:8])
    out.faults.append(Fault(kinds.DUPLICATE_ID, (
        f"{what} got the same block id more than once in one call ({shown}): each copy "
        "would go back on the free list and the block would be handed to two owners; "
        "de-duplicate the ids (were two sources concatenated?)"), dups))


def like(given, ids: list):
    """``ids`` (plain ints) in the container the caller passed: what a repaired call forwards,
    so that an allocator taking one type (refcounts indexed by an ndarray of its dtype, a tuple,
    a single int) gets that type. A tensor is rebuilt by the guard, which knows whether the
    allocator takes tensors; a container that cannot hold the ids (a bool mask, a float array,
    a one-shot iterator already drained) becomes a list."""
    tp = type(given)
    if tp is tuple:
        return tuple(ids)
    if (tp is int or (_numpy() is not None and isinstance(given, _numpy().integer))) \
            and len(ids) == 1:
        return tp(ids[0])
    if tp is set or tp is frozenset:
        return tp(ids)
    np = _numpy()
    if np is not None and tp is np.ndarray:
        return np.asarray(ids, dtype=given.dtype if given.dtype.kind in "iu" else np.int64)
    return list(ids)


def _normalize(value, tensor_ok, id_attr, skip, iterator_ok, consume, what) -> Normalized:
    tp = type(value)
    if tp is list or tp is tuple:
        quick = _plain_items(value, id_attr, skip)
        if quick is not None:
            return quick
    out = Normalized([])
    Tensor = torch_tensor_type()
    np = _numpy()
    if Tensor is not None and isinstance(value, Tensor):
        read_tensor(value, out, tensor_ok, what)
        return out
    if np is not None and isinstance(value, np.ndarray):
        read_ndarray(value, out, what)
        return out
    if isinstance(value, (str, bytes, bytearray, memoryview, dict)):
        out.faults.append(Fault(kinds.INVALID_ID, f"{what} got {describe(value)} "
                                f"{short_repr(value)} where block ids belong"))
        return out
    if _is_single(value, id_attr, Tensor, np):
        _read_items((value,), out, tensor_ok, id_attr, skip, what, Tensor, np)
        return out
    if tp not in _SEQUENCES:  # (a list or tuple subclass may iterate its own way)
        try:
            iterator = iter(value)
        except TypeError:
            out.faults.append(Fault(kinds.INVALID_ID, f"{what} got {describe(value)}, "
                                    "which is neither a block id nor an iterable of them"))
            return out
        except Exception as exc:  # the caller's own iterable is broken; report, never raise
            out.faults.append(Fault(kinds.INVALID_ID, f"iterating the ids raised {exc!r}"))
            return out
        if iterator is value:
            if not iterator_ok:
                out.faults.append(Fault(kinds.CONSUMED_ITERABLE, (
                    f"{what} got a one-shot {describe(value)}: the allocator's validation loop "
                    "drains it and the freeing loop then sees nothing, so no block is freed; "
                    "pass a list")))
                if not consume:
                    return out
            out.consumed = True
        try:
            value = list(iterator)
        except Exception as exc:  # the caller's own iterable is broken; report, never raise
            out.faults.append(Fault(kinds.INVALID_ID, f"iterating the ids raised {exc!r}"))
            return out
        if out.consumed:
            out.materialized = value
        elif tp.__module__ not in STABLE_MODULES:
            out.forward = value  # an iterable of the caller's own may give other ids next time
    _read_items(value, out, tensor_ok, id_attr, skip, what, Tensor, np)
    return out


STABLE_MODULES = frozenset({"builtins", "collections", "array", "numpy", "torch"})
"""Where the iterables come from that give the same items each time they are iterated."""


def _plain_items(items, id_attr, skip):
    """The common case read in one pass: plain non-negative ints, or objects whose ``id_attr``
    is one (vLLM's blocks). None as soon as anything needs the careful reader."""
    if id_attr is None:
        for x in items:
            if type(x) is not int or x < 0:
                return None
        return Normalized(list(items))
    if "." in id_attr:
        return None
    if skip is None:
        objects, passthrough = list(items), []
    else:
        objects = [item for item in items if not skip(item)]
        passthrough = [item for item in items if skip(item)] if len(objects) < len(items) else []
    ids = [getattr(item, id_attr, None) for item in objects]
    for b in ids:
        if type(b) is not int or b < 0:
            return None
    return Normalized(ids, objects=objects, passthrough=passthrough)


def _is_single(value, id_attr, Tensor, np) -> bool:
    if isinstance(value, (int, float)) or value is None:
        return True
    if np is not None and isinstance(value, np.generic):
        return True
    if id_attr is not None and _has_path(value, id_attr):
        return True
    return not hasattr(value, "__iter__") and hasattr(value, "__index__")


def _get_path(item, path: str):
    """``id_attr`` as a dotted path: LMCache keeps a page's index at ``obj.meta.address``."""
    for name in path.split("."):
        item = getattr(item, name)
    return item


def _has_path(item, path: str) -> bool:
    try:
        _get_path(item, path)
    except AttributeError:
        return False
    return True


def _read_items(items, out, tensor_ok, id_attr, skip, what, Tensor, np) -> None:
    ids = out.ids
    objects = out.objects = [] if id_attr is not None else None
    bools, tensors, invalid = [], [], []
    for item in items:
        if skip is not None and skip(item):
            out.passthrough.append(item)
            continue
        raw = item
        if id_attr is not None:
            if isinstance(item, (list, tuple)):
                _read_items(item, sub := Normalized([]), tensor_ok, id_attr, skip, what,
                            Tensor, np)
                ids += sub.ids
                objects += sub.objects
                out.passthrough += sub.passthrough
                out.faults += sub.faults
                continue
            try:
                raw = getattr(item, id_attr) if "." not in id_attr else _get_path(item, id_attr)
            except AttributeError:
                invalid.append((short_repr(item), f"has no .{id_attr}"))
                continue
        tp = type(raw)
        if tp is int:
            value = raw
        elif tp is bool or (np is not None and isinstance(raw, np.bool_)):
            bools.append(raw)
            continue
        elif Tensor is not None and isinstance(raw, Tensor):
            value = tensor_element(raw, tensor_ok, bools, tensors, invalid)
            if value is None:
                continue
        elif isinstance(raw, float):
            invalid.append((repr(raw), "is a float"))
            continue
        else:
            try:
                value = operator.index(raw)
                if np is None or not isinstance(raw, np.integer):
                    out.forward = out.forward or True  # the caller's own __index__
            except TypeError:
                invalid.append((short_repr(raw), f"is a {describe(raw)}, not an integer"))
                continue
            except Exception as exc:  # an __index__ of the caller's own that raises
                invalid.append((short_repr(raw), f"cannot be read as an integer ({exc!r})"))
                continue
        if value < 0:
            invalid.append((str(value), "is negative"))
            continue
        ids.append(value)
        if objects is not None:
            objects.append(item)
    if tensors:
        out.faults.append(Fault(kinds.TENSOR_ID, (
            f"{what} got {len(tensors)} 0-dim tensor element(s) (from indexing or iterating a "
            "tensor): they hash by identity, so duplicate checks see none; pass int(x) or "
            "ids.tolist()"), tuple(tensors)))
    if bools:
        out.faults.append(Fault(kinds.BOOL_ID, (
            f"{what} got bool {bools[0]!r} as a block id: operator.index() reads it as "
            f"{int(bools[0])} but tensor indexing reads it as a mask over every block; "
            "pass integer ids")))
    if invalid:
        text, why = invalid[0]
        more = f" (and {len(invalid) - 1} more)" if len(invalid) > 1 else ""
        out.faults.append(Fault(kinds.INVALID_ID, f"{what} got block id {text}, which {why}{more}",
                                tuple(int(t) for t, _ in invalid if _is_int_text(t))))


def _is_int_text(text: str) -> bool:
    return text.lstrip("-").isdigit()


def result_ids(value, id_attr=None, skip=None) -> Normalized:
    """Ids in an allocation's result: tensors are expected here (DeepSpeed returns int32)."""
    if value is None:
        return Normalized([])
    fast = fast_ids(value) if id_attr is None and skip is None else None
    if fast is not None:
        return Normalized(fast)
    return normalize(value, tensor_ok=True, id_attr=id_attr, skip=skip, iterator_ok=True,
                     distinct=False, what="the allocation")
