"""A cheap scan that keeps input too deep to analyze safely away from the checker.

The analysis reads Python's own `ast` (nodes.py), converted and walked by Python code
that recurses a few frames per nesting level, and `--fix` (and syntax newer than the
running Python) goes through libcst, which does not survive deep input at all:

libcst's native parser builds a node per operator, call, attribute and bracket, and
nests them: `a and a and ...` of 20,000 operands is 20,000 levels deep. Its parser
overflows its stack and kills the whole process (SIGSEGV, no output, and flake8's
worker pool then waits forever) on such valid Python, and on deeply nested invalid
input (3,000 parentheses, 5,000 nested lambdas); chains of a few thousand unary
operators or calls take it minutes (its cost grows with the square of the depth).

`too_deep(text)` estimates, without parsing, how deep the expression tree of each
statement gets: the bracket depth plus, at every open bracket level, the operators,
`lambda`/`not`/`await`/conditional keywords and call/attribute/subscript trailers
chained since the last comma. Flat data (a list of 10,000 negative numbers) stays
shallow. The estimate only over-counts, never under-counts: neither the conversion
nor libcst ever sees a statement deeper than the limit, and real code stays far below it (the deepest
statement in DeepSpeed, vLLM, SGLang, lmdeploy and aphrodite-engine scores under 60).
"""

from __future__ import annotations

import itertools
import re

# Estimated depth of one statement beyond which a file is not parsed. libcst parses
# 200 chained calls in well under a second; 20,000 kill it.
MAX_DEPTH = 200

_TOKENS = re.compile(
    # Strings first, from their opening quote (a prefix is an identifier before it),
    # written as unrolled loops: `(?:[^"]|...)*` would step through a docstring one
    # character at a time.
    r'''(?P<string>"""[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*(?:"""|\Z)'''
    r"""|'''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*(?:'''|\Z)"""
    r'''|"[^"\\\n]*(?:\\.[^"\\\n]*)*"?|'[^'\\\n]*(?:\\.[^'\\\n]*)*'?)'''
    r"|(?P<comment>\#[^\n]*)"
    r"|(?P<continuation>\\\n)"
    r"|(?P<newline>\n)"
    r"|(?P<open>[(\[{])"
    r"|(?P<close>[)\]}])"
    r"|(?P<comma>[,;])"
    r"|(?P<op>\*\*|//|<<|>>|->|[-+*/%@&|^~.])"
    r"|(?P<word>(?<![\w.])(?:and|or|not|lambda|await|if|else)\b)",
    re.S,
)
_OPERAND_END = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_)]}\"'")


def too_deep(text: str, limit: int = MAX_DEPTH, tree=None):
    """None when every statement is shallow enough to parse safely, else (the line the
    first too deep statement starts on, why).

    With the file's `ast` tree, the same answer, usually without the scan: a
    statement's estimate never exceeds twice its brackets plus its operators and
    keywords (each raises it by at most one, a bracket by two with its trailer), so
    statements whose text holds too few of them to reach the limit need no scan; only
    when one does is the whole text scanned as above."""
    if tree is not None and "\r" not in text and not _may_be_too_deep(text, tree, limit):
        return None  # ("\r" alone ends no statement for the scan: scan those files)
    counters = [0]  # chain length since the last comma, per open bracket level
    total = 0  # sum(counters): the estimated depth of the current expression
    line = statement = 1
    for match in _TOKENS.finditer(text):
        kind = match.lastgroup
        if kind == "newline":
            line += 1
            if len(counters) == 1:
                total = counters[0] = 0
                statement = line
            continue
        if kind == "string":
            line += match.group().count("\n")
            continue
        if kind == "comment":
            continue
        if kind == "continuation":
            line += 1
            continue
        if kind == "open":
            start = match.start()
            before = text[start - 1] if start else " "
            if before in _OPERAND_END:  # a call or subscript trailer on what precedes
                counters[-1] += 1
                total += 1
            counters.append(0)
            total += 1
            if len(counters) > limit:
                return statement, f"brackets nested more than {limit - 1} deep"
            if total > limit:
                return statement, f"an expression nested more than {limit} deep"
            continue
        if kind == "close":
            if len(counters) > 1:
                total -= counters.pop() + 1
            continue
        if kind == "comma":
            total -= counters[-1]
            counters[-1] = 0
            continue
        if kind == "op" and match.group() == "->":
            continue
        counters[-1] += 1
        total += 1
        if total > limit:
            return statement, f"an expression nested more than {limit} deep"
    return None


