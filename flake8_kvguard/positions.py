"""Line and column of the nodes a finding is reported at.

Every node carries its `ast` span (nodes.py), columns counted in UTF-8 bytes; a
finding's column counts characters, 0-based (flake8 adds 1 when it prints), so only
the reported nodes have their column converted, and only on lines that are not ASCII.
"""

from __future__ import annotations

from . import nodes


def positions(module, targets) -> dict:
    """{id(node): (line, column)} for the given nodes of `module`."""
    found = {}
    for node in targets:
        if getattr(node, "lineno", None) is None:
            found[id(node)] = (1, 0)
        else:
            line, column = nodes.start(node)
            found[id(node)] = (line, nodes.character_column(module, line, column))
    return found
