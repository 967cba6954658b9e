"""Block ids read from a torch tensor or a numpy array: a 1-D integer array is a list of ids; a
bool one is a mask (reported, never read as ids 0 and 1), a float, complex, 2-D or meta one holds
no ids, and a tensor reaching a ``free()`` that does not take tensors is reported as such.
torch and numpy are never imported here: the value in hand already is one of theirs.
"""

from __future__ import annotations

import sys

from . import kinds
from .normalized import Fault, Normalized, short_repr


def tensor_element(t, tensor_ok, bools, tensors, invalid):
    """A 0-dim tensor inside a list: its value, or None after noting what is wrong with it."""
    if t.dim() != 0:
        invalid.append((short_repr(t), f"is a {t.dim()}-D tensor inside the ids"))
        return None
    if t.is_meta:
        invalid.append((short_repr(t), "is a meta tensor element: it has no value"))
        return None
    if t.dtype.is_floating_point or t.dtype.is_complex:
        invalid.append((repr(t.item()), f"is a {t.dtype} tensor element"))
        return None
    value = t.item()
    if isinstance(value, bool):
        bools.append(value)
        return None
    if not tensor_ok:
        tensors.append(value)
        return None
    return value


def read_tensor(t, out, tensor_ok, what) -> None:
    dtype = t.dtype
    if dtype.is_floating_point or dtype.is_complex:
        out.faults.append(Fault(kinds.INVALID_ID, f"{what} got a {dtype} tensor; block ids are "
                                "integers"))
        return
    if t.dim() > 1:
        out.faults.append(Fault(kinds.INVALID_ID, f"{what} got a {t.dim()}-D tensor of shape "
                                f"{tuple(t.shape)}; block ids are 1-D"))
        return
    if t.is_meta:
        out.faults.append(Fault(kinds.INVALID_ID, f"{what} got a meta tensor: it has a shape "
                                "but no values, so it holds no block ids"))
        return
    values = t.reshape(-1).tolist()
    if dtype is torch_bool():
        ids = tuple(i for i, v in enumerate(values) if v)
        out.faults.append(Fault(kinds.BOOL_ID, (
            f"{what} got a bool tensor of {len(values)} elements: indexing with it selects by "
            "mask, not by id; pass mask.nonzero().flatten() or the ids themselves"), ids))
        return
    values = without_negatives(values, out, what)
    out.ids = values
    out.tensor = t
    if not tensor_ok:
        kind = "0-dim tensor" if t.dim() == 0 else "torch.Tensor"
        out.faults.append(Fault(kinds.TENSOR_ID, (
            f"{what} got a {kind} ({dtype}, {t.device}): its elements hash by identity, so "
            "set(), `in` and dict checks see no duplicates, and storing one keeps a view of the "
            "caller's tensor; pass ids.tolist()"), tuple(values)))


def without_negatives(values: list, out: Normalized, what: str) -> list:
    """An array's negative entries are faults, reported once; the rest are still checked."""
    negative = [v for v in values if v < 0]
    if not negative:
        return values
    out.faults.append(Fault(kinds.INVALID_ID, f"{what} got negative block id {negative[0]}",
                            tuple(negative)))
    return [v for v in values if v >= 0]


def torch_bool():
    return sys.modules["torch"].bool


def read_ndarray(a, out, what) -> None:
    kind = a.dtype.kind
    if a.ndim > 1:
        out.faults.append(Fault(kinds.INVALID_ID, f"{what} got a {a.ndim}-D array of shape "
                                f"{a.shape}; block ids are 1-D"))
        return
    values = a.reshape(-1).tolist()
    if kind == "b":
        out.faults.append(Fault(kinds.BOOL_ID, (
            f"{what} got a bool array: it selects by mask, not by id; pass "
            "np.flatnonzero(mask) or the ids themselves"), tuple(i for i, v in enumerate(values)
                                                              if v)))
        return
    if kind not in "iu":
        out.faults.append(Fault(kinds.INVALID_ID, f"{what} got a {a.dtype} array; block ids are "
                                "integers"))
        return
    values = without_negatives(values, out, what)
    out.ids = values