_WORDS = re.compile(r"\b(?:and|or|not|lambda|await|if|else)\b")
_RAISING = "-+*/%@&|^~."
_WHOLE = 3_000  # characters: up to this, a compound statement is counted whole first
_ENDED_LINES = re.compile(r"[^\r\n]*(?:\r\n?|\n)")  # each line up to its break


def _bound(segment: str) -> int:
    """More than the scan can count in `segment`: every bracket twice, every operator
    character and keyword once, inside strings and comments too."""
    count = 2 * (segment.count("(") + segment.count("[") + segment.count("{"))
    for char in _RAISING:
        count += segment.count(char)
    return count + len(_WORDS.findall(segment))


def _may_be_too_deep(text: str, tree, limit: int) -> bool:
    """Whether some statement's text (a simple statement, or a compound statement's
    header with its decorators) holds enough to reach `limit` (then scan)."""
    # Where each line starts (the end of each line break), then the end of the text.
    starts = list(itertools.accumulate(map(len, _ENDED_LINES.findall(text)), initial=0))
    starts.append(len(text))
    last_line = len(starts) - 1

    def segment(first, last):
        first = min(max(first, 1), last_line)
        last = min(max(last, first), last_line)
        return text[starts[first - 1] : starts[last]]

    pending = [getattr(tree, "body", None) or []]
    while pending:
        for stmt in pending.pop():
            blocks = [
                getattr(stmt, name, None) or [] for name in ("body", "orelse", "finalbody")
            ]
            blocks = [block for block in blocks if isinstance(block, list)]
            for handler in getattr(stmt, "handlers", None) or []:
                blocks.append(handler.body)
            for case in getattr(stmt, "cases", None) or []:
                blocks.append(case.body)
            first_line = min(max(stmt.lineno, 1), last_line)
            last_line_of = min(max(stmt.end_lineno or stmt.lineno, first_line), last_line)
            size = starts[last_line_of] - starts[first_line - 1]
            # A big compound statement's own text is not counted: its header and the
            # statements of its blocks are, one by one below (counting the whole of a
            # class and then of each of its methods again would read the file once per
            # nesting level).
            if size * 2 <= limit or (
                (not blocks or size <= _WHOLE)
                and _bound(segment(stmt.lineno, stmt.end_lineno or stmt.lineno)) <= limit
            ):
                if not getattr(stmt, "decorator_list", None):
                    continue  # nothing in it can reach the limit
            first = stmt.lineno
            for decorator in getattr(stmt, "decorator_list", None) or []:
                first = min(first, decorator.lineno)
            inner = [block[0].lineno for block in blocks if block]
            if not inner:  # a simple statement
                last = stmt.end_lineno or stmt.lineno
            else:  # a header: up to its first body (elif/except/case headers come below)
                last = max(stmt.lineno, min(inner) - 1)
                for handler in getattr(stmt, "handlers", None) or []:
                    if len(segment(handler.lineno, handler.body[0].lineno)) * 2 > limit:
                        if _bound(segment(handler.lineno, handler.body[0].lineno)) > limit:
                            return True
                for case in getattr(stmt, "cases", None) or []:
                    where = case.pattern.lineno
                    if _bound(segment(where, max(where, case.body[0].lineno))) > limit:
                        return True
                pending.extend(blocks)
            text_of = segment(first, last)
            if len(text_of) * 2 > limit and _bound(text_of) > limit:
                return True
    return False

