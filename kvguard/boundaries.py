"""Request boundaries: the engine methods that act for one request, and the engine's steps.

The allocator never learns which request a block is for; the engine's managers do. A boundary
is a method of such a manager that runs on behalf of one request (vLLM's
``KVCacheManager.allocate_slots(request, ...)`` and ``free(request)``, Hugging Face's
``CacheAllocator.free_blocks(request_id)``): while it runs, that request is the holder
(``kvguard.owners.holding``), so every block the allocator hands out inside is recorded as its,
and every release inside is checked against who holds the block (``stale-free``). A step
boundary is a method that schedules a step (its result: what the step will use) or processes
its output: the guard's in-flight leases follow them (``free-in-flight``).

Boundaries are declared by dotted class name (nothing is imported) and installed on the class
by ``instrument()`` (the pytest plugin and staging), when its module is imported, and removed by
``uninstrument()``. ``declare()`` adds one for an engine of your own.
"""

from __future__ import annotations

import functools
import sys
import threading
import types

from .owners import Boundary, holding

_declared: dict[str, dict] = {}  # dotted class name -> {method: (role, reader)}
_installed: dict[tuple, object] = {}  # (class, method) -> the function it had
_classes: dict[str, type] = {}  # declared with the class object itself
_functions: dict[str, object] = {}  # dotted function name -> make(original) -> replacement
_rebound: dict[tuple, tuple] = {}  # (module name, attribute) -> (original, replacement)
_lock = threading.RLock()


def declare(cls_or_name, **methods) -> None:
    """Declare boundaries of a class (or its dotted name): ``method=holder_of`` where
    ``holder_of(args, kwargs)`` reads the request id from the call (``request_arg(0)`` and
    ``request_id_arg(0)`` read the common shapes); ``method=("begin", hook)``, where
    ``hook(self, result)`` runs after the method (a step was scheduled: open its lease);
    ``method=("end", hook)``, where ``hook(self, args, kwargs)`` runs after it, however it
    ended (a step was processed: close it); or ``method=("around", make)``, where
    ``make(original)`` returns the method's replacement (an engine's own shape). A class
    object given directly is installed on that very class."""
    name = cls_or_name if isinstance(cls_or_name, str) else (
        f"{cls_or_name.__module__}.{cls_or_name.__qualname__}")
    with _lock:
        if not isinstance(cls_or_name, str):
            _classes[name] = cls_or_name
        table = _declared.setdefault(name, {})
        for method, reader in methods.items():
            table[method] = reader if isinstance(reader, tuple) else ("holder", reader)
        if _active:
            install_if_imported(name)


def declare_function(dotted: str, make) -> None:
    """Declare a module-level function as a boundary (SGLang's ``release_kv_cache(req, ...)``):
    ``make(original)`` returns its replacement. Installed like a method: in its module, and in
    every module imported so far that took the function itself by name (``from m import f``);
    a module importing it later gets the replacement."""
    with _lock:
        _functions[dotted] = make
        if _active:
            install_function(dotted)


def install_function(dotted: str) -> None:
    module_name, _, attr = dotted.rpartition(".")
    module = sys.modules.get(module_name)
    original = vars(module).get(attr) if module is not None else None
    if not callable(original) or (module_name, attr) in _rebound:
        return
    replacement = _functions[dotted](original)
    replacement.__kvguard_boundary__ = True
    for name, other in list(sys.modules.items()):
        namespace = getattr(other, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(attr) is original:
            namespace[attr] = replacement
            _rebound[(name, attr)] = (original, replacement)


def request_arg(position: int, name: str = "request", attr: str = "request_id"):
    """The holder read from a request object passed at ``position`` (or as ``name``)."""
    def holder_of(args, kwargs):
        request = args[position] if len(args) > position else kwargs.get(name)
        return getattr(request, attr, None)
    holder_of.shape = (position, name, attr)
    return holder_of


def request_id_arg(position: int, name: str = "request_id"):
    """The holder passed as a plain request id at ``position`` (or as ``name``)."""
    def holder_of(args, kwargs):
        return args[position] if len(args) > position else kwargs.get(name)
    holder_of.shape = (position, name, None)
    return holder_of


_active = False


def instrument() -> None:
    global _active
    with _lock:
        _active = True
        for name in list(_declared):
            install_if_imported(name)
        for dotted in list(_functions):
            install_function(dotted)


def uninstrument() -> None:
    global _active
    with _lock:
        _active = False
        for (cls, method), original in list(_installed.items()):
            setattr(cls, method, original)
        _installed.clear()
        for (name, attr), (original, replacement) in list(_rebound.items()):
            namespace = getattr(sys.modules.get(name), "__dict__", None)
            if isinstance(namespace, dict) and namespace.get(attr) is replacement:
                namespace[attr] = original
        _rebound.clear()


def modules() -> set:
    """The modules whose import installs a boundary (for the registry's import hook)."""
    with _lock:
        return {name.rpartition(".")[0] for name in (*_declared, *_functions)}


def on_import(module: str) -> None:
    with _lock:
        if not _active:
            return
        for name in list(_declared):
            if name.rpartition(".")[0] == module:
                install_if_imported(name)
        for dotted in list(_functions):
            if dotted.rpartition(".")[0] == module:
                install_function(dotted)


def install_if_imported(name: str) -> None:
    module, _, qualname = name.rpartition(".")
    cls = _classes.get(name) or getattr(sys.modules.get(module), qualname, None)
    if not isinstance(cls, type):
        return
    for method, (role, reader) in _declared[name].items():
        original = cls.__dict__.get(method)
        if original is None or (cls, method) in _installed or not callable(original):
            continue
        wrapper = _wrap(role, reader, original)
        try:
            setattr(cls, method, wrapper)
        except (TypeError, AttributeError):
            continue
        _installed[(cls, method)] = original


def _wrap(role, reader, original):
    if role == "holder":
        shape = getattr(reader, "shape", None)
        if shape is not None and isinstance(original, types.FunctionType):
            # The common shapes (``request_arg``, ``request_id_arg``) read in one call:
            # compiled where ``kvguard._fastpath`` is built, the slot saved and restored.
            position, name, attr = shape
            boundary = Boundary(original, 1, position, name, attr)
            functools.update_wrapper(boundary, original)
            boundary.__kvguard_boundary__ = True
            return boundary

        @functools.wraps(original)
        def as_holder(*args, **kwargs):
            try:
                holder = reader(args[1:], kwargs)
            except Exception:  # a call of an unexpected shape: the engine's own error
                holder = None
            if holder is None:
                return original(*args, **kwargs)
            with holding(holder):
                return original(*args, **kwargs)
        as_holder.__kvguard_boundary__ = True
        return as_holder
    if role == "begin":
        @functools.wraps(original)
        def begins_step(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            _quietly(reader, self, result)
            return result
        begins_step.__kvguard_boundary__ = True
        return begins_step
    if role == "end":
        @functools.wraps(original)
        def ends_step(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            finally:
                _quietly(reader, self, args, kwargs)
        ends_step.__kvguard_boundary__ = True
        return ends_step
    if role == "around":
        wrapper = reader(original)
        wrapper.__kvguard_boundary__ = True
        return wrapper
    raise ValueError(f"unknown boundary role {role!r}")


def _quietly(hook, *args) -> None:
    """A step hook never breaks the engine's step: its own failure is logged once, by the
    guard's internal-error path where a guard is known, else dropped."""
    try:
        hook(*args)
    except Exception as exc:  # pragma: no cover - defensive
        from .logger import emit
        import logging
        emit(logging.ERROR, "kvguard: a step boundary hook failed: %r", exc)
