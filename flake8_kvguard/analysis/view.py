"""What a rule sees of the analysis: the `RuleView` that rules/contract.py describes.

The walk, the scopes and the module's tables stay behind it; a rule gets inference,
the module's names and a way to report, and nothing else.
"""

from __future__ import annotations

from .. import nodes


class RuleView:
    """The members a rule may use (rules/contract.py: `RuleView`)."""

    __slots__ = ("report", "infer", "comprehension_scope", "canonical", "_names", "_module")

    def __init__(self, inference, names, report, module):
        self.report = report  # report(code, node, message, fix=None, related=None)
        self.infer = inference.infer
        self.comprehension_scope = inference.comprehension_scope
        self.canonical = names.canonical
        self._names = names
        self._module = module

    def source_of(self, node):
        """The source text of `node`, as written (without parentheses around it)."""
        return nodes.segment(self._module, node)

    def short(self, node):
        """The source of `node` for a message, or "ids" where it is long."""
        text = self.source_of(node).strip()
        if len(text) > 40 or "\n" in text:
            return "ids"
        return text

    def builtin_available(self, name, scope=None):
        """Whether `name` still means the builtin: not imported, not defined at module
        level and, given a scope, not bound in it."""
        return self._names.builtin_available(name, scope)
