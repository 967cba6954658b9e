"""The syntax tree the analysis reads: the standard library's `ast`, in libcst's shape.

The rules were written against libcst's node classes (`Call.args[i].value`,
`Subscript.slice[i].slice`, `If.orelse` as `Else` or `If`, statements grouped in
`SimpleStatementLine`s, operators as node types). Importing libcst costs 0.2-0.3 s and
its parser more than Python's own, and flake8 hands every plugin an `ast` tree it has
already parsed, so detection reads that tree instead: `from_ast` turns an `ast.Module`
into small `__slots__` objects named after libcst's classes, holding exactly the fields
the analysis reads, each with its `ast` span (1-based lines, UTF-8 byte columns).
libcst itself is needed only to rewrite code (fixer.py, `--fix`).

What libcst tells and `ast` does not is worked out from the source text: a `def`'s
name position, an `elif` against an `else:` holding an `if`, one-line suites, simple
statements sharing a line, a parenthesized tuple in a subscript. Implicitly
concatenated strings are one `SimpleString` (libcst: a `ConcatenatedString`); `True`,
`False` and `None` are `Name`s, as in libcst.
"""

from __future__ import annotations

import ast
import re

_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class CSTNode:
    """A node: its fields, the fields a walk descends into (`_children`, in libcst's
    order), and its span in the source (`ast`'s convention)."""

    __slots__ = ("lineno", "col_offset", "end_lineno", "end_col_offset")
    _children: tuple = ()
    _fields: tuple = ()  # the fields a copy sets (newsyntax.py)

    def __init_subclass__(cls, **kwargs):
        """Each class gets a constructor taking its fields in order (all optional) and,
        unless it says otherwise, a walk over all of them."""
        super().__init_subclass__(**kwargs)
        fields = cls.__dict__.get("__slots__", ())
        if "_children" not in cls.__dict__:
            cls._children = tuple(fields)
        if "_fields" not in cls.__dict__:
            cls._fields = tuple(fields)
        if fields:
            cls.__init__ = _first_init

    def __repr__(self):
        return f"{type(self).__name__}@{getattr(self, 'lineno', '?')}:{getattr(self, 'col_offset', '?')}"


def _first_init(self, *args, **kwargs):
    """The constructor of a class until its first instance: it compiles the class's
    own `__init__(self, field=None, ...)` setting each field (as dataclasses do),
    puts it in its place and calls it. Compiling the constructors of all 150 classes
    at import took longer than a small flake8 run spends converting, and a run meets
    only some of the classes."""
    for cls in type(self).__mro__:
        if cls.__dict__.get("__init__") is _first_init:
            break
    fields = cls.__dict__["__slots__"]
    arguments = ", ".join(f"{field}=None" for field in fields)
    body = "".join(f"\n    self.{field} = {field}" for field in fields)
    namespace: dict = {}
    exec(f"def __init__(self, {arguments}):{body}\n", namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__name__}.__init__"
    cls.__init__ = init
    init(self, *args, **kwargs)


class BaseExpression(CSTNode):
    __slots__ = ()


class BaseStatement(CSTNode):
    __slots__ = ()


class BaseSmallStatement(CSTNode):
    __slots__ = ()


class BaseSuite(CSTNode):
    __slots__ = ()


# Module and blocks.
class Module(CSTNode):
    __slots__ = ("body", "source")  # source: the lines, as UTF-8 bytes
    _children = ("body",)

    @property
    def code(self) -> str:
        return b"".join(self.source).decode("utf-8", "surrogatepass")


class SimpleStatementLine(BaseStatement):
    __slots__ = ("body",)


class SimpleStatementSuite(BaseSuite):
    __slots__ = ("body",)


class IndentedBlock(BaseSuite):
    __slots__ = ("body",)


class Else(CSTNode):
    __slots__ = ("body",)


class Finally(CSTNode):
    __slots__ = ("body",)


# Simple statements.
class Expr(BaseSmallStatement):
    __slots__ = ("value",)


class Assign(BaseSmallStatement):
    __slots__ = ("targets", "value")


class AssignTarget(CSTNode):
    __slots__ = ("target",)


class AnnAssign(BaseSmallStatement):
    __slots__ = ("target", "annotation", "value")


class Annotation(CSTNode):
    __slots__ = ("annotation",)


class AugAssign(BaseSmallStatement):
    __slots__ = ("target", "operator", "value")
    _children = ("target", "value")


class Return(BaseSmallStatement):
    __slots__ = ("value",)


class Raise(BaseSmallStatement):
    __slots__ = ("exc", "cause")


class Assert(BaseSmallStatement):
    __slots__ = ("test", "msg")


class Del(BaseSmallStatement):
    __slots__ = ("target",)


class Pass(BaseSmallStatement):
    __slots__ = ()


class Break(BaseSmallStatement):
    __slots__ = ()


class Continue(BaseSmallStatement):
    __slots__ = ()


class Global(BaseSmallStatement):
    __slots__ = ("names",)


class Nonlocal(BaseSmallStatement):
    __slots__ = ("names",)


class NameItem(CSTNode):
    __slots__ = ("name",)


class Import(BaseSmallStatement):
    __slots__ = ("names",)


class ImportFrom(BaseSmallStatement):
    __slots__ = ("module", "names", "relative")
    _children = ("module", "names")


class ImportAlias(CSTNode):
    __slots__ = ("name", "asname")


class AsName(CSTNode):
    __slots__ = ("name",)


class ImportStar(CSTNode):
    __slots__ = ()


class TypeAlias(BaseSmallStatement):
    __slots__ = ("name", "value")


