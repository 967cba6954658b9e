"""Guarded methods the allocator's class holds as something other than a plain function.

The guard's view of an allocator must be the allocator's own, whatever the attribute is. A
plain function on the class is shadowed by the guard's wrapper on the instance (and the class's
dispatcher, ``kvguard.dispatch``, answers when that wrapper is gone). Anything else a class may
hold under a method's name is read afresh at each call, and the guard forwards to what it reads
now: a property returning a bound method, a custom descriptor, a ``staticmethod``, a callable
object. A data descriptor (a property) wins over any instance attribute, so an instance wrapper
would never be seen: the class gets a ``Routed`` descriptor in its place, which hands a guarded
instance its guard's wrapper and everyone else what the original descriptor gives; an
assignment or deletion goes where it went before (the property's setter, or the instance).
"""

from __future__ import annotations

import types

from ..marks import ATTR
from ..spec import SpecMisfitError, misfit
from .arguments import MISSING


def prepare(guard, allocator) -> None:
    """Before the wrappers go on: the spec fits the allocator (a configuration error in one
    line if not), its instances have a ``__dict__``, and each guarded method that the class
    holds as a descriptor gets a ``Routed`` in its place."""
    problem = misfit(allocator, guard.spec, guard.allocator_class)
    if problem is not None:
        raise SpecMisfitError(f"cannot guard {guard.allocator_class}: {problem}")
    try:
        vars(allocator)
    except TypeError:
        raise TypeError(f"cannot guard {guard.allocator_class}: its instances have no "
                        "__dict__ (__slots__), so methods cannot be shadowed") from None
    for name in guard.spec.methods() + guard.spec.extra_methods():
        owner, attr = class_attribute(type(allocator), name)
        if owner is None or isinstance(attr, PLAIN + (Routed,)):
            continue
        try:
            setattr(owner, name, Routed(name, attr))
        except (TypeError, AttributeError) as exc:
            if is_data(attr):  # an instance wrapper would never be seen: refuse, never off
                raise TypeError(f"cannot guard {guard.allocator_class}: {name} is a "
                                f"{type(attr).__name__} on a class that refuses a new "
                                f"attribute ({exc})") from None


def class_attribute(cls, name):
    """``(class of cls's MRO that holds name, what it holds)``, or ``(None, None)``."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass, klass.__dict__[name]
    return None, None


PLAIN = (types.FunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
         types.BuiltinFunctionType)
"""What a class holds as a method the usual way: the instance attribute shadows it, and reading it
afresh would give the same."""


def is_data(attr) -> bool:
    kind = type(attr)
    return hasattr(kind, "__set__") or hasattr(kind, "__delete__")


def reread(obj, name, attr):
    """A callable that reads ``name`` afresh through ``attr`` (the class's descriptor) at each
    call and calls what it reads: the guard forwards to whatever the allocator would call."""
    kind = type(attr)
    get = kind.__get__ if hasattr(kind, "__get__") else None
    cls = type(obj)

    def forward(*args, **kwargs):
        return (get(attr, obj, cls) if get is not None else attr)(*args, **kwargs)
    forward.__wrapped__ = get(attr, obj, cls) if get is not None else attr  # its signature
    forward.__name__ = forward.__qualname__ = name
    return forward


class Routed:
    """In place of a class's descriptor named like a guarded method (see the module)."""

    def __init__(self, name, original) -> None:
        self.name = name
        self.original = original
        self.data = is_data(original)
        kind = type(original)
        self._get = kind.__get__ if hasattr(kind, "__get__") else None
        self.__doc__ = getattr(original, "__doc__", None)

    def __get__(self, obj, cls=None):
        if obj is not None:
            own = getattr(obj, "__dict__", None) or {}
            present = own.get(self.name, MISSING)
            if getattr(present, "__kvguard__", None) is not None:
                return present
            if present is not MISSING and not self.data:
                return present  # the instance's own attribute shadows, as it did
            guard = own.get(ATTR)
            wrapper = guard.routed(self.name) if guard is not None else None
            if wrapper is not None:
                return wrapper
        return self._get(self.original, obj, cls) if self._get is not None else self.original

    def __set__(self, obj, value) -> None:
        if self.data:
            type(self.original).__set__(self.original, obj, value)
        else:
            vars(obj)[self.name] = value

    def __delete__(self, obj) -> None:
        if self.data:
            type(self.original).__delete__(self.original, obj)
        else:
            try:
                del vars(obj)[self.name]
            except KeyError:
                raise AttributeError(self.name) from None

    def __set_name__(self, owner, name) -> None:
        pass


def class_view(allocator, names) -> tuple:
    """``(class __dict__, name, what it holds)`` for each of ``names`` as the allocator's class
    holds it now (the guard's dispatcher, a function, a descriptor): ``selfcheck.verify``
    compares, and follows an engine that rebinds a guarded method on the class."""
    out = []
    for name in names:
        owner, attr = class_attribute(type(allocator), name)
        if owner is not None:
            out.append((owner.__dict__, name, attr))
    return tuple(out)


def follow_class(guard, allocator, view) -> list:
    """The guarded methods the engine rebound on the class since ``view``: the guard forwards
    to what the class holds now (its wrappers rebuilt). Returns their names."""
    moved = [name for held, name, attr in view if held.get(name) is not attr]
    for name in moved:
        _, attr = class_attribute(type(allocator), name)
        attr = getattr(attr, "__kvguard_function__", attr)  # past a dispatcher
        attr = attr.original if isinstance(attr, Routed) else attr
        guard._bound[name] = attr.__get__(allocator, type(allocator)) if isinstance(
            attr, PLAIN) and hasattr(attr, "__get__") else reread(allocator, name, attr)
    if moved:
        guard._install(guard)
    return moved
