"""Class-level dispatchers: the class of a guarded allocator answers for its guarded instances.

A guard shadows methods on its instance, so anything that reaches the class's function instead
passes the guard: a call through the class (``BlockPool.free_blocks(pool, blocks)``), and every
call after an engine assigned, then deleted, an instance attribute named like a guarded method
(the instance attribute, the guard's wrapper, is gone with it). A dispatcher on the class, for
each method a guard shadows, sends such a call to the instance's guard, which puts its wrapper
back and says so; a call on an unguarded instance goes straight to the engine's function.

A guarded instance's own calls find the wrapper on the instance first and never meet the
dispatcher: the fast path costs nothing more. An unguarded instance of a class with a guarded
one alive pays one more Python call per method call. The dispatchers stay while something
holds them: a live guard (``kvguard.guard()`` puts them on at attach and lets go at
``unguard()`` or when the guard is collected), or ``kvguard.instrument()`` until
``uninstrument()``; the last one to let go puts the engine's function back, unless the class
attribute was rebound since (the engine's own rebinding stays).
"""

from __future__ import annotations

import functools
import inspect
import threading

from .marks import ATTR

INSTRUMENT = "instrument"
"""The holder ``kvguard.instrument()`` uses for the dispatchers it puts on."""

_functions: dict = {}  # (class that defines it, name) -> the engine's function
_dispatchers: dict = {}  # (class, name) -> the dispatcher put on it
_holders: dict = {}  # (class, name) -> set of holder tokens
_dead: list = []  # tokens let go of, not settled yet (by whoever holds the lock next)
_lock = threading.RLock()  # reentrant only so that let_go can tell it holds it already


def hold(cls: type, names, token) -> None:
    """Put a dispatcher on ``cls`` (on the class of its MRO that defines the function) for each
    of ``names``, held by ``token`` (a guard's, or ``INSTRUMENT``) until ``let_go(token)``."""
    with _lock:
        for name in names:
            key = _put(cls, name)
            if key is not None:
                _holders.setdefault(key, set()).add(token)
        _settle()


def let_go(token) -> None:
    """``token`` no longer holds its dispatchers: the last holder's go put the function back.
    Safe from a finalizer: inside ``hold()`` on this thread (a collection there), the token
    waits in ``_dead`` for that ``hold()`` to settle it. Safe from a signal handler raising
    anywhere: the lock is only taken by ``with``, which gives it back however the block ends
    (a ``try`` after a non-blocking ``acquire()`` leaves a window where it is lost for good,
    and every later ``kvguard.guard()`` waits on it forever)."""
    _dead.append(token)
    if _lock._is_owned():
        return
    with _lock:
        _settle()


def held() -> dict:
    """``(class, name)`` -> how many hold its dispatcher: for tests and ``bench_dispatch``."""
    with _lock:
        _settle()
        return {key: len(tokens) for key, tokens in _holders.items()}


def _settle() -> None:
    while _dead:
        token = _dead.pop()
        for key in [k for k, tokens in _holders.items() if token in tokens]:
            tokens = _holders[key]
            tokens.discard(token)
            if not tokens:
                _remove(key)


def _remove(key) -> None:
    owner, name = key
    _holders.pop(key, None)
    func = _functions.pop(key)
    dispatcher = _dispatchers.pop(key)
    if owner.__dict__.get(name) is dispatcher:  # rebound since by the engine: theirs stays
        try:
            setattr(owner, name, func)
        except (TypeError, AttributeError):
            pass


def _put(cls: type, name: str):
    """The dispatcher for ``name`` on the class that defines it; its key, or None where none
    can go (a special method, a builtin, something not a plain function, a class that refuses
    new attributes). Only a call that ``type(self)`` resolves to that class's function is
    dispatched: a subclass's override calling ``super().name()`` is part of the override and
    runs the function itself, so a wrapper that forwards to the override never comes back."""
    if name.startswith("__"):  # special methods are looked up on the type by Python itself
        return None
    owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
    if owner is None or owner.__module__ == "builtins":
        return None
    key = (owner, name)
    if key in _functions:
        if owner.__dict__.get(name) is _dispatchers[key]:
            return key
        del _functions[key], _dispatchers[key]  # the engine rebound it: one for the new one
    func = owner.__dict__[name]
    if not inspect.isfunction(func) or hasattr(func, "__kvguard_function__"):
        return None

    @functools.wraps(func)
    def dispatcher(self, *args, **kwargs):
        if getattr(type(self), name, None) is dispatcher:
            own = getattr(self, "__dict__", _EMPTY)
            wrapper = own.get(name)
            if getattr(wrapper, "__kvguard__", None) is None:  # removed, or replaced
                guard = own.get(ATTR)
                wrapper = guard.routed(name) if guard is not None else None
            if wrapper is not None:
                return wrapper(*args, **kwargs)
        return func(self, *args, **kwargs)

    dispatcher.__kvguard_function__ = func
    try:
        setattr(owner, name, dispatcher)
    except (TypeError, AttributeError):  # a class that refuses new attributes: calls through
        return None  # it pass the guard, and only a later check() notices
    _functions[key] = func
    _dispatchers[key] = dispatcher
    return key


_EMPTY: dict = {}