# Compound statements.
class If(BaseStatement):
    __slots__ = ("test", "body", "orelse")


class For(BaseStatement):
    __slots__ = ("target", "iter", "body", "orelse", "asynchronous")
    _children = ("target", "iter", "body", "orelse")


class While(BaseStatement):
    __slots__ = ("test", "body", "orelse")


class With(BaseStatement):
    __slots__ = ("items", "body", "asynchronous")
    _children = ("items", "body")


class WithItem(CSTNode):
    __slots__ = ("item", "asname")


class Try(BaseStatement):
    __slots__ = ("body", "handlers", "orelse", "finalbody")


class TryStar(BaseStatement):
    __slots__ = ("body", "handlers", "orelse", "finalbody")


class ExceptHandler(CSTNode):
    __slots__ = ("body", "type", "name")


class ExceptStarHandler(CSTNode):
    __slots__ = ("body", "type", "name")


class FunctionDef(BaseStatement):
    """A def. Its body is converted on first use: the walk leaves alone the bodies
    no rule can find anything in (analysis/quiet.py), and those are never built.
    `declarations()` gives what a first pass over the module reads of the body
    without converting the rest of it."""

    __slots__ = ("name", "params", "_body", "decorators", "returns", "asynchronous", "_source")
    _children = ("name", "params", "body", "decorators", "returns")
    _fields = ("name", "params", "body", "decorators", "returns", "asynchronous")

    @property
    def body(self):
        body = self._body
        if body is None and self._source is not None:
            converter, node = self._source
            body = self._body = converter.suite(node.body)
        return body

    @body.setter
    def body(self, value):
        self._body = value

    @property
    def ast_node(self):
        """The `ast` def this was converted from (None for a tree built another way)."""
        return self._source[1] if self._source is not None else None

    def declarations(self):
        """The imports, defs and classes of the body (not those inside nested defs and
        classes), in the order a walk through its blocks meets them: a compound
        statement's body, else, finally, then its handlers and cases. Only these are
        converted; None once the whole body is (then read the body)."""
        if self._body is not None or self._source is None:
            return None
        converter, node = self._source
        found = []
        converter.declarations(node.body, found)
        return found


class Decorator(CSTNode):
    __slots__ = ("decorator",)


class Parameters(CSTNode):
    __slots__ = ("params", "star_arg", "kwonly_params", "star_kwarg", "posonly_params")


class Param(CSTNode):
    __slots__ = ("name", "annotation", "default", "star")
    _children = ("name", "annotation", "default")


class ParamStar(CSTNode):
    __slots__ = ()


class ClassDef(BaseStatement):
    __slots__ = ("name", "body", "bases", "keywords", "decorators")


class Match(BaseStatement):
    __slots__ = ("subject", "cases")


class MatchCase(CSTNode):
    __slots__ = ("pattern", "body", "guard")


class MatchValue(CSTNode):
    __slots__ = ("value",)


class MatchSingleton(CSTNode):
    __slots__ = ("value",)


class MatchList(CSTNode):
    __slots__ = ("patterns",)


class MatchTuple(CSTNode):
    __slots__ = ("patterns",)


class MatchSequenceElement(CSTNode):
    __slots__ = ("value",)


class MatchStar(CSTNode):
    __slots__ = ("name",)


class MatchMapping(CSTNode):
    __slots__ = ("elements", "rest")


class MatchMappingElement(CSTNode):
    __slots__ = ("key", "pattern")


class MatchClass(CSTNode):
    __slots__ = ("cls", "patterns", "kwds")


class MatchKeywordElement(CSTNode):
    __slots__ = ("key", "pattern")


class MatchAs(CSTNode):
    __slots__ = ("pattern", "name")


class MatchOr(CSTNode):
    __slots__ = ("patterns",)


class MatchOrElement(CSTNode):
    __slots__ = ("pattern",)


# Expressions.
class Name(BaseExpression):
    __slots__ = ("value",)
    _children = ()


class Attribute(BaseExpression):
    __slots__ = ("value", "attr")
    _children = ("value",)


class Call(BaseExpression):
    __slots__ = ("func", "args")


class Arg(CSTNode):
    __slots__ = ("value", "keyword", "star")
    _children = ("value",)


class Subscript(BaseExpression):
    __slots__ = ("value", "slice")


class SubscriptElement(CSTNode):
    __slots__ = ("slice",)


class Index(CSTNode):
    __slots__ = ("value", "star")
    _children = ("value",)


class Slice(CSTNode):
    __slots__ = ("lower", "upper", "step")


class Tuple(BaseExpression):
    __slots__ = ("elements", "inside")  # inside: where it starts within its own "("
    _children = ("elements",)


class List(BaseExpression):
    __slots__ = ("elements",)


class Set(BaseExpression):
    __slots__ = ("elements",)


class Element(CSTNode):
    __slots__ = ("value",)


class StarredElement(BaseExpression):
    __slots__ = ("value",)


class Dict(BaseExpression):
    __slots__ = ("elements",)


class DictElement(CSTNode):
    __slots__ = ("key", "value")


class StarredDictElement(CSTNode):
    __slots__ = ("value",)


class ListComp(BaseExpression):
    __slots__ = ("elt", "for_in")


class SetComp(BaseExpression):
    __slots__ = ("elt", "for_in")


class GeneratorExp(BaseExpression):
    __slots__ = ("elt", "for_in", "inside")
    _children = ("elt", "for_in")


class DictComp(BaseExpression):
    __slots__ = ("key", "value", "for_in")


