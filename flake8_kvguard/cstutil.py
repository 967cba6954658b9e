"""Small, fast helpers over libcst nodes.

libcst's own visitors rebuild every node they pass; the checker only reads, so it walks
the dataclass fields itself and skips the whitespace and punctuation that make up most
of a concrete syntax tree.
"""

from __future__ import annotations

import dataclasses

import libcst as cst

_FORMATTING = frozenset("""
    lpar rpar comma semicolon leading_lines lines_after_decorators header footer
    trailing_whitespace colon equal dot star newline indent asynchronous operator
    default_indent default_newline encoding has_trailing_newline keyword attr
    """.split())
_FIELDS: dict = {}


def _fields_of(cls) -> tuple:
    names = _FIELDS.get(cls)
    if names is None:
        names = tuple(
            field.name
            for field in dataclasses.fields(cls)
            if field.name not in _FORMATTING and not field.name.startswith("whitespace")
        )
        _FIELDS[cls] = names
    return names


def children(node: cst.CSTNode):
    """The child nodes that carry meaning, in source order."""
    result = []
    for name in _fields_of(type(node)):
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            result.append(value)
        elif isinstance(value, (tuple, list)):
            for item in value:
                if isinstance(item, cst.CSTNode):
                    result.append(item)
    return result


def walk(node: cst.CSTNode, *, into_scopes: bool = False):
    """Every node below `node` (pre-order, iterative). Nested functions, classes and
    lambdas are not entered unless `into_scopes`."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        if not into_scopes and current is not node and type(current) in SCOPES:
            continue
        stack.extend(reversed(children(current)))


SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)


def walk_all(node: cst.CSTNode):
    """Every node below `node`, nested scopes included."""
    return walk(node, into_scopes=True)


def dotted_name(node) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None."""
    parts = []
    while type(node) is cst.Attribute:
        parts.append(node.attr.value)
        node = node.value
    if type(node) is cst.Name:
        parts.append(node.value)
        return ".".join(reversed(parts))
    return None


def root_name(node) -> str | None:
    """The name an attribute/subscript/call chain starts from: `self` in self.a[i].b()."""
    while True:
        kind = type(node)
        if kind is cst.Name:
            return node.value
        if kind is cst.Attribute or kind is cst.Subscript:
            node = node.value
        elif kind is cst.Call:
            node = node.func
        else:
            return None


def names_in(node) -> set:
    """Every Name read or written below `node`."""
    return {n.value for n in walk(node, into_scopes=True) if type(n) is cst.Name}


def positional_args(call: cst.Call) -> list:
    return [arg for arg in call.args if arg.keyword is None and not arg.star]


def keyword_arg(call: cst.Call, name: str):
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg
    return None


def bound_names(target) -> list:
    """Names an assignment target binds (a, b in `a, (b, c.d) = ...`, not c)."""
    kind = type(target)
    if kind is cst.Name:
        return [target.value]
    if kind in (cst.Tuple, cst.List):
        found = []
        for element in target.elements:
            found.extend(bound_names(element.value))
        return found
    if kind is cst.StarredElement:
        return bound_names(target.value)
    return []


def is_atomic(node) -> bool:
    """Whether `node.attr` can be written without adding parentheses around node."""
    if getattr(node, "lpar", None):
        return True
    return isinstance(
        node,
        (
            cst.Name,
            cst.Attribute,
            cst.Call,
            cst.Subscript,
            cst.List,
            cst.Tuple,
            cst.Set,
            cst.Dict,
            cst.ListComp,
            cst.SetComp,
            cst.DictComp,
            cst.GeneratorExp,
        ),
    ) and not (type(node) is cst.Tuple and not node.lpar)


_EMPTY_MODULE = cst.Module(body=[])


def source_of(node) -> str:
    return _EMPTY_MODULE.code_for_node(node)


def parenthesized(node):
    if is_atomic(node):
        return node
    return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def method_call(node, method: str) -> cst.Call:
    """`node.method()`, parenthesizing node where needed."""
    return cst.Call(func=cst.Attribute(value=parenthesized(node), attr=cst.Name(method)))


def builtin_call(name: str, node) -> cst.Call:
    """`name(node)`; a generator expression keeps its own parentheses."""
    return cst.Call(func=cst.Name(name), args=[cst.Arg(value=node)])
