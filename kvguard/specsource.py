"""A spec checked against its class's source, without importing the class's module.

``kvguard run`` hands its specs to a command it starts, and must not import the command's code
itself (importing an engine can take seconds, start threads, or need a GPU). A spec naming a
method the class lacks is still a configuration error it can say in one line before the
command starts: the module's source is found as the import system would find it (no package
is imported, no ``__init__`` run) and the class read with ``ast``. Where the source cannot
tell (a base class from another module, ``__getattr__``, a class made at run time, a module
that is not a plain ``.py`` file), nothing is said: the staged process says it at import.
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys

from .spec import misfit


def source_misfit(dotted: str, spec, path=None) -> str | None:
    """Why ``spec`` cannot fit the class at ``dotted`` (``pkg.mod.Class``), read from its
    source; None when it fits or the source cannot tell."""
    module, _, name = dotted.rpartition(".")
    tree = _module_tree(module, path)
    if tree is None:
        return None
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    names = _methods(classes, name, set())
    if names is None:
        return None
    stand_in = type(name, (), {n: _stub for n in names})
    stand_in.__module__ = module
    return misfit(stand_in, spec, dotted)


def _stub(self):
    """A method read from the source (a stand-in: only its name counts)."""


def _methods(classes, name, seen):
    """The attribute names class ``name`` and its bases in the same module define; None when
    the source cannot tell."""
    node = classes.get(name)
    if node is None or name in seen or node.decorator_list or node.keywords:
        return None
    seen.add(name)
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, (ast.Assign, ast.AnnAssign)):
            targets = item.targets if isinstance(item, ast.Assign) else [item.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif not isinstance(item, (ast.Expr, ast.Pass)):
            return None  # an if/for/import in the class body: the source cannot tell
    if "__getattr__" in names:
        return None
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id == "object":
            continue
        inherited = _methods(classes, base.id, seen) if isinstance(base, ast.Name) else None
        if inherited is None:
            return None
        names |= inherited
    return names


def _module_tree(module: str, path=None):
    search = list(path) if path is not None else [os.getcwd(), *sys.path]
    spec = None
    parts = module.split(".")
    for i in range(len(parts)):
        try:
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), search)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        search = spec.submodule_search_locations or []
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return None
    try:
        with open(origin, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
