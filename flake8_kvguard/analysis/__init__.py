"""The analysis of one module: what flows into free-like calls, handed to the rules.

One walk over a module (walk.py) goes statement by statement in source order and
hands the rules three kinds of events (events.py):

- a free-like call (`alloc.free(ids)`) with what is known of its ids argument;
- the end of each function, with its free-like calls, and each free-like method of a
  class (for the rules that look at a whole function);
- the expressions where values are hashed (calls, comparisons, subscripts, set and
  dict comprehensions), which KVG105 reads.

The package is split along its seams:

| module       | owns                                                          |
|--------------|---------------------------------------------------------------|
| `syntax`     | shapes of statements: blocks, parameters, decorators          |
| `scopes`     | scopes, their bindings, lists built up with append/extend     |
| `names`      | a module's imports, its own defs, their declared returns      |
| `inference`  | what is known of the value of an expression or annotation     |
| `events`     | the rule events and calling the registered hooks              |
| `view`       | the `RuleView`: what a rule may use                           |
| `walk`       | the walk over a module that drives all of the above           |
| `paths`      | a path-sensitive walk over one function (KVG104, any flow)    |
| `quiet`      | the function bodies the walk can leave alone (never converted) |

Rules see only the `RuleView` (rules/contract.py says what it holds).
"""

from __future__ import annotations

from .events import IDS_KEYWORDS, Events, FreeCall, FreeMethod
from .inference import GENERIC_METHODS, Inference
from .names import ModuleNames
from .paths import Outcome, PathWalker, inside_loop
from .scopes import Accumulation, ClassInfo, Env, Scope
from .view import RuleView
from .walk import Analysis

__all__ = [
    "Accumulation",
    "Analysis",
    "ClassInfo",
    "Env",
    "Events",
    "FreeCall",
    "FreeMethod",
    "GENERIC_METHODS",
    "IDS_KEYWORDS",
    "Inference",
    "ModuleNames",
    "Outcome",
    "PathWalker",
    "RuleView",
    "Scope",
    "inside_loop",
]
