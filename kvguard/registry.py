"""Which classes are allocators, and guarding their instances from construction.

``register()`` takes a class or a dotted name; a dotted name never imports its module, so the
built-in engine specs cost nothing until the engine itself is imported. ``instrument()`` patches
``__init__`` of every registered class already imported, and installs a post-import hook (a
``sys.meta_path`` finder that wraps the loader) for those imported later.

Each guard puts class-level dispatchers on its allocator's class (``kvguard.dispatch``), so a
call through the class reaches the instance's guard.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import os
import sys
import threading

from . import boundaries
from .logger import emit
from .marks import guard_of
from .owners import follow_threads, unfollow_threads
from .spec import AllocatorSpec, SpecMisfitError, misfit

_specs: dict[str, AllocatorSpec] = {}
_builtins_loaded = False
_instrumented: dict | None = None  # guard() keywords while instrument() is on
_patched: dict[type, object] = {}  # class -> its original __init__ (or _ABSENT)
_misfits: dict[str, str] = {}  # dotted name -> why its spec fits nothing (its instances unguarded)
_factory = None  # kvguard.guard, handed over by the guard package (use_factory)
_ABSENT = object()
_UNPATCHABLE = object()  # a class whose __init__ cannot be set: noted once, left alone
_lock = threading.RLock()
_constructing = threading.local()
if hasattr(os, "register_at_fork"):  # a fork during another thread's import or register()
    os.register_at_fork(after_in_child=_lock._at_fork_reinit)


def _dotted(cls_or_name) -> str:
    if isinstance(cls_or_name, str):
        module, _, qualname = cls_or_name.rpartition(".")
        if not module or not qualname or not all(p.isidentifier() for p in cls_or_name.split(".")):
            raise ValueError(f"register() takes a class or a dotted name 'package.module.Class', "
                             f"not {cls_or_name!r}")
        return cls_or_name
    if isinstance(cls_or_name, type):
        return f"{cls_or_name.__module__}.{cls_or_name.__qualname__}"
    raise TypeError(f"register() takes a class or a dotted name, not {type(cls_or_name).__name__}")


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    from .adapters import BUILTIN_BOUNDARIES, BUILTIN_FUNCTION_BOUNDARIES, BUILTIN_SPECS
    for name, spec in BUILTIN_SPECS.items():
        _specs.setdefault(name, spec)
    for name, methods in BUILTIN_BOUNDARIES.items():
        boundaries.declare(name, **methods)
    for name, make in BUILTIN_FUNCTION_BOUNDARIES.items():
        boundaries.declare_function(name, make)


def register(cls_or_name, spec: AllocatorSpec) -> None:
    """Declare an allocator class; instances created while instrumented are guarded."""
    if not isinstance(spec, AllocatorSpec):
        raise TypeError(f"register() needs a kvguard.AllocatorSpec, not {type(spec).__name__}")
    name = _dotted(cls_or_name)
    problem = misfit(cls_or_name, spec) if isinstance(cls_or_name, type) else None
    if problem is not None:
        raise SpecMisfitError(f"kvguard.register({name}): {problem}")
    with _lock:
        _load_builtins()
        _specs[name] = spec
        _misfits.pop(name, None)
        if _instrumented is not None:
            _patch_if_imported(name)


def unregister(cls_or_name) -> None:
    name = _dotted(cls_or_name)
    with _lock:
        _specs.pop(name, None)
        _misfits.pop(name, None)
        for cls in [c for c in _patched if _dotted(c) == name]:
            _unpatch(cls)


def registered() -> dict[str, AllocatorSpec]:
    """Dotted name -> spec of every registered class, built-ins included."""
    with _lock:
        _load_builtins()
        return dict(_specs)


def misfits() -> dict[str, str]:
    """Dotted name -> why its registered spec fits nothing of the class (a method it names is
    missing), for the classes imported while instrumented: their instances run unguarded, and
    the pytest plugin and staging say so once (a configuration error, not a violation)."""
    with _lock:
        return dict(_misfits)


def spec_for(cls: type) -> AllocatorSpec | None:
    """The spec registered for ``cls`` or its nearest registered base class."""
    with _lock:
        _load_builtins()
        for klass in cls.__mro__:
            spec = _specs.get(f"{klass.__module__}.{klass.__qualname__}")
            if spec is not None:
                return spec
    return None


def instrumented() -> bool:
    return _instrumented is not None


def instrument(**guard_options) -> None:
    """Guard every instance of every registered class created from now on, including classes
    whose module is imported later. ``guard_options`` go to each ``kvguard.guard()`` call
    (``on_violation``, ``stacks``, ...)."""
    global _instrumented
    with _lock:
        _load_builtins()
        _instrumented = dict(guard_options)
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        for name in list(_specs):
            _patch_if_imported(name)
        boundaries.instrument()  # the engines' request and step boundaries (owners, leases)
        follow_threads()  # threads started under a test or request run as it


def uninstrument() -> None:
    """Stop guarding new instances; guards already attached stay until ``unguard()``."""
    global _instrumented
    with _lock:
        _instrumented = None
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
        for cls in list(_patched):
            _unpatch(cls)
        boundaries.uninstrument()
        unfollow_threads()


def _resolve(name: str):
    """The class behind a dotted name if its module is already imported, else None."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is None:
            continue
        obj = module
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj if isinstance(obj, type) else None
    return None


