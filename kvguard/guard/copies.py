"""A guarded allocator copied or pickled: ``copy.copy``, ``copy.deepcopy`` and ``pickle`` get
the allocator's own reduction with the guard's wrappers taken out of its state.
"""

from __future__ import annotations

from ..marks import ATTR
from .arguments import MISSING


def reduce_hook(guard):
    """The allocator's ``__reduce_ex__`` while guarded. ``copy.copy``, ``copy.deepcopy`` and
    ``pickle`` look it up on the instance: they get the allocator's own reduction with the
    guard's wrappers taken out of its state, so a copy is an unguarded, correct copy (its
    ``free`` frees on itself, not on the original) and a pickle holds the unguarded state.
    """

    def __reduce_ex__(protocol):
        allocator = guard.allocator
        guard.release_quarantine()  # the copy must see every block its caller freed
        reduction = type(allocator).__reduce_ex__(allocator, protocol)
        if not isinstance(reduction, tuple) or len(reduction) < 3:
            return reduction
        state = reduction[2]
        if isinstance(state, dict):
            state = unguarded(guard, state)
        elif (isinstance(state, tuple) and len(state) == 2
              and isinstance(state[0], dict)):  # (__dict__, __slots__ values)
            state = (unguarded(guard, state[0]), state[1])
        return reduction[:2] + (state,) + reduction[3:]
    __reduce_ex__.__kvguard_hook__ = guard  # not __kvguard__: no method to dispatch to
    return __reduce_ex__


def unguarded(guard, state: dict) -> dict:
    """An instance ``__dict__`` as it would be without the guard (a new dict)."""
    allocator = guard.allocator
    own = vars(allocator) if allocator is not None else {}
    out = dict(state)
    if out.get(ATTR) is guard:
        del out[ATTR]
    for name, original in guard._originals.items():
        if name in out and out[name] is own.get(name):
            if original is MISSING:
                del out[name]
            else:
                out[name] = original
    return out
