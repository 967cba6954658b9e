"""What reading a call's ids gives: the plain ids and the faults found on the way, and the
words a fault's message uses for the value it was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Fault:
    """One thing wrong with the ids of a call, before the ledger is consulted."""

    kind: str
    message: str
    block_ids: tuple = ()


@dataclass
class Normalized:
    """The slow path's answer: ids plus what the fast path had no room for."""

    ids: list
    faults: list = field(default_factory=list)
    objects: list | None = None
    """With ``id_attr``: the object carrying each id in ``ids``, to forward a repaired call."""
    passthrough: list = field(default_factory=list)
    """Items ``skip`` let through unchecked (vLLM's null block): forwarded, never tracked."""
    tensor: object = None
    """The tensor the ids came from, to rebuild a repaired call in the same dtype and device."""
    consumed: bool = False
    """The ids came from a one-shot iterator the guard had to drain."""
    materialized: list | None = None
    """What the drained iterator yielded, to forward in its place."""
    given: object = None
    """The value as the caller passed it: a repaired call is rebuilt in its container type."""
    forward: object = None
    """What the allocator receives in place of the argument, when reading the argument again
    could give other ids than the guard read (a list changed while it was read, an iterable of
    the caller's own, an item whose ``__index__`` is the caller's code): the guard's own copy,
    so the allocator's view is the guard's. None: the argument itself."""


def describe(value) -> str:
    tp = type(value)
    return tp.__name__ if tp.__module__ == "builtins" else f"{tp.__module__}.{tp.__qualname__}"


def short_repr(value, limit: int = 40) -> str:
    try:
        text = repr(value)
    except Exception:  # the caller's own __repr__ is broken: name the type instead
        text = f"<{describe(value)}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