def _patch_if_imported(name: str) -> None:
    cls = _resolve(name)
    if cls is None:
        return
    true_name = _dotted(cls)
    if true_name != name:  # registered under a re-export: remember the spec by its own name too
        _specs.setdefault(true_name, _specs[name])
    problem = misfit(cls, spec_for(cls) or AllocatorSpec(), name)
    if problem is not None:  # a configuration error: said once, never a TypeError per instance
        if name not in _misfits:
            _misfits[name] = problem
            emit(logging.WARNING, "kvguard: configuration error: %s; its instances run "
                 "unguarded", problem)
        return
    _patch(cls)


def _patch(cls: type) -> None:
    """Guard each new instance of ``cls`` once its constructor is done. A class that cannot be
    patched (a C type such as ``decimal.Decimal``: its ``__init__`` is read-only) stays unguarded,
    said in one error line: instrumenting never breaks an import or a constructor."""
    if cls in _patched:
        return
    original = cls.__dict__.get("__init__", _ABSENT)
    init = cls.__init__
    # A class built in __new__ alone has object.__init__, which refuses the constructor's
    # arguments once __init__ is no longer object's own: call it bare, as Python would.
    bare = init is object.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_constructing, "depth", 0)
        _constructing.depth = depth + 1
        try:
            if bare:
                init(self)
            else:
                init(self, *args, **kwargs)
        finally:
            _constructing.depth = depth
        # Guard once the outermost constructor is done, so a subclass's own set-up is included.
        if depth == 0 and _instrumented is not None:
            _guard_new(self)

    __init__.__kvguard_patch__ = True
    try:
        cls.__init__ = __init__
    except (TypeError, AttributeError) as exc:
        emit(logging.ERROR, "kvguard: cannot guard instances of %s: %s (it runs unguarded)",
             _dotted(cls), exc)
        _patched[cls] = _UNPATCHABLE
        return
    _patched[cls] = original


def _unpatch(cls: type) -> None:
    original = _patched.pop(cls)
    if original is _UNPATCHABLE:
        return
    if original is _ABSENT:
        try:
            del cls.__init__
        except AttributeError:
            pass
    else:
        cls.__init__ = original


def use_factory(factory) -> None:
    """``kvguard.guard``, called with ``(obj, **options)`` on each new instance while
    instrumented. The guard package hands it over when it loads: the registry never imports
    the guard (the guard imports the registry, to find an allocator's spec)."""
    global _factory
    _factory = factory


@contextlib.contextmanager
def unguarded():
    """Instances created in this thread inside the block are not guarded, even while
    instrumented: the conformance fuzzer tests an allocator, not the guard around it."""
    depth = getattr(_constructing, "paused", 0)
    _constructing.paused = depth + 1
    try:
        yield
    finally:
        _constructing.paused = depth


def _guard_new(obj) -> None:
    if guard_of(obj) is not None or _factory is None or getattr(_constructing, "paused", 0):
        return
    # Attached at construction: a block that is not free now was reserved by the constructor
    # (a null block, padding), never handed out, so freeing it is foreign-id, not learned.
    options = {"learn": False, **(_instrumented or {})}
    try:
        _factory(obj, **options)
    except Exception as exc:
        if options.get("on_violation", "raise") == "raise":
            raise
        emit(logging.ERROR, "kvguard: could not guard a new %s: %r", type(obj).__qualname__, exc)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Lets the real finders find a module, then patches registered classes once it has run."""

    def find_spec(self, fullname, path=None, target=None):
        with _lock:
            wanted = any(name.rpartition(".")[0] == fullname for name in _specs) or (
                fullname in boundaries.modules())
        if not wanted or getattr(_constructing, "finding", False):
            return None
        _constructing.finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            _constructing.finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, fullname) -> None:
        self._loader = loader
        self._fullname = fullname

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        with _lock:
            if _instrumented is None:
                return
            for name in list(_specs):
                if name.rpartition(".")[0] == self._fullname:
                    _patch_if_imported(name)
        boundaries.on_import(self._fullname)

    def __getattr__(self, name):
        return getattr(self._loader, name)


_FINDER = _PostImportFinder()
