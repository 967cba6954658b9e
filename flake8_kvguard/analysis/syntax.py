"""Shapes of statements (nodes.py) that the walks share: blocks, parameters, decorators.

Small pure functions over nodes; they know nothing of values or rules.
"""

from __future__ import annotations

from .. import nodes

from ..cstutil import dotted_name, walk_all


def is_int_literal(node):
    if type(node) is nodes.UnaryOperation:
        node = node.expression
    return type(node) is nodes.Integer


def block_body(suite):
    """The statements of an indented block or of a one-line `if x: a; b`."""
    body = suite.body
    if type(suite) is nodes.SimpleStatementSuite:
        return [nodes.SimpleStatementLine(body=body)]
    return body


def compound_blocks(stmt):
    blocks = []
    while type(stmt) is nodes.If and type(stmt.orelse) is nodes.If:  # an elif chain
        blocks.append(block_body(stmt.body))
        stmt = stmt.orelse
    for name in ("body", "orelse", "finalbody"):
        part = getattr(stmt, name, None)
        if part is None:
            continue
        if isinstance(part, nodes.BaseSuite):
            blocks.append(block_body(part))
        elif hasattr(part, "body") and isinstance(part.body, nodes.BaseSuite):
            blocks.append(block_body(part.body))
    for handler in getattr(stmt, "handlers", ()) or ():
        blocks.append(block_body(handler.body))
    for case in getattr(stmt, "cases", ()) or ():
        blocks.append(block_body(case.body))
    return blocks


def all_params(params):
    found = list(params.posonly_params) + list(params.params) + list(params.kwonly_params)
    return found


def has_decorator(function, name):
    for decorator in function.decorators:
        dotted = dotted_name(decorator.decorator)
        if dotted is not None and dotted.rpartition(".")[2] == name:
            return True
    return False


def is_static(function):
    return has_decorator(function, "staticmethod")


def is_none(node):
    return (type(node) is nodes.Name and node.value == "None") or (
        type(node) is nodes.SimpleString and node.evaluated_value == "None"
    )


def mentions_int(annotation):
    for node in walk_all(annotation):
        if type(node) is nodes.Name and node.value in ("int", "Tensor", "LongTensor", "IntTensor"):
            return True
        if type(node) is nodes.SimpleString and "int" in str(node.evaluated_value):
            return True
    return False


def del_names(target):
    if type(target) is nodes.Name:
        return [target.value]
    if type(target) in (nodes.Tuple, nodes.List):
        found = []
        for element in target.elements:
            found.extend(del_names(element.value))
        return found
    return []


def skips_seen(statements):
    """A loop body that starts with `if x in seen: continue` de-duplicates."""
    for stmt in statements:
        if type(stmt) is not nodes.If:
            continue
        body = block_body(stmt.body)
        if (
            len(body) == 1
            and type(body[0]) is nodes.SimpleStatementLine
            and any(type(small) is nodes.Continue for small in body[0].body)
        ):
            for node in walk_all(stmt.test):
                if type(node) is nodes.ComparisonTarget and type(node.operator) is nodes.In:
                    return True
    return False


def ids_param(function, in_class):
    """The parameter that receives the ids of a free-like function or method."""
    params = all_params(function.params)
    if in_class and not is_static(function):
        params = params[1:]
    return params[0] if params else None
