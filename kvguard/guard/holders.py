"""[owner_arg] A wrapper run as the holder its call names (``AllocatorSpec.owner_arg``): the
allocator's own argument says which request a call is for, so its frees are checked against
what that request holds.
"""

from __future__ import annotations

from ..owners import OWNERS, swap_holder
from .arguments import MISSING, Param


def as_holder(guard, wrapper, method):
    """[owner_arg] ``wrapper`` run as the holder its call names (``AllocatorSpec.owner_arg``):
    the thread's holder slot set around the guarded call, as an engine adapter's boundary
    sets it, so the fast paths read it the same way."""
    where = guard.spec.owner_arg
    if callable(where):
        read_owner = where
    else:
        param = Param(guard._bound[method], where)
        if not param.found:
            return wrapper

        def read_owner(args, kwargs):
            value = param.get(args, kwargs)
            return None if value is MISSING else value

    intern = OWNERS.intern

    def holding(*args, **kwargs):
        try:
            label = read_owner(args, kwargs)
        except Exception:  # the allocator's own call decides what is wrong with it
            label = None
        if label is None:
            return wrapper(*args, **kwargs)
        saved = swap_holder(intern(label))
        try:
            return wrapper(*args, **kwargs)
        finally:
            swap_holder(saved)

    holding.__wrapped__ = getattr(wrapper, "__wrapped__", wrapper)
    holding.__kvguard__ = guard
    return holding
