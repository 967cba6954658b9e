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


def too_deep(text: str, limit: int = MAX_DEPTH):
    """None when every statement is shallow enough to parse safely, else (the line the
    first too deep statement starts on, why)."""
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
