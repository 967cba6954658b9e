"""What a fix does, said without building code: `subject.tolist()` or `int(subject)`.

A rule offers a fix as `(old node, Rewrite)`: the node it replaces and how the
replacement is made from `subject` (the old node itself, or a part of it: `set(list(t))`
becomes `set(t.tolist())`). Detection reads `ast` (nodes.py) and never imports libcst;
fixer.py finds both nodes again in libcst's tree by their spans and builds the code
there, so comments and formatting stay as they are.
"""

from __future__ import annotations

METHOD = "method"  # subject.name()
BUILTIN = "builtin"  # name(subject)


class Rewrite:
    __slots__ = ("kind", "name", "subject")

    def __init__(self, kind, name, subject):
        self.kind = kind
        self.name = name
        self.subject = subject

    def __repr__(self):
        return f"Rewrite({self.kind}, {self.name!r}, {self.subject!r})"


def method_call(node, method: str) -> Rewrite:
    """`node.method()`, parenthesizing node where needed."""
    return Rewrite(METHOD, method, node)


def builtin_call(name: str, node) -> Rewrite:
    """`name(node)`."""
    return Rewrite(BUILTIN, name, node)
