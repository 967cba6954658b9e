"""A suggested spec checked: against an instance of its class, and against a built-in spec.

``kvguard spec suggest`` (``specsuggest``) reads a class; this drives an instance a few rounds
under a guard with the spec read (allocate, share, free, the allocator's own free count against
the ledger's) and says what it could not confirm; and for the engines' classes, where the
reading differs from the built-in spec and why (``differences``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys

from .spec import DEFAULT_SPEC, AllocatorSpec
from .specsuggest import COUNT_PARAMS, body, functions, params


def self_check(cls, spec, factory=None) -> list:
    """Drive an instance a few rounds under a guard with ``spec``; lines saying what was
    confirmed and what could not be."""
    import kvguard
    out = []
    try:
        allocator = _build(cls, factory)
    except Exception as exc:
        return [f"could not confirm anything: cannot build a {cls.__name__} ({exc!r}); give "
                "--factory 'cls(...)'"]
    try:
        g = kvguard.guard(allocator, spec)
    except Exception as exc:
        return [f"the spec does not fit an instance: {exc}"]
    if spec.alloc is None or spec.alloc_ids is not None:
        out.append(f"could not confirm {spec.pattern('alloc')}: it needs an argument kvguard "
                   "cannot make (drive it from your tests)")
        return out
    try:
        got = _call_alloc(allocator, spec.alloc, 2)
        ids = sorted(g.live)
        out.append(f"confirmed: {spec.alloc}() handed out {ids}")
    except Exception as exc:
        return out + [f"could not confirm {spec.alloc}(): {type(exc).__name__}: {exc}"]
    if spec.free_ids is not None:
        return out + [f"could not confirm {spec.pattern('free')}: its ids live inside an "
                      "argument kvguard cannot make"]
    try:
        if spec.share:
            getattr(allocator, spec.share)(got)
            out.append(f"confirmed: {spec.share}() took a reference")
            getattr(allocator, spec.free)(got)
        getattr(allocator, spec.free)(got)
        out.append(f"confirmed: {spec.free}() took them back; the ledger holds "
                   f"{len(g.live)} live")
    except Exception as exc:
        out.append(f"could not confirm {spec.free}(): {type(exc).__name__}: {exc}")
    if spec.free_count is not None:
        try:
            g.check()
            out.append(f"confirmed: the allocator's {spec.free_count} moved as the ledger did")
        except Exception as exc:
            out.append(f"free_count={spec.free_count} disagrees with the ledger: "
                       f"{str(exc).splitlines()[0]}")
    else:
        out.append("could not confirm a free count: none found (free_count=...)")
    out += [f"note: {n}" for n in g.notes]
    g.unguard()
    return out


def _build(cls, factory):
    if factory:
        return eval(factory, {"cls": cls, cls.__name__: cls})  # noqa: S307 -- the user's own
    errors = []
    for attempt in ((16,), (), ):
        try:
            return cls(*attempt)
        except Exception as exc:
            errors.append(exc)
    raise errors[0]


def _call_alloc(allocator, name, n):
    method = getattr(allocator, name)
    try:
        names = list(inspect.signature(method).parameters)
    except (TypeError, ValueError):
        names = ["n"]
    return method(n) if names and names[0] in COUNT_PARAMS else method()


# --- against a built-in spec ------------------------------------------------------------------

def differences(suggested, builtin, cls) -> list:
    """``[(keyword, suggested, built-in, why)]`` where the two differ in meaning."""
    out = []
    funcs = functions(cls)
    adapted = {getattr(i, "method", None): getattr(i, "role", None)
               for i in getattr(builtin.adapter, "installers", ())}
    for key in AllocatorSpec.keywords():
        ours, theirs = getattr(suggested, key), getattr(builtin, key)
        if ours == theirs or _same_argument(key, ours, theirs, builtin, funcs):
            continue
        if key == "reset" and all(adapted.get(m) == "resetting" for m in ours) and not theirs:
            continue  # the built-in adapter guards the same methods as resets
        why = _why(key, theirs)
        if key in ("alloc", "free") and isinstance(ours, str):
            inner = theirs if isinstance(theirs, str) else None
            if inner and _calls(funcs.get(ours), inner):
                why = (f"{ours}() calls {inner}(), where the ids change hands: the built-in "
                       f"spec guards the inner one")
            elif ours in adapted:
                why = (f"the built-in spec guards {ours}() through its adapter "
                       f"({adapted[ours]}), and {key}={theirs!r}")
        out.append((key, ours, theirs, why))
    return out


def _calls(func, name) -> bool:
    fn = body(func) if func is not None else None
    return fn is not None and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
        for n in ast.walk(fn))


def _same_argument(key, ours, theirs, builtin, funcs) -> bool:
    """``free_arg=0`` and ``free_arg="blocks"`` name one parameter of ``free``."""
    if key != "free_arg":
        return False
    fn = body(funcs.get(builtin.free))
    names = params(fn)
    pos = lambda v: names.index(v) if isinstance(v, str) and v in names else v  # noqa: E731
    return pos(ours) == pos(theirs)


def _why(key, theirs) -> str:
    if key == "adapter":
        installers = getattr(theirs, "installers", ())
        roles = ", ".join(f"{getattr(i, 'role', 'custom')} {getattr(i, 'method', '')}".strip()
                          for i in installers)
        return f"the built-in spec guards more methods through an adapter ({roles})"
    if callable(theirs) and not isinstance(theirs, str):
        name = getattr(theirs, "__qualname__", type(theirs).__name__)
        return (f"the built-in spec computes it ({name}): engine knowledge a reading of the "
                "source cannot give")
    if key in ("skip", "iterator_ok", "refcount_attr", "live_ids", "tensor_ok", "pool_arg"):
        return "how the engine's callers use it, which its own source does not say"
    return "the names and bodies read differently here; the built-in spec was written by hand"


# --- the command ------------------------------------------------------------------------------

def spec_command(argv) -> int:
    """``kvguard spec suggest pkg.mod.Class [--factory EXPR] [--no-check]``."""
    from .cli import Parser, UsageError
    from .specgrammar import format_entry
    from .specsuggest import suggest
    parser = Parser(prog="kvguard spec", description=(
        "kvguard spec suggest pkg.mod.Class: read an allocator class (its methods' names and "
        "bodies, reference counts, free counts), print a spec in kvguard's spec language, and "
        "check it against an instance"))
    parser.add_argument("action", choices=["suggest"])
    parser.add_argument("name", metavar="DOTTED.NAME", help="the allocator class")
    parser.add_argument("--factory", metavar="EXPR", help="builds an instance, the class bound "
                        "to `cls` (default: cls(16), then cls())")
    parser.add_argument("--no-check", action="store_true", help="print the spec only")
    args = parser.parse_args(argv)
    cls = _import(args.name)
    if not isinstance(cls, type):
        raise UsageError(f"kvguard spec: error: {args.name} is not a class")
    spec, notes = suggest(cls)
    name = f"{cls.__module__}.{cls.__qualname__}"
    text, _ = format_entry(name, spec)
    print(text)
    for line in notes:
        print(f"# {line}")
    if not args.no_check:
        for line in self_check(cls, spec, args.factory):
            print(f"# {line}")
    from .registry import registered
    builtin = registered().get(name)
    if builtin is not None and builtin != DEFAULT_SPEC:
        found = differences(spec, builtin, cls)
        print(f"# built-in spec: {'the same' if not found else 'differs:'}")
        for key, ours, theirs, why in found:
            print(f"#   {key}: suggested {ours!r}, built-in {theirs!r}: {why}")
    return 0


def _import(dotted: str):
    from .cli import UsageError
    if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m` would
        sys.path.insert(0, os.getcwd())
    module, _, attr = dotted.replace(":", ".").rpartition(".")
    parts = [attr]
    while module:
        try:
            obj = sys.modules.get(module) or importlib.import_module(module)
        except ImportError:
            module, _, outer = module.rpartition(".")
            parts.insert(0, outer)
            continue
        try:
            for part in parts:
                obj = getattr(obj, part)
        except AttributeError as exc:
            raise UsageError(f"kvguard spec: error: cannot import {dotted}: {exc}") from None
        return obj
    raise UsageError(f"kvguard spec: error: cannot import {dotted}")