class CompFor(CSTNode):
    __slots__ = ("target", "iter", "ifs", "inner_for_in", "asynchronous")
    _children = ("target", "iter", "ifs", "inner_for_in")


class CompIf(CSTNode):
    __slots__ = ("test",)


class Comparison(BaseExpression):
    __slots__ = ("left", "comparisons")


class ComparisonTarget(CSTNode):
    __slots__ = ("operator", "comparator")
    _children = ("comparator",)


class BinaryOperation(BaseExpression):
    __slots__ = ("left", "operator", "right")
    _children = ("left", "right")


class BooleanOperation(BaseExpression):
    __slots__ = ("left", "operator", "right")
    _children = ("left", "right")


class UnaryOperation(BaseExpression):
    __slots__ = ("operator", "expression")
    _children = ("expression",)


class IfExp(BaseExpression):
    __slots__ = ("test", "body", "orelse")


class Lambda(BaseExpression):
    __slots__ = ("params", "body")


class NamedExpr(BaseExpression):
    __slots__ = ("target", "value")


class Await(BaseExpression):
    __slots__ = ("expression",)


class Yield(BaseExpression):
    __slots__ = ("value",)


class From(CSTNode):
    __slots__ = ("item",)


class Integer(BaseExpression):
    __slots__ = ("value",)
    _children = ()


class Float(BaseExpression):
    __slots__ = ("value",)
    _children = ()


class Imaginary(BaseExpression):
    __slots__ = ("value",)
    _children = ()


class SimpleString(BaseExpression):
    __slots__ = ("value", "evaluated_value")
    _children = ()


class ConcatenatedString(BaseExpression):
    __slots__ = ("left", "right")


class FormattedString(BaseExpression):
    __slots__ = ("parts",)


class FormattedStringText(CSTNode):
    __slots__ = ("value",)
    _children = ()


class FormattedStringExpression(CSTNode):
    __slots__ = ("expression", "conversion", "format_spec")
    _children = ("expression", "format_spec")


class Ellipsis(BaseExpression):
    __slots__ = ()


# Operators: their type is what the analysis reads.
class Add(CSTNode):
    __slots__ = ()


class Subtract(CSTNode):
    __slots__ = ()


class Multiply(CSTNode):
    __slots__ = ()


class Divide(CSTNode):
    __slots__ = ()


class FloorDivide(CSTNode):
    __slots__ = ()


class Modulo(CSTNode):
    __slots__ = ()


class Power(CSTNode):
    __slots__ = ()


class MatrixMultiply(CSTNode):
    __slots__ = ()


class LeftShift(CSTNode):
    __slots__ = ()


class RightShift(CSTNode):
    __slots__ = ()


class BitOr(CSTNode):
    __slots__ = ()


class BitAnd(CSTNode):
    __slots__ = ()


class BitXor(CSTNode):
    __slots__ = ()


class AddAssign(CSTNode):
    __slots__ = ()


class SubtractAssign(CSTNode):
    __slots__ = ()


class MultiplyAssign(CSTNode):
    __slots__ = ()


class DivideAssign(CSTNode):
    __slots__ = ()


class FloorDivideAssign(CSTNode):
    __slots__ = ()


class ModuloAssign(CSTNode):
    __slots__ = ()


class PowerAssign(CSTNode):
    __slots__ = ()


class MatrixMultiplyAssign(CSTNode):
    __slots__ = ()


class LeftShiftAssign(CSTNode):
    __slots__ = ()


class RightShiftAssign(CSTNode):
    __slots__ = ()


class BitOrAssign(CSTNode):
    __slots__ = ()


class BitAndAssign(CSTNode):
    __slots__ = ()


class BitXorAssign(CSTNode):
    __slots__ = ()


class Not(CSTNode):
    __slots__ = ()


class Minus(CSTNode):
    __slots__ = ()


class Plus(CSTNode):
    __slots__ = ()


class BitInvert(CSTNode):
    __slots__ = ()


class And(CSTNode):
    __slots__ = ()


class Or(CSTNode):
    __slots__ = ()


class Equal(CSTNode):
    __slots__ = ()


class NotEqual(CSTNode):
    __slots__ = ()


class LessThan(CSTNode):
    __slots__ = ()


class LessThanEqual(CSTNode):
    __slots__ = ()


class GreaterThan(CSTNode):
    __slots__ = ()


class GreaterThanEqual(CSTNode):
    __slots__ = ()


class In(CSTNode):
    __slots__ = ()


class NotIn(CSTNode):
    __slots__ = ()


class Is(CSTNode):
    __slots__ = ()


class IsNot(CSTNode):
    __slots__ = ()


_OPERATORS = {
    ast.Add: Add,
    ast.Sub: Subtract,
    ast.Mult: Multiply,
    ast.Div: Divide,
    ast.FloorDiv: FloorDivide,
    ast.Mod: Modulo,
    ast.Pow: Power,
    ast.MatMult: MatrixMultiply,
    ast.LShift: LeftShift,
    ast.RShift: RightShift,
    ast.BitOr: BitOr,
    ast.BitAnd: BitAnd,
    ast.BitXor: BitXor,
}
_AUGMENTED = {
    ast.Add: AddAssign,
    ast.Sub: SubtractAssign,
    ast.Mult: MultiplyAssign,
    ast.Div: DivideAssign,
    ast.FloorDiv: FloorDivideAssign,
    ast.Mod: ModuloAssign,
    ast.Pow: PowerAssign,
    ast.MatMult: MatrixMultiplyAssign,
    ast.LShift: LeftShiftAssign,
    ast.RShift: RightShiftAssign,
    ast.BitOr: BitOrAssign,
    ast.BitAnd: BitAndAssign,
    ast.BitXor: BitXorAssign,
}
_UNARY = {
    ast.Not: Not,
    ast.USub: Minus,
    ast.UAdd: Plus,
    ast.Invert: BitInvert,
}
_BOOLEAN = {
    ast.And: And,
    ast.Or: Or,
}
_COMPARISONS = {
    ast.Eq: Equal,
    ast.NotEq: NotEqual,
    ast.Lt: LessThan,
    ast.LtE: LessThanEqual,
    ast.Gt: GreaterThan,
    ast.GtE: GreaterThanEqual,
    ast.In: In,
    ast.NotIn: NotIn,
    ast.Is: Is,
    ast.IsNot: IsNot,
}

