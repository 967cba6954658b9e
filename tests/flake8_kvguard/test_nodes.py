"""nodes.py: Python's `ast`, in the shape of libcst's tree the rules were written for.

The converter is checked against libcst itself: on the fixtures, the linter's own
source and a file of every construct, the walk the analysis makes (cstutil.walk_all)
meets the same node types, in the same order, at the same positions as the walk the
analysis made over libcst's tree before (libcst's fields, formatting skipped).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

import flake8_kvguard
from flake8_kvguard import config, engine, index, nodes
from flake8_kvguard.cstutil import walk_all

from .helpers import FIXTURES

cst = pytest.importorskip("libcst")
from libcst.metadata import MetadataWrapper, PositionProvider  # noqa: E402

# What the analysis skipped in libcst's tree: whitespace, punctuation, comments.
_FORMATTING = frozenset(
    """
    lpar rpar comma semicolon leading_lines lines_after_decorators header footer
    trailing_whitespace colon equal dot star newline indent asynchronous operator
    default_indent default_newline encoding has_trailing_newline keyword attr
    """.split()
)
# libcst nodes with no counterpart: tokens, and the parts of an implicit concatenation
# of strings (`"a" "b"` is one string to ast).
_NOT_COMPARED = frozenset(
    """
    LeftParen RightParen LeftCurlyBrace RightCurlyBrace LeftSquareBracket
    RightSquareBracket Dot ParamSlash ParamStar Comment Newline EmptyLine
    ConcatenatedString FormattedString FormattedStringText FormattedStringExpression
    SimpleString TypeParameters TypeParam TypeVar Colon SimpleWhitespace BitOr
    """.split()
)

EVERY_CONSTRUCT = '''\
"""Docstring."""
from __future__ import annotations
import os, os.path as osp
from .. import a as b, c
from x import *
import torch


@decorator(1)
@other.attr
async def f(a, /, b: int = 1, *args, c, d: "torch.Tensor" = None, **kw) -> torch.Tensor:
    global g
    x = y = [1, *z, (2, 3)]
    x: int = 3
    x += 1; y -= 2
    del x, y[0]
    assert x, "message"
    raise ValueError("v") from None
    for i, (j, k) in enumerate(z):
        if i in k and not j or k is None:
            continue
        elif j not in k:
            break
        else:
            pass
    else:
        pass
    while x > 0 < y != 3: x -= 1
    with open(p) as fh, lock:
        pass
    async with a as (b, c): pass
    async for i in aiter(): pass
    try:
        pass
    except (ValueError, KeyError) as exc:
        raise
    except Exception:
        pass
    else:
        pass
    finally:
        pass
    if x:
        pass
    else:
        if y:
            pass
    return (yield x), (yield from y), await z


class C(Base, metaclass=Meta):
    attr: torch.Tensor
    def method(self, ids):
        self.refs[ids] -= 1
        self.free_list.extend(ids.tolist())
        lam = lambda q, *r, s=1: q + r[s:]
        return {k: v for k, v in d.items() if v}, {*s}, {**d, 1: 2}, [i for i in r for j in i]


def g(*, key):
    print(f"{key!r:>{width}} text", "a" "b", b"bytes", 1.5, 2j, 0x10, -1, ~x, +y, ...)
    t = a[1:2, ::3, i, *rest] if cond else a[(1, 2)]
    n = (w := compute())
    call(a, *b, c=1, **d)
    call(x for x in y)
    return t[None, ...], a @ b, a // b % c ** d << e >> f & g | h ^ i, [x, *y]


def outer():
    v = 1

    def inner():
        nonlocal v
        try:
            pass
        except* ValueError as group:
            pass
        return {i for i in v}


match command:
    case [first, *others] if first:
        pass
    case {"kind": k, **rest}:
        pass
    case Point(x=0, y=yy) | Point(1, 2) as p:
        pass
    case None | True | "s" | 1:
        pass
    case _:
        pass
'''


def _libcst_walk(tree):
    """(type, line, column) in the order the analysis walked libcst's tree; only the
    type for what is not an expression (findings are reported at expressions, and at a
    def's name)."""
    ranges = MetadataWrapper(tree, unsafe_skip_copy=True).resolve(PositionProvider)
    stack = [tree]
    found = []
    while stack:
        node = stack.pop()
        name = type(node).__name__
        if name not in _NOT_COMPARED and type(node) is not cst.Module:
            if isinstance(node, cst.BaseExpression):
                where = ranges.get(node)
                found.append((name, where.start.line, where.start.column))
            else:
                found.append((name,))
        kids = []
        for field in dataclasses.fields(node):
            if field.name in _FORMATTING or field.name.startswith("whitespace"):
                continue
            value = getattr(node, field.name)
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, cst.CSTNode):
                    kids.append(item)
        stack.extend(reversed(kids))
    return found


