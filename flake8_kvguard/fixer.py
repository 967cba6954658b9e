"""`kvguard lint --fix`: behaviour-preserving rewrites, through libcst.

Only three rewrites exist, each offered by a rule only where it can tell the value
is what the rewrite needs (a definite tensor, never an Optional one, a builtin `int`
not shadowed): KVG101 `ids` -> `ids.tolist()`, KVG105 `set(t)` -> `set(t.tolist())`,
KVG106 `t[i]` -> `int(t[i])`. libcst keeps every comment, blank line and the file's
encoding and newlines. Fixes that nest are applied over several rounds, and a round
that finds nothing to fix ends the loop, so a second `--fix` changes nothing.
"""

from __future__ import annotations

import libcst as cst

from . import engine
from .cstutil import walk

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


def _outermost(fixes):
    """Fixes whose node is not inside another fix's node (the rest wait a round)."""
    inside = set()
    for old, _ in fixes:
        for node in walk(old, into_scopes=True):
            if node is not old:
                inside.add(id(node))
    chosen, seen = [], set()
    for old, new in fixes:
        if id(old) in inside or id(old) in seen:
            continue
        seen.add(id(old))
        chosen.append((old, new))
    return chosen


def fix_source(source: bytes, config, index, select=None):
    """(new source, number of fixes) for one file's bytes."""
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
        chosen = _outermost(fixes)
        with engine.deep_recursion():
            new_module = module.visit(_Replace({id(old): new for old, new in chosen}))
            new_source = new_module.bytes
        if new_source == source:
            break
        source = new_source
        applied += len(chosen)
    return source, applied