SCOPES = (FunctionDef, ClassDef, Lambda)


def children(node):
    """The child nodes that carry meaning, in libcst's field order."""
    result = []
    for name in node._children:
        value = getattr(node, name)
        if value is None:
            continue
        if type(value) is list:
            result.extend(value)
        elif isinstance(value, CSTNode):
            result.append(value)
    return result


def source_lines(source) -> list:
    """The source's lines as UTF-8 bytes, split where Python splits them (not at form
    feeds or Unicode line separators): the columns of `ast` count their bytes."""
    data = (
        source.encode("utf-8", "surrogatepass") if isinstance(source, str) else source
    )
    return _LINE.findall(data)


def from_ast(tree: ast.Module, source, body=None):
    """The `Module` for `tree`, parsed from `source` (str); `body` replaces the tree's
    top-level statements (a subset of them, see slicing.py)."""
    lines = source_lines(source)
    converter = _Converter(lines)
    module = Module(converter.block(tree.body if body is None else body), lines)
    module.lineno, module.col_offset, module.end_lineno, module.end_col_offset = (
        1,
        0,
        1,
        0,
    )
    return module


def parse_expression(text: str):
    """An expression (a string annotation's text) in this module's shape; SyntaxError
    for anything else."""
    tree = ast.parse(text, mode="eval")
    return _Converter(source_lines(text)).expr(tree.body)


def segment(module, node) -> str:
    """The source text of `node` (without parentheses around it, as `ast` spans it)."""
    lines = module.source
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        data = lines[first][node.col_offset : node.end_col_offset]
    else:
        data = lines[first][node.col_offset :] + b"".join(lines[first + 1 : last])
        data += lines[last][: node.end_col_offset]
    return data.decode("utf-8", "replace")


def start(node) -> tuple:
    """(line, byte column) where a finding at `node` is reported: its span's start, or
    for a tuple or generator in its own parentheses, just inside them (as libcst has
    it)."""
    inside = getattr(node, "inside", None)
    return inside if inside is not None else (node.lineno, node.col_offset)


def character_column(module, line: int, column: int) -> int:
    """The character column of a UTF-8 byte column on a line (1-based)."""
    lines = module.source
    if not 1 <= line <= len(lines):
        return column
    prefix = lines[line - 1][:column]
    if prefix.isascii():
        return column
    return len(prefix.decode("utf-8", "replace"))


def _span(new, old):
    new.lineno = old.lineno
    new.col_offset = old.col_offset
    new.end_lineno = old.end_lineno
    new.end_col_offset = old.end_col_offset
    return new


def _between(new, first, last):
    new.lineno = first.lineno
    new.col_offset = first.col_offset
    new.end_lineno = last.end_lineno
    new.end_col_offset = last.end_col_offset
    return new


_AST_NAME = ast.Name
_TOKEN_START = re.compile(rb"[^\s\\]")
_DEF_NAME = re.compile(rb"(?:async\s+)?def\s+|class\s+")
_COMPOUND = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Match,
)
if hasattr(ast, "TryStar"):
    _COMPOUND += (ast.TryStar,)
_DECLARING = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


