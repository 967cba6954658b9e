"""Code newer than the running Python: libcst parses it, and its tree is copied into
the analysis's nodes.

Detection reads the standard library's `ast` (nodes.py), which knows only the syntax
of the Python it runs on: on 3.11, `type Ids = list[int]`, `def f[T](...)` and nested
f-string quotes are syntax errors. flake8 reports such a file as E999 and never asks
its plugins; `kvguard lint` gives it to libcst, whose grammar is newer, and copies the
tree field by field into the classes of nodes.py (they carry libcst's names), so the
rules see what they would on a newer Python. libcst is imported only for such a file.
"""

from __future__ import annotations

from . import nodes


def parse(text: str):
    """The nodes.Module for `text`, or None when libcst cannot parse it either."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider

    try:
        tree = cst.parse_module(text)
    except Exception:  # noqa: BLE001 - libcst's native parser reports some inputs oddly
        return None
    wrapper = MetadataWrapper(tree, unsafe_skip_copy=True)
    ranges = wrapper.resolve(PositionProvider)
    lines = nodes.source_lines(text)
    copier = _Copier(cst, ranges, [line.decode("utf-8", "surrogatepass") for line in lines])
    module = nodes.Module(copier.copy_list(tree.body), lines)
    module.lineno, module.col_offset, module.end_lineno, module.end_col_offset = 1, 0, 1, 0
    return module


class _Copier:
    def __init__(self, cst, ranges, lines):
        self.cst = cst
        self.ranges = ranges
        self.lines = lines

    def _byte_column(self, line, column):
        if 1 <= line <= len(self.lines):
            return len(self.lines[line - 1][:column].encode("utf-8", "surrogatepass"))
        return column

    def copy_list(self, values):
        result = []
        for value in values:
            copied = self.copy(value)
            if copied is not None:
                result.append(copied)
        return result

    def copy(self, node):
        cls = getattr(nodes, type(node).__name__, None)
        if cls is None or not isinstance(cls, type) or not issubclass(cls, nodes.CSTNode):
            return None
        new = cls()
        for field in cls._fields:
            setattr(new, field, self.value(node, field))
        where = self.ranges.get(node)
        if where is not None:
            new.lineno, new.end_lineno = where.start.line, where.end.line
            new.col_offset = self._byte_column(where.start.line, where.start.column)
            new.end_col_offset = self._byte_column(where.end.line, where.end.column)
        else:
            new.lineno, new.col_offset, new.end_lineno, new.end_col_offset = 1, 0, 1, 0
        return new

    def value(self, node, field):
        cst = self.cst
        if field == "evaluated_value":
            return node.evaluated_value
        if field == "asynchronous":
            return getattr(node, field, None) is not None
        if field == "relative":
            return tuple("." for _ in node.relative)
        value = getattr(node, field, None)
        if isinstance(value, cst.CSTNode):
            return self.copy(value)
        if isinstance(value, (list, tuple)):
            return self.copy_list(value)
        if isinstance(value, cst.MaybeSentinel):
            return None
        if field == "star" and type(node) is cst.Arg:
            return value or ""
        return value
