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
import operator
import re

# Estimated depth of one statement beyond which a file is not parsed. libcst parses
# 200 chained calls in well under a second; 20,000 kill it.
MAX_DEPTH = 200

_TOKENS = (
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
    r"|(?P<word>(?<![\w.])(?:and|or|not|lambda|await|if|else)\b)"
)  # compiled (re.S) by the scan, which a file whose tree shows it shallow never needs
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
    for match in re.finditer(_TOKENS, text, re.S):
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


_WORDS = r"\b(?:and|or|not|lambda|await|if|else)\b"  # compiled where used
_RAISING = "-+*/%@&|^~."
# The keywords, also at the end of a longer name ("band"): counting more is safe, and a
# pattern that does not start with \b is searched twice as fast.
_WORD_ENDS = re.compile(r"(?:and|or|not|lambda|await|if|else)\b")
_WORD_MARK = "\x01"  # a keyword, once replaced
# bytes.translate deletes all but the characters a line's count is made of (a newline
# ends each line's run): at memory speed, where a substitution of the rest ran at 30 MB/s.
_NOT_COUNTED = bytes(set(range(256)) - set(b"-+*/%@&|^~.([{\n\x01"))
_NOT_OPENING = bytes(set(range(256)) - set(b"([{\n"))


def _bound(segment: str) -> int:
    """More than the scan can count in `segment`: every bracket twice, every operator
    character and keyword once, inside strings and comments too."""
    count = 2 * (segment.count("(") + segment.count("[") + segment.count("{"))
    for char in _RAISING:
        count += segment.count(char)
    return count + len(re.findall(_WORDS, segment))


def _line_bounds(text: str) -> list:
    """At least `_bound` of the text's first n lines, for each n (0 first): the bound
    of lines a..b is the difference of two entries, for each line's count is its own
    (a word never spans two lines). Made by whole-text substitutions, not a loop over
    lines."""
    marked = _WORD_ENDS.sub(_WORD_MARK, text)  # a stray \x01 in the text only counts more
    # (UTF-8: a character outside ASCII is deleted whole, as none of its bytes is kept)
    data = marked.encode("utf-8", "surrogatepass")
    counted = data.translate(None, _NOT_COUNTED).split(b"\n")
    brackets = data.translate(None, _NOT_OPENING).split(b"\n")  # counted a second time
    return list(
        itertools.accumulate(map(operator.add, map(len, counted), map(len, brackets)), initial=0)
    )


def _may_be_too_deep(text: str, tree, limit: int) -> bool:
    """Whether some statement's text (a simple statement, or a compound statement's
    header with its decorators) holds enough to reach `limit` (then scan)."""
    counts = _line_bounds(text)
    last_line = len(counts) - 1

    def bound(first, last):
        first = min(max(first, 1), last_line)
        last = min(max(last, first), last_line)
        return counts[last] - counts[first - 1]

    pending = [getattr(tree, "body", None) or []]
    while pending:
        for stmt in pending.pop():
            first = stmt.lineno
            for decorator in getattr(stmt, "decorator_list", None) or []:
                first = min(first, decorator.lineno)
            if bound(first, stmt.end_lineno or stmt.lineno) <= limit:
                continue  # nothing in it, its decorators included, can reach the limit
            blocks = [
                getattr(stmt, name, None) or [] for name in ("body", "orelse", "finalbody")
            ]
            blocks = [block for block in blocks if isinstance(block, list)]
            for handler in getattr(stmt, "handlers", None) or []:
                blocks.append(handler.body)
            for case in getattr(stmt, "cases", None) or []:
                blocks.append(case.body)
            inner = [block[0].lineno for block in blocks if block]
            if not inner:  # a simple statement
                return True
            # a header: up to its first body (elif/except/case headers come below)
            last = max(stmt.lineno, min(inner) - 1)
            for handler in getattr(stmt, "handlers", None) or []:
                if bound(handler.lineno, handler.body[0].lineno) > limit:
                    return True
            for case in getattr(stmt, "cases", None) or []:
                where = case.pattern.lineno
                if bound(where, max(where, case.body[0].lineno)) > limit:
                    return True
            if bound(first, last) > limit:
                return True
            pending.extend(blocks)
    return False
