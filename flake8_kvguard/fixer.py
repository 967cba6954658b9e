"""`kvguard lint --fix`: behaviour-preserving rewrites, through libcst.

Only three rewrites exist, each offered by a rule only where it can tell the value
is what the rewrite needs (a definite tensor, never an Optional one, a builtin `int`
not shadowed): KVG101 `ids` -> `ids.tolist()`, KVG105 `set(t)` -> `set(t.tolist())`,
KVG106 `t[i]` -> `int(t[i])`. The analysis reads `ast` (nodes.py) and says a fix as a
node and a `rewrites.Rewrite`; this module, the only one that imports libcst, parses
the file with it, finds those nodes again by their spans and rewrites them there, so
every comment, blank line and the file's encoding and newlines are kept. Fixes that
nest are applied over several rounds, and a round that finds nothing to fix ends the
loop, so a second `--fix` changes nothing. A fixed line keeps its trailing comment where it was,
and in line with the comments beside it (`align_comments`).
"""

from __future__ import annotations

import io
import tokenize

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from . import engine, nodes
from .rewrites import BUILTIN, METHOD

MAX_ROUNDS = 5


class _Replace(cst.CSTTransformer):
    def __init__(self, replacements: dict):
        super().__init__()
        self.replacements = replacements  # id(original node) -> new node

    def on_leave(self, original_node, updated_node):
        replacement = self.replacements.get(id(original_node))
        if replacement is not None:
            return replacement
        return updated_node


def _span(module, node):
    """(start line, start column, end line, end column) in characters, as libcst
    counts them."""
    return (
        node.lineno,
        nodes.character_column(module, node.lineno, node.col_offset),
        node.end_lineno,
        nodes.character_column(module, node.end_lineno, node.end_col_offset),
    )


def _outermost(module, fixes):
    """Fixes whose node is not inside another fix's node (the rest wait a round)."""
    spans = [(_span(module, old), old, rewrite) for old, rewrite in fixes]
    chosen, seen = [], set()
    for span, old, rewrite in spans:
        start, end = span[:2], span[2:]
        inside = any(
            other != span and other[:2] <= start and end <= other[2:] for other, _, _ in spans
        )
        if inside or span in seen:
            continue
        seen.add(span)
        chosen.append((span, old, rewrite))
    return chosen


def _expressions_by_span(tree):
    """{span: the outermost libcst expression with that span}."""
    wrapper = MetadataWrapper(tree, unsafe_skip_copy=True)
    ranges = wrapper.resolve(PositionProvider)
    found = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.BaseExpression):
            where = ranges.get(node)
            if where is not None:
                span = (where.start.line, where.start.column, where.end.line, where.end.column)
                found.setdefault(span, node)
        stack.extend(reversed(node.children))
    return found


def _is_atomic(node) -> bool:
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


def _build(rewrite, subject):
    if rewrite.kind == METHOD:
        if not _is_atomic(subject):
            subject = subject.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return cst.Call(func=cst.Attribute(value=subject, attr=cst.Name(rewrite.name)))
    if rewrite.kind == BUILTIN:
        return cst.Call(func=cst.Name(rewrite.name), args=[cst.Arg(value=subject)])
    raise ValueError(f"unknown rewrite {rewrite!r}")


def _trailing_comments(text: str) -> dict | None:
    """{line number: column} of each comment that follows code on its line; None when the
    text does not tokenize or holds a tab before a comment (columns would not line up)."""
    found = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                before = tok.line[: tok.start[1]]
                if "\t" in before:
                    return None
                if before.strip():
                    found[tok.start[0]] = tok.start[1]
    except (tokenize.TokenError, SyntaxError, ValueError):
        return None
    return found


def align_comments(old: bytes, new: bytes) -> bytes:
    """``new`` (``old`` with expressions rewritten on the same lines) with each trailing
    comment a rewrite moved put back in line: at its old column where the longer code leaves
    room (two spaces at least), else the comments aligned with it on the lines around it move
    together to the first column that fits them all."""
    encoding = tokenize.detect_encoding(io.BytesIO(old).readline)[0]
    try:
        old_text, new_text = old.decode(encoding), new.decode(encoding)
    except (UnicodeDecodeError, LookupError):
        return new
    before, after = _trailing_comments(old_text), _trailing_comments(new_text)
    lines = new_text.splitlines(keepends=True)
    if before is None or after is None or len(lines) != len(old_text.splitlines()):
        return new
    moved = [n for n, col in after.items() if before.get(n) not in (None, col)]
    done: set = set()
    for n in moved:
        if n in done:
            continue
        col = before[n]
        group = [n]  # the lines around it whose comments sat in the same column
        for step in (-1, 1):
            m = n + step
            while before.get(m) == col and m in after:
                group.append(m)
                m += step
        target = max([col] + [len(lines[m - 1][: after[m]].rstrip()) + 2 for m in group])
        for m in group:
            line = lines[m - 1]
            code, comment = line[: after[m]].rstrip(), line[after[m]:]
            lines[m - 1] = code + " " * (target - len(code)) + comment
        done.update(group)
    return "".join(lines).encode(encoding)


def fix_source(source: bytes, config, index, select=None):
    """(new source, number of fixes) for one file's bytes."""
    original = source
    applied = 0
    for _ in range(MAX_ROUNDS):
        module = engine.parse(source)
        if module is None:
            break
        findings = engine.analyze(module, config, index)
        mapping = engine.noqa_lines(module.code)
        fixes = [
            finding.fix
            for finding in findings
            if finding.fix is not None
            and engine.selected(finding.code, select)
            and not engine.suppressed(finding, mapping)
        ]
        if not fixes:
            break
        chosen = _outermost(module, fixes)
        with engine.deep_recursion():
            try:
                tree = cst.parse_module(source)
            except Exception:  # noqa: BLE001 - what Python parses, libcst may not
                break
            found = _expressions_by_span(tree)
            replacements = {}
            for span, _, rewrite in chosen:
                old = found.get(span)
                subject = found.get(_span(module, rewrite.subject))
                if old is not None and subject is not None:
                    replacements[id(old)] = _build(rewrite, subject)
            if not replacements:
                break
            new_source = tree.visit(_Replace(replacements)).bytes
        if new_source == source:
            break
        source = new_source
        applied += len(replacements)
    if applied:
        source = align_comments(original, source)
    return source, applied
