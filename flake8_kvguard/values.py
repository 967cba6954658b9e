"""What the checker knows about the value of an expression.

A `Val` is deliberately small: the rules only need to tell tensors from their 0-dim
elements, bools from ints, hash-based containers from the rest, and whether a
collection of ids may hold one id twice.
"""

from __future__ import annotations

UNKNOWN = "unknown"
TENSOR = "tensor"  # a torch tensor with a dimension (or of unknown dimension)
ELEMENT = "element"  # a 0-dim tensor: t[i], or an item of `for x in t`
TENSORS = "tensors"  # a tuple or list of tensors: torch.split(...), torch.where(c)
SEQUENCE = "sequence"  # a list, tuple, range or iterator of `item`
BOOL = "bool"
INT = "int"
SET = "set"  # hash-based: membership and de-duplication go by hash()
DICT = "dict"
OBJECT = "object"  # an instance of a class the code names: `cls` is its name


class Val:
    """An abstract value.

    `item` is the value of the elements (sequences, sets, tensors: a bool tensor is a
    tensor whose item is BOOL). `dup` says why a collection may repeat an id, `note`
    why a value is a bool; `optional` marks a value that may also be None (an
    Optional[Tensor] annotation), which is never rewritten. `cls` names the class of an
    OBJECT, so that a call on it resolves to that class's method.
    """

    __slots__ = ("kind", "item", "dup", "optional", "note", "cls", "ndim")

    def __init__(
        self, kind, item=None, dup=None, optional=False, note=None, cls=None, ndim=None
    ):
        self.kind = kind
        self.item = item
        self.dup = dup
        self.optional = optional
        self.note = note
        self.cls = cls
        self.ndim = ndim  # a tensor's number of dimensions where the code proves it

    def replace(self, **changes):
        fields = {name: getattr(self, name) for name in self.__slots__}
        fields.update(changes)
        return Val(**fields)

    def __repr__(self):  # for test failures
        extra = "".join(
            f", {name}={getattr(self, name)!r}"
            for name in ("item", "dup", "optional", "note", "cls", "ndim")
            if getattr(self, name)
        )
        return f"Val({self.kind!r}{extra})"

    def __eq__(self, other):
        return isinstance(other, Val) and all(
            getattr(self, name) == getattr(other, name) for name in self.__slots__
        )

    def __hash__(self):
        return hash((self.kind, self.item, self.dup, self.optional, self.note, self.cls, self.ndim))


NOTHING = Val(UNKNOWN)
AN_INT = Val(INT)
A_BOOL = Val(BOOL)


def is_bool(val: Val) -> bool:
    """A bool, a bool tensor, a bool element, or a collection of bools."""
    if val.kind == BOOL:
        return True
    if val.kind in (TENSOR, ELEMENT, SEQUENCE) and val.item is not None:
        return is_bool(val.item)
    return False


def elements(val: Val) -> Val:
    """The value of one element when iterating over `val`."""
    kind = val.kind
    if kind == TENSOR or kind == ELEMENT:
        ndim = val.ndim
        if ndim is not None and ndim >= 2:
            return Val(TENSOR, item=val.item, ndim=ndim - 1)  # the rows of a table
        # t[i] of a tensor of unknown rank may be a row: iterating it gives elements
        # (ndim 0 only where proven).
        return Val(ELEMENT, item=val.item, ndim=0 if ndim == 1 else None)
    if kind == TENSORS:
        return Val(TENSOR, item=val.item)
    if kind in (SEQUENCE, SET) and val.item is not None:
        return val.item
    return NOTHING


def join(values) -> Val:
    """What is known of a value that is one of `values`."""
    values = list(values)
    if not values:
        return NOTHING
    first = values[0]
    if all(v == first for v in values[1:]):
        return first
    kinds = {v.kind for v in values}
    if len(kinds) == 1:
        kind = first.kind
        items = [v.item for v in values]
        item = items[0] if all(i == items[0] for i in items) else None
        dup = next((v.dup for v in values if v.dup), None)
        return Val(kind, item=item, dup=dup, optional=any(v.optional for v in values))
    return NOTHING


def sequence_of(items, dup=None) -> Val:
    """A list or tuple holding `items` (Vals)."""
    items = list(items)
    if not items:
        return Val(SEQUENCE, dup=dup)
    # One 0-dim element, tensor or bool among ints is what matters to the rules.
    for kind in (ELEMENT, TENSOR, BOOL):
        for item in items:
            if item.kind == kind:
                return Val(SEQUENCE, item=item, dup=dup)
    return Val(SEQUENCE, item=join(items), dup=dup)


def is_container(val: Val) -> bool:
    """A set or dict the checker saw being made by a call or a comprehension.

    Literal displays (`{}`), annotations (`Dict[int, X]`) and `.keys()` views do
    not count: every file has them, and counting them would make the textual
    pre-filter parse most files that mention torch (see prefilter.py)."""
    return val.kind in (SET, DICT) and val.note not in ("display", "annotation", "keys")
