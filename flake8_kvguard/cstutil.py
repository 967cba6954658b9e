"""Small, fast helpers over the analysis's syntax tree (nodes.py).

The checker only reads the tree, so it walks the nodes' fields itself, iteratively.
"""

from __future__ import annotations

from . import nodes
from .nodes import SCOPES, children

__all__ = [
    "SCOPES",
    "bound_names",
    "children",
    "dotted_name",
    "keyword_arg",
    "names_in",
    "positional_args",
    "root_name",
    "walk",
    "walk_all",
]


def walk(node: nodes.CSTNode, *, into_scopes: bool = False):
    """Every node below `node` (pre-order, iterative). Nested functions, classes and
    lambdas are not entered unless `into_scopes`."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if not into_scopes and current is not node and type(current) in SCOPES:
            continue
        stack.extend(reversed(children(current)))


def walk_all(node: nodes.CSTNode):
    """Every node below `node`, nested scopes included."""
    return walk(node, into_scopes=True)


def dotted_name(node) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while type(node) is nodes.Attribute:
        parts.append(node.attr.value)
        node = node.value
    if type(node) is nodes.Name:
        parts.append(node.value)
        return ".".join(reversed(parts))
    return None


def root_name(node) -> str | None:
    """The name an attribute/subscript/call chain starts from: `self` in self.a[i].b()."""
    while True:
        kind = type(node)
        if kind is nodes.Name:
            return node.value
        if kind is nodes.Attribute or kind is nodes.Subscript:
            node = node.value
        elif kind is nodes.Call:
            node = node.func
        else:
            return None


def names_in(node) -> set:
    """Every Name read or written below `node`."""
    return {n.value for n in walk(node, into_scopes=True) if type(n) is nodes.Name}


def positional_args(call: nodes.Call) -> list:
    return [arg for arg in call.args if arg.keyword is None and not arg.star]


def keyword_arg(call: nodes.Call, name: str):
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg
    return None


def bound_names(target) -> list:
    """Names an assignment target binds (a, b in `a, (b, c.d) = ...`, not c)."""
    kind = type(target)
    if kind is nodes.Name:
        return [target.value]
    if kind in (nodes.Tuple, nodes.List):
        found = []
        for element in target.elements:
            found.extend(bound_names(element.value))
        return found
    if kind is nodes.StarredElement:
        return bound_names(target.value)
    return []