def _our_walk(module):
    found = []
    for node in walk_all(module):
        name = type(node).__name__
        if name in _NOT_COMPARED or node is module:
            continue
        if isinstance(node, nodes.BaseExpression):
            found.append((name, *nodes.start(node)))
        else:
            found.append((name,))
    return found


def _sources():
    yield "every_construct", EVERY_CONSTRUCT
    for path in sorted(FIXTURES.rglob("*.py")):
        yield str(path.relative_to(FIXTURES)), path.read_text()
    package = Path(flake8_kvguard.__file__).parent
    for path in sorted(package.rglob("*.py")):
        yield f"flake8_kvguard/{path.relative_to(package)}", path.read_text()


SOURCES = dict(_sources())


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_the_walk_meets_what_it_met_in_libcsts_tree(name):
    text = SOURCES[name]
    module = engine.parse(text)
    assert module is not None
    ours = _our_walk(module)
    theirs = _libcst_walk(cst.parse_module(text))
    if not text.isascii():  # columns: bytes (ours) against characters (libcst)
        ours = [entry[:2] for entry in ours]
        theirs = [entry[:2] for entry in theirs]
    assert ours == theirs


def test_every_construct_is_covered():
    kinds = {type(node).__name__ for node in walk_all(engine.parse(EVERY_CONSTRUCT))}
    defined = {
        name
        for name, value in vars(nodes).items()
        if isinstance(value, type) and issubclass(value, nodes.CSTNode) and value.__slots__
    }
    # Never made from Python 3.11's ast: implicit concatenations are one string, a match
    # sequence is a MatchList, `type X = ...` is newer (see newsyntax.py).
    missing = defined - kinds - {"CSTNode", "Module", "ConcatenatedString", "MatchTuple"}
    missing -= {"TypeAlias"}
    assert missing == set()


def test_fields_the_analysis_reads():
    module = engine.parse(
        "def f(a, *, b=2):\n"
        "    if x: pass\n"
        "    elif y: pass\n"
        "    else: z = t[i, 1:] + s[(1, 2)]\n"
        "    free(ids, blocks=other, *more)\n"
        "    q = not a in b\n"
    )
    function = module.body[0]
    assert type(function) is nodes.FunctionDef and function.name.value == "f"
    assert (function.name.lineno, function.name.col_offset) == (1, 4)
    assert [p.name.value for p in function.params.params] == ["a"]
    assert type(function.params.star_arg) is nodes.ParamStar
    assert [(p.name.value, p.default.value) for p in function.params.kwonly_params] == [("b", "2")]
    body = function.body.body
    branch = body[0]
    assert type(branch) is nodes.If and type(branch.body) is nodes.SimpleStatementSuite
    assert type(branch.orelse) is nodes.If  # elif
    assert type(branch.orelse.orelse) is nodes.Else
    assign = branch.orelse.orelse.body.body[0]
    left, right = assign.value.left, assign.value.right
    assert [type(e.slice).__name__ for e in left.slice] == ["Index", "Slice"]
    assert len(right.slice) == 1 and type(right.slice[0].slice.value) is nodes.Tuple
    call = body[1].body[0].value
    assert [(a.keyword.value if a.keyword else None, a.star) for a in call.args] == [
        (None, ""),
        ("blocks", ""),
        (None, "*"),
    ]
    negation = body[2].body[0].value
    assert type(negation.operator) is nodes.Not
    assert type(negation.expression.comparisons[0].operator) is nodes.In


def test_source_text_keeps_a_tuples_parentheses_and_findings_start_inside():
    module = engine.parse("ids.append((start, end))\nx = (y for y in z)\n")
    call = module.body[0].body[0].value
    pair = call.args[0].value
    assert nodes.segment(module, pair) == "(start, end)"  # as libcst's code for it
    assert nodes.start(pair) == (1, 12)
    generator = module.body[1].body[0].value
    assert nodes.segment(module, generator) == "(y for y in z)"
    assert nodes.start(generator) == (2, 5)


def test_positions_count_characters_for_findings():
    source = "x = 'é'; alloc.free(True)\n"
    found = engine.lint_source(source, config.DEFAULT, index.EMPTY, use_prefilter=False)
    assert [(f.line, f.col) for f in found] == [(1, source.index("True"))]


def test_syntax_newer_than_python_goes_through_libcst():
    source = "type Ids = list[int]\ndef f[T](alloc: T):\n    alloc.free(True)\n"
    try:
        ast.parse(source)
    except SyntaxError:
        pass
    else:
        pytest.skip(f"Python {sys.version_info[:2]} parses it: no fallback needed")
    module = engine.parse(source)
    assert [type(stmt).__name__ for stmt in module.body] == ["SimpleStatementLine", "FunctionDef"]
    found = engine.lint_source(source, config.DEFAULT, index.EMPTY, use_prefilter=False)
    assert [(f.line, f.col, f.code) for f in found] == [(3, 15, "KVG103")]