class _Converter:
    """ast -> libcst-shaped nodes, reading the source lines where ast says too little."""

    _expressions: dict = {}  # ast type -> the method converting it

    def __init__(self, lines):
        self.lines = lines

    def declarations(self, statements, found):
        """Append to `found` the imports, defs and classes among `statements` and in
        their compound statements' blocks (not inside defs and classes). Converting
        the body later converts them again (no table of them is kept: it would tie
        every node to the converter in a reference cycle)."""
        for stmt in statements:
            kind = type(stmt)
            if kind in _DECLARING:
                if kind is ast.Import or kind is ast.ImportFrom:
                    found.append(self.small(stmt))
                else:
                    found.append(self.compound(stmt))
            elif kind in _COMPOUND:
                for name in ("body", "orelse", "finalbody"):
                    self.declarations(getattr(stmt, name, None) or (), found)
                for handler in getattr(stmt, "handlers", None) or ():
                    self.declarations(handler.body, found)
                for case in getattr(stmt, "cases", None) or ():
                    self.declarations(case.body, found)

    # ------------------------------------------------------------ blocks

    def block(self, statements):
        result = []
        line = None
        for stmt in statements:
            if isinstance(stmt, _COMPOUND):
                result.append(self.compound(stmt))
                line = None
                continue
            small = self.small(stmt)
            if line is not None and line.end_lineno == stmt.lineno:
                line.body.append(small)
                line.end_lineno, line.end_col_offset = (
                    small.end_lineno,
                    small.end_col_offset,
                )
            else:
                line = _span(SimpleStatementLine([small]), small)
                result.append(line)
        return result

    def suite(self, statements):
        first = statements[0]
        text = self.lines[first.lineno - 1] if first.lineno <= len(self.lines) else b""
        if text[: first.col_offset].strip():
            body = [self.small(stmt) for stmt in statements]
            return _between(SimpleStatementSuite(body), body[0], body[-1])
        body = self.block(statements)
        return _between(IndentedBlock(body), body[0], body[-1])

    def orelse(self, statements, wrapper):
        if not statements:
            return None
        suite = self.suite(statements)
        return _span(wrapper(suite), suite)

    # ------------------------------------------------------------ statements

    def compound(self, node):
        return getattr(self, "stmt_" + type(node).__name__)(node)

    def stmt_If(self, node):
        orelse = None
        if node.orelse:
            first = node.orelse[0]
            if (
                len(node.orelse) == 1
                and type(first) is ast.If
                and self.lines[first.lineno - 1][first.col_offset :].startswith(b"elif")
            ):
                orelse = self.stmt_If(first)
            else:
                orelse = self.orelse(node.orelse, Else)
        return _span(If(self.expr(node.test), self.suite(node.body), orelse), node)

    def stmt_For(self, node, asynchronous=False):
        return _span(
            For(
                self.expr(node.target),
                self.expr(node.iter),
                self.suite(node.body),
                self.orelse(node.orelse, Else),
                asynchronous,
            ),
            node,
        )

    def stmt_AsyncFor(self, node):
        return self.stmt_For(node, True)

    def stmt_While(self, node):
        return _span(
            While(
                self.expr(node.test),
                self.suite(node.body),
                self.orelse(node.orelse, Else),
            ),
            node,
        )

    def stmt_With(self, node, asynchronous=False):
        items = []
        for item in node.items:
            value = self.expr(item.context_expr)
            asname = None
            if item.optional_vars is not None:
                target = self.expr(item.optional_vars)
                asname = _span(AsName(target), target)
            items.append(_span(WithItem(value, asname), value))
        return _span(With(items, self.suite(node.body), asynchronous), node)

    def stmt_AsyncWith(self, node):
        return self.stmt_With(node, True)

    def stmt_Try(self, node, kind=None, handler_kind=None):
        kind = kind or Try
        handler_kind = handler_kind or ExceptHandler
        handlers = []
        for handler in node.handlers:
            name = None
            if handler.name is not None:
                after = handler.type or handler
                name = self._name_after(handler.name, after.end_lineno, after.end_col_offset)
                if handler.type is None:
                    name = self._name_near(handler.name, handler)
                name = _span(AsName(name), name)
            handlers.append(
                _span(
                    handler_kind(
                        self.suite(handler.body),
                        self.expr(handler.type) if handler.type is not None else None,
                        name,
                    ),
                    handler,
                )
            )
        return _span(
            kind(
                self.suite(node.body),
                handlers,
                self.orelse(node.orelse, Else),
                self.orelse(node.finalbody, Finally),
            ),
            node,
        )

    def stmt_TryStar(self, node):
        return self.stmt_Try(node, TryStar, ExceptStarHandler)

    def _def_name(self, node):
        """The Name of a def or class, where the source has it (after `def `)."""
        text = self.lines[node.lineno - 1] if node.lineno <= len(self.lines) else b""
        found = _DEF_NAME.match(text, node.col_offset)
        name = Name(node.name)
        column = found.end() if found else node.col_offset
        name.lineno = name.end_lineno = node.lineno
        name.col_offset = column
        name.end_col_offset = column + len(node.name.encode("utf-8"))
        return name

    def stmt_FunctionDef(self, node, asynchronous=False):
        returns = None
        if node.returns is not None:
            value = self.expr(node.returns)
            returns = _span(Annotation(value), value)
        return _span(
            FunctionDef(
                self._def_name(node),
                self.parameters(node.args, node),
                None,  # the body: converted when first read
                self.decorators(node.decorator_list),
                returns,
                asynchronous,
                (self, node),
            ),
            node,
        )

    def stmt_AsyncFunctionDef(self, node):
        return self.stmt_FunctionDef(node, True)

    def stmt_ClassDef(self, node):
        bases = [self.arg(base) for base in node.bases]
        keywords = [self.keyword(keyword) for keyword in node.keywords]
        return _span(
            ClassDef(
                self._def_name(node),
                self.suite(node.body),
                bases,
                keywords,
                self.decorators(node.decorator_list),
            ),
            node,
        )

    def stmt_Match(self, node):
        cases = []
        for case in node.cases:
            pattern = self.pattern(case.pattern)
            guard = self.expr(case.guard) if case.guard is not None else None
            cases.append(
                _span(MatchCase(pattern, self.suite(case.body), guard), case.pattern)
            )
        return _span(Match(self.expr(node.subject), cases), node)

    def decorators(self, decorators):
        result = []
        for decorator in decorators:
            value = self.expr(decorator)
            result.append(_span(Decorator(value), value))
        return result

    def small(self, node):
        kind = type(node)
        if kind is ast.Expr:
            new = Expr(self.expr(node.value))
        elif kind is ast.Assign:
            targets = []
            for target in node.targets:
                value = self.expr(target)
                targets.append(_span(AssignTarget(value), value))
            new = Assign(targets, self.expr(node.value))
        elif kind is ast.AnnAssign:
            annotation = self.expr(node.annotation)
            new = AnnAssign(
                self.expr(node.target),
                _span(Annotation(annotation), annotation),
                self.expr(node.value) if node.value is not None else None,
            )
        elif kind is ast.AugAssign:
            new = AugAssign(
                self.expr(node.target),
                _AUGMENTED[type(node.op)](),
                self.expr(node.value),
            )
        elif kind is ast.Return:
            new = Return(self.optional(node.value))
        elif kind is ast.Delete:
            targets = [self.expr(target) for target in node.targets]
            if len(targets) == 1:
                target = targets[0]
            else:
                target = _between(
                    Tuple([_span(Element(t), t) for t in targets]),
                    targets[0],
                    targets[-1],
                )
            new = Del(target)
        elif kind is ast.Pass:
            new = Pass()
        elif kind is ast.Break:
            new = Break()
        elif kind is ast.Continue:
            new = Continue()
        elif kind is ast.Raise:
            cause = None
            if node.cause is not None:
                value = self.expr(node.cause)
                cause = _span(From(value), value)
            new = Raise(self.optional(node.exc), cause)
        elif kind is ast.Assert:
            new = Assert(self.expr(node.test), self.optional(node.msg))
        elif kind in (ast.Global, ast.Nonlocal):
            names = []
            column = node.col_offset
            for text in node.names:
                name = self._name_after(text, node.lineno, column)
                column = name.end_col_offset
                names.append(_span(NameItem(name), name))
            new = (Global if kind is ast.Global else Nonlocal)(names)
        elif kind is ast.Import:
            new = Import([self.alias(alias) for alias in node.names])
        elif kind is ast.ImportFrom:
            module = None
            if node.module:
                first = node.module.partition(".")[0]
                module = self._dotted(
                    node.module, self._name_after(first, node.lineno, node.col_offset + 4)
                )
            if len(node.names) == 1 and node.names[0].name == "*":
                names = _span(ImportStar(), node)
            else:
                names = [self.alias(alias) for alias in node.names]
            new = ImportFrom(module, names, (".",) * (node.level or 0))
        elif kind.__name__ == "TypeAlias":
            new = TypeAlias(self.expr(node.name), self.expr(node.value))
        else:  # newer than this code: keep its expressions for the walk
            new = Expr(None)
        return _span(new, node)

    def alias(self, alias):
        position = alias if hasattr(alias, "lineno") else None
        name = self._dotted(alias.name, position)
        asname = None
        if alias.asname is not None:
            target = self._name_near(alias.asname, position)
            if position is not None:
                target.lineno = alias.end_lineno
                target.col_offset = alias.end_col_offset - len(alias.asname.encode("utf-8"))
            asname = _span(AsName(target), target)
        return _span(ImportAlias(name, asname), name)

    def _name_near(self, text, where):
        name = Name(text)
        if where is None or not hasattr(where, "lineno"):
            name.lineno = name.end_lineno = 1
            name.col_offset = name.end_col_offset = 0
            return name
        return _span(name, where)

    def _name_after(self, text, line, column):
        """A Name for the identifier `text` where it first stands on `line` after
        `column` (the source holds it; ast keeps only the string)."""
        name = Name(text)
        data = self.lines[line - 1] if 1 <= line <= len(self.lines) else b""
        word = re.compile(rb"\b" + re.escape(text.encode("utf-8")) + rb"\b")
        found = word.search(data, column)
        start = found.start() if found else column
        name.lineno = name.end_lineno = line
        name.col_offset = start
        name.end_col_offset = start + len(text.encode("utf-8"))
        return name

    def _name_before(self, text, line, column):
        """A Name for the identifier `text` where it last stands on `line` before
        `column` (a keyword pattern's `key=`)."""
        data = self.lines[line - 1][:column] if 1 <= line <= len(self.lines) else b""
        start = data.rfind(text.encode("utf-8"))
        return self._name_after(text, line, max(start, 0))

    def _dotted(self, text, where):
        parts = text.split(".")
        node = self._name_near(parts[0], where)
        for part in parts[1:]:
            node = _span(Attribute(node, self._name_near(part, where)), node)
        return node

    # ------------------------------------------------------------ expressions

    def optional(self, node):
        return None if node is None else self.expr(node)

    def expr(self, node):
        kind = type(node)
        if kind is _AST_NAME:  # a third of all nodes: no dispatch
            new = Name(node.id)
        else:
            convert = self._expressions.get(kind)
            if convert is None:
                convert = getattr(type(self), "expr_" + kind.__name__)
                self._expressions[kind] = convert
            new = convert(self, node)
        new.lineno = node.lineno
        new.col_offset = node.col_offset
        new.end_lineno = node.end_lineno
        new.end_col_offset = node.end_col_offset
        if (kind is ast.Tuple or kind is ast.GeneratorExp) and self._opens_with_paren(node):
            # ast spans a tuple's or generator's own parentheses, as its source text
            # does; libcst's position, and so a finding's, is inside them.
            new.inside = self._after_paren(node.lineno, node.col_offset + 1)
        return new

    def _opens_with_paren(self, node):
        if node.lineno > len(self.lines):
            return False
        if self.lines[node.lineno - 1][node.col_offset : node.col_offset + 1] != b"(":
            return False
        if type(node) is ast.GeneratorExp:
            first = node.elt
            generator = node.generators[-1]
            last = generator.ifs[-1] if generator.ifs else generator.iter
        elif node.elts:
            first, last = node.elts[0], node.elts[-1]
        else:
            return True  # (): libcst starts at the ")"
        # `(a), b` starts with a parenthesized element, not with the tuple's own "(".
        return (first.lineno, first.col_offset) != (node.lineno, node.col_offset) and (
            last.end_lineno,
            last.end_col_offset,
        ) != (node.end_lineno, node.end_col_offset)

    def _after_paren(self, line, column):
        """The first token at or after (line, column): blanks, line continuations
        and comments skipped."""
        while line <= len(self.lines):
            data = self.lines[line - 1]
            found = _TOKEN_START.search(data, column)
            if found is not None and data[found.start() : found.start() + 1] != b"#":
                return line, found.start()
            line, column = line + 1, 0
        return line, column

    def expr_Name(self, node):
        return Name(node.id)

    def expr_Constant(self, node):
        value = node.value
        if value is None or value is True or value is False:
            return Name(str(value))
        if value is ...:
            return Ellipsis()
        if isinstance(value, (str, bytes)):
            return SimpleString(None, value)
        kind = (
            Integer
            if isinstance(value, int)
            else Float
            if isinstance(value, float)
            else Imaginary
        )
        if node.lineno == node.end_lineno and node.lineno <= len(self.lines):
            raw = self.lines[node.lineno - 1][node.col_offset : node.end_col_offset]
            return kind(raw.decode("ascii", "replace"))
        return kind(repr(value))

    def expr_JoinedStr(self, node):
        parts = []
        for value in node.values:
            if type(value) is ast.FormattedValue:
                spec = None
                if value.format_spec is not None:
                    spec = self.expr(value.format_spec).parts
                part = FormattedStringExpression(
                    self.expr(value.value), value.conversion, spec
                )
                parts.append(_span(part, value))
            else:
                parts.append(_span(FormattedStringText(value.value), value))
        return FormattedString(parts)

    def expr_Attribute(self, node):
        attr = Name(node.attr)
        attr.lineno = attr.end_lineno = node.end_lineno
        attr.end_col_offset = node.end_col_offset
        attr.col_offset = node.end_col_offset - len(node.attr.encode("utf-8"))
        return Attribute(self.expr(node.value), attr)

    def arg(self, node):
        if type(node) is ast.Starred:
            value = self.expr(node.value)
            return _span(Arg(value, None, "*"), node)
        value = self.expr(node)
        return _span(Arg(value, None, ""), value)

    def keyword(self, node):
        value = self.expr(node.value)
        if node.arg is None:
            return _span(Arg(value, None, "**"), node)
        keyword = _span(Name(node.arg), node)
        keyword.end_lineno = keyword.lineno
        keyword.end_col_offset = keyword.col_offset + len(node.arg.encode("utf-8"))
        return _span(Arg(value, keyword, ""), node)

    def expr_Call(self, node):
        args = [self.arg(arg) for arg in node.args]
        if node.keywords:
            keywords = [self.keyword(keyword) for keyword in node.keywords]
            if args and _before(keywords[0], args[-1]):
                args = sorted(args + keywords, key=_start)
            else:
                args.extend(keywords)
        return Call(self.expr(node.func), args)

    def expr_Subscript(self, node):
        index = node.slice
        if type(index) is ast.Tuple and index.elts and not self._parenthesized(index):
            parts = index.elts
        else:
            parts = [index]
        elements = []
        for part in parts:
            kind = type(part)
            if kind is ast.Slice:
                inner = _span(
                    Slice(
                        self.optional(part.lower),
                        self.optional(part.upper),
                        self.optional(part.step),
                    ),
                    part,
                )
            elif kind is ast.Starred:
                inner = _span(Index(self.expr(part.value), "*"), part)
            else:
                inner = _span(Index(self.expr(part), None), part)
            elements.append(_span(SubscriptElement(inner), part))
        return Subscript(self.expr(node.value), elements)

    def _parenthesized(self, node):
        first = node.elts[0]
        if (first.lineno, first.col_offset) == (node.lineno, node.col_offset):
            return False
        return (
            self.lines[node.lineno - 1][node.col_offset : node.col_offset + 1] == b"("
        )

    def expr_Slice(self, node):
        return Slice(
            self.optional(node.lower),
            self.optional(node.upper),
            self.optional(node.step),
        )

    def elements(self, nodes):
        result = []
        for node in nodes:
            if type(node) is ast.Starred:
                result.append(_span(StarredElement(self.expr(node.value)), node))
            else:
                value = self.expr(node)
                result.append(_span(Element(value), value))
        return result

    def expr_Tuple(self, node):
        return Tuple(self.elements(node.elts))

    def expr_List(self, node):
        return List(self.elements(node.elts))

    def expr_Set(self, node):
        return Set(self.elements(node.elts))

    def expr_Starred(self, node):
        return StarredElement(self.expr(node.value))

    def expr_Dict(self, node):
        elements = []
        for key, value in zip(node.keys, node.values):
            converted = self.expr(value)
            if key is None:
                elements.append(_span(StarredDictElement(converted), converted))
            else:
                key = self.expr(key)
                elements.append(_between(DictElement(key, converted), key, converted))
        return Dict(elements)

    def for_in(self, generators):
        inner = None
        for generator in reversed(generators):
            target = self.expr(generator.target)
            ifs = []
            for test in generator.ifs:
                converted = self.expr(test)
                ifs.append(_span(CompIf(converted), converted))
            inner = _between(
                CompFor(
                    target,
                    self.expr(generator.iter),
                    ifs,
                    inner,
                    bool(generator.is_async),
                ),
                target,
                generator.iter,
            )
        return inner

    def expr_ListComp(self, node):
        return ListComp(self.expr(node.elt), self.for_in(node.generators))

    def expr_SetComp(self, node):
        return SetComp(self.expr(node.elt), self.for_in(node.generators))

    def expr_GeneratorExp(self, node):
        return GeneratorExp(self.expr(node.elt), self.for_in(node.generators))

    def expr_DictComp(self, node):
        return DictComp(
            self.expr(node.key), self.expr(node.value), self.for_in(node.generators)
        )

    def expr_Compare(self, node):
        targets = []
        for operator, comparator in zip(node.ops, node.comparators):
            converted = self.expr(comparator)
            targets.append(
                _span(
                    ComparisonTarget(_COMPARISONS[type(operator)](), converted),
                    converted,
                )
            )
        return Comparison(self.expr(node.left), targets)

    def expr_BoolOp(self, node):
        operator = _BOOLEAN[type(node.op)]
        values = node.values
        left = self.expr(values[0])
        for value in values[1:-1]:
            right = self.expr(value)
            left = _between(BooleanOperation(left, operator(), right), left, right)
        return BooleanOperation(left, operator(), self.expr(values[-1]))

    def expr_BinOp(self, node):
        return BinaryOperation(
            self.expr(node.left), _OPERATORS[type(node.op)](), self.expr(node.right)
        )

    def expr_UnaryOp(self, node):
        return UnaryOperation(_UNARY[type(node.op)](), self.expr(node.operand))

    def expr_IfExp(self, node):
        return IfExp(self.expr(node.test), self.expr(node.body), self.expr(node.orelse))

    def expr_Lambda(self, node):
        return Lambda(self.parameters(node.args, node), self.expr(node.body))

    def expr_NamedExpr(self, node):
        return NamedExpr(self.expr(node.target), self.expr(node.value))

    def expr_Await(self, node):
        return Await(self.expr(node.value))

    def expr_Yield(self, node):
        return Yield(self.optional(node.value))

    def expr_YieldFrom(self, node):
        value = self.expr(node.value)
        return Yield(_span(From(value), value))

    def expr_FormattedValue(self, node):
        return FormattedString(
            [
                _span(
                    FormattedStringExpression(
                        self.expr(node.value), node.conversion, None
                    ),
                    node,
                )
            ]
        )

    # ------------------------------------------------------------ parameters

    def param(self, arg, default, star=""):
        name = _span(Name(arg.arg), arg)
        name.end_lineno = name.lineno
        name.end_col_offset = name.col_offset + len(arg.arg.encode("utf-8"))
        annotation = None
        if arg.annotation is not None:
            value = self.expr(arg.annotation)
            annotation = _span(Annotation(value), value)
        return _span(Param(name, annotation, self.optional(default), star), arg)

    def parameters(self, args, owner):
        positional = args.posonlyargs + args.args
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        converted = [
            self.param(arg, default) for arg, default in zip(positional, defaults)
        ]
        posonly = converted[: len(args.posonlyargs)]
        params = converted[len(args.posonlyargs) :]
        star_arg = None
        if args.vararg is not None:
            star_arg = self.param(args.vararg, None, "*")
        elif args.kwonlyargs:
            star_arg = _span(ParamStar(), args.kwonlyargs[0])
        kwonly = [
            self.param(arg, default)
            for arg, default in zip(args.kwonlyargs, args.kw_defaults)
        ]
        star_kwarg = (
            self.param(args.kwarg, None, "**") if args.kwarg is not None else None
        )
        result = Parameters(params, star_arg, kwonly, star_kwarg, posonly)
        return _span(result, owner)

    # ------------------------------------------------------------ patterns

    def pattern(self, node):
        kind = type(node)
        if kind is ast.MatchValue:
            new = MatchValue(self.expr(node.value))
        elif kind is ast.MatchSingleton:
            new = MatchSingleton(_span(Name(str(node.value)), node))
        elif kind is ast.MatchSequence:
            new = MatchList([self._sequence_element(p) for p in node.patterns])
        elif kind is ast.MatchStar:
            new = MatchStar(
                self._name_after(node.name, node.lineno, node.col_offset + 1) if node.name else None
            )
        elif kind is ast.MatchMapping:
            elements = [
                _span(
                    MatchMappingElement(self.expr(key), self.pattern(pattern)), pattern
                )
                for key, pattern in zip(node.keys, node.patterns)
            ]
            rest = None
            if node.rest:
                after = node.patterns[-1] if node.patterns else node
                line = after.end_lineno if node.patterns else node.lineno
                column = after.end_col_offset if node.patterns else node.col_offset
                rest = self._name_after(node.rest, line, column)
            new = MatchMapping(elements, rest)
        elif kind is ast.MatchClass:
            patterns = [self._sequence_element(p) for p in node.patterns]
            kwds = [
                _span(
                    MatchKeywordElement(
                        self._name_before(key, pattern.lineno, pattern.col_offset),
                        self.pattern(pattern),
                    ),
                    pattern,
                )
                for key, pattern in zip(node.kwd_attrs, node.kwd_patterns)
            ]
            new = MatchClass(self.expr(node.cls), patterns, kwds)
        elif kind is ast.MatchAs:
            name = None
            if node.name and node.pattern is not None:
                end = node.pattern
                name = self._name_after(node.name, end.end_lineno, end.end_col_offset)
            elif node.name:
                name = self._name_near(node.name, node)
            new = MatchAs(self.pattern(node.pattern) if node.pattern is not None else None, name)
        elif kind is ast.MatchOr:
            new = MatchOr(
                [_span(MatchOrElement(self.pattern(p)), p) for p in node.patterns]
            )
        else:
            new = MatchValue(None)
        return _span(new, node)

    def _sequence_element(self, node):
        pattern = self.pattern(node)
        if type(node) is ast.MatchStar:
            return pattern
        return _span(MatchSequenceElement(pattern), node)


def _start(node):
    return (node.lineno, node.col_offset)


def _before(first, second):
    return (first.lineno, first.col_offset) < (second.lineno, second.col_offset)
