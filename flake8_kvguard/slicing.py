"""Parse less of the files that can only hold a KVG105 finding.

A file with no free-like call can only hold KVG105, and a KVG105 finding sits next to a
set or dict the code makes itself (set(), dict(), Counter(), a comprehension...). So in
such a file the top-level functions and classes whose text has no such marker are
left out of the analysis (and blanked in the text the file's own index is read
from): line numbers and columns stay as they are, and what remains is analysed exactly
as before. The split comes from the same `ast` tree the analysis reads.

Kept whole, so that nothing a kept part depends on goes missing: every module-level
statement that is not a def or class (imports, assignments), every class with a marker
(its methods share `self` attributes), and the whole file when a module-level
statement makes a container, or when a def or class shadows a builtin the rules know.
"""

from __future__ import annotations

import ast
import re

from .prefilter import has_container

# Builtins the analysis gives a meaning; a module-level def or class of that name
# changes what a call means everywhere in the file.
KNOWN_BUILTINS = frozenset(
    """
    set frozenset dict list tuple sorted reversed int len ord hash bool isinstance
    issubclass callable hasattr any all range map enumerate zip Counter defaultdict
    OrderedDict chain
    """.split()
)
_LINES = re.compile(r"[^\n]*\n|[^\n]+\Z")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def reduce(text: str, tree=None):
    """The text with unneeded top-level defs and classes blanked, or None when the
    whole file is needed (or nothing can be dropped)."""
    reduced = reduce_tree(text, tree)
    return None if reduced is None else reduced[0]


def reduce_tree(text: str, tree=None):
    """(the text with unneeded top-level defs and classes blanked, the top-level
    statements of `tree` that are kept), or None when the whole file is needed."""
    if tree is None:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
    if not isinstance(tree, ast.Module):
        return None
    lines = _LINES.findall(text)
    dropped = []
    kept = []
    for node in tree.body:
        start = node.lineno
        if isinstance(node, _SCOPES):
            if node.name in KNOWN_BUILTINS:
                return None
            if node.decorator_list:
                start = min(start, min(d.lineno for d in node.decorator_list))
        end = getattr(node, "end_lineno", None)
        if end is None or start < 1 or end > len(lines):
            return None
        has_marker = has_container("".join(lines[start - 1 : end]))
        if not isinstance(node, _SCOPES):
            if has_marker:
                return None
            kept.append(node)
            continue
        if has_marker:
            kept.append(node)
        else:
            dropped.append((start, end))
    if not dropped:
        return None
    for start, end in dropped:
        for number in range(start - 1, end):
            lines[number] = "\n" if lines[number].endswith("\n") else ""
    return "".join(lines), kept
