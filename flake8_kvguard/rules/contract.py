"""What a rule may use: the module it is, the hooks it registers, the view it is given.

A rule is a module (`Rule`): its CODE, SUMMARY, MESSAGE, FIXABLE flag and its BAD,
GOOD and (fixable rules) FIXED examples, from which docs/rules.md is written. It
checks code through hook functions that rules/__init__.py lists in `HOOKS`, by the
event each one reads; nothing is found by name. Every hook gets a `RuleView`, the
only part of the analysis a rule may touch: inference, the module's names, and
reporting. What a hook's other arguments hold is described on `Hooks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

if TYPE_CHECKING:
    from .. import nodes

    from ..values import Val


class RuleView(Protocol):
    """The analysis as a rule sees it (flake8_kvguard.analysis.RuleView implements it)."""

    def report(self, code: str, node: nodes.CSTNode, message: str, fix=None, related=None) -> None:
        """A finding at `node`. `fix` is (old node, rewrites.Rewrite) where the rule can fix it;
        `related` is a second node whose line replaces `{related_line}` in the message."""

    def source_of(self, node: nodes.CSTNode) -> str:
        """The source text of `node`, as written (without parentheses around it)."""

    def short(self, node: nodes.CSTNode) -> str:
        """The source of `node` for a message, or "ids" where it is long."""

    def infer(self, node: nodes.BaseExpression, scope) -> Val:
        """What is known of the value of an expression in a scope."""

    def comprehension_scope(self, node: nodes.CSTNode, scope):
        """The scope inside a comprehension, with its targets bound."""

    def builtin_available(self, name: str, scope=None) -> bool:
        """Whether `name` still means the builtin: not imported, not defined at module
        level and, given a scope, not bound in it."""

    def canonical(self, dotted: str | None) -> str | None:
        """`torch.cat` for `th.cat` after `import torch as th`."""


class Rule(Protocol):
    """A rule module's attributes (docs/rules.md and its tests read them)."""

    CODE: str
    SUMMARY: str
    MESSAGE: str
    FIXABLE: bool
    BAD: list
    GOOD: list


class Hooks(NamedTuple):
    """The checks of the rule set, by the event they read, in the order they run.

    - free_call(call: FreeCall, view): a call of a free-like name with ids;
    - function_end(function, free_calls: list[FreeCall], view): the end of a function
      (or of the module) with the free-like calls made in it;
    - free_method(method: FreeMethod, view): a free-like method of a class;
    - call(node: nodes.Call, scope, view), comparison(node: nodes.Comparison, scope, view),
      subscript(node: nodes.Subscript, scope, view): every call, comparison and subscript
      (read or stored), innermost first;
    - comprehension(node: nodes.SetComp | nodes.DictComp, scope, view): a set or dict
      comprehension, with the scope that binds its targets.

    FreeCall and FreeMethod are in flake8_kvguard.analysis.events.
    """

    free_call: tuple[Callable, ...] = ()
    function_end: tuple[Callable, ...] = ()
    free_method: tuple[Callable, ...] = ()
    call: tuple[Callable, ...] = ()
    comparison: tuple[Callable, ...] = ()
    subscript: tuple[Callable, ...] = ()
    comprehension: tuple[Callable, ...] = ()
