"""Where an argument sits in a call: shared by the guard's wrappers and ``kvguard.cache.writes``.

A guarded method is called by position or by keyword, with defaults left out; the guard must
read the ids (or a sub-pool key, a slot mapping) from the call the way Python would bind them,
and put a repaired value back in the same place.
"""

from __future__ import annotations

import functools
import inspect

from ..ids import torch_tensor_type

MISSING = object()
"""An argument the call did not pass and that has no default."""


def parameters(method) -> tuple:
    """A method's parameters after ``self``, cached per function: ``inspect.signature`` is most
    of what building a guard costs, and a test suite builds thousands of guards of one class."""
    func = getattr(method, "__func__", None)
    try:
        if func is not None and getattr(method, "__self__", None) is not None:
            return _signature(func)[1:]
        return _signature(method)
    except TypeError:  # unhashable callable: no cache
        try:
            return tuple(inspect.signature(method).parameters.values())
        except (TypeError, ValueError):
            return ()


@functools.lru_cache(maxsize=4096)
def _signature(func) -> tuple:
    try:
        return tuple(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return ()


def first_parameter(method):
    """The name of the first positional parameter of a bound method, or None."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return None
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return None


class Param:
    """Where one argument of a method is: by position (after self) and/or by name."""

    __slots__ = ("pos", "name", "default", "found")

    def __init__(self, method, where) -> None:
        self.pos = self.name = None
        self.default = MISSING
        every = parameters(method)
        params = [p for p in every
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        # Without a readable signature, or with *args/**kwargs, trust the spec.
        self.found = not every or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in every)
        if isinstance(where, int):
            self.pos = where
            self.found = self.found or where < len(params)
            if where < len(params):  # keyword-only too: free(self, *, ids) takes ids=...
                self.name = params[where].name
                self.default = params[where].default
                if self.default is inspect.Parameter.empty:
                    self.default = MISSING
            return
        self.name = where
        for n, p in enumerate(params):
            if p.name == where:
                self.found = True
                if p.kind != p.KEYWORD_ONLY:
                    self.pos = n
                if p.default is not inspect.Parameter.empty:
                    self.default = p.default
                break

    def get(self, args, kwargs):
        pos = self.pos
        if pos is not None and len(args) > pos:
            return args[pos]
        if self.name is not None:
            return kwargs.get(self.name, self.default)
        return self.default

    def put(self, args, kwargs, value):
        pos = self.pos
        if pos is not None and len(args) > pos:
            args = args[:pos] + (value,) + args[pos + 1:]
        else:
            kwargs = dict(kwargs)
            kwargs[self.name] = value
        return args, kwargs


def pool_key(value):
    """Sub-pool keys come as ints, 0-dim tensors or numpy ints: make them plain and hashable."""
    if type(value) is int:
        return value
    Tensor = torch_tensor_type()
    if Tensor is not None and isinstance(value, Tensor) and value.dim() == 0:
        return value.item()
    if hasattr(value, "__index__") and not isinstance(value, bool):
        return int(value.__index__())
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value
