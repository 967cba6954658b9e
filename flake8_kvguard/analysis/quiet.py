"""Function bodies the walk can leave alone, as nothing in them can matter.

Nothing in such a body can be found, nor change what is found elsewhere.

Converting a module's `ast` into nodes and walking it costs about as much as
flake8's own parse, and most of the code in a file that passes the pre-filter has
nothing to do with freeing blocks. So the walk asks, on reaching a def (after its
decorators, defaults and parameters, which it still reads), whether walking the body
could matter; if not, the body is never walked, and never converted
(nodes.FunctionDef converts it on first use). What the rules read of a body by
themselves (a free-like method, the helpers it calls) is converted then, as before.

Walking a body matters through what the rules in `rules.HOOKS` read, and through the
state the walk keeps for later code. Each is ruled out by a test on the def's source
lines (a word in a comment or a string only makes the test keep the body):

- a free-like call (KVG101-KVG104, KVG106: their events need one, and KVG104's end
  of function needs one in the function): no free-like name in the text at all;
- KVG105 (calls, comparisons, subscripts, comprehensions that hash a tensor's
  elements): every finding needs both a value that is a tensor, its element or a
  collection of them, and a hash-based container the code made or a hashing call.
  The body is left alone when either cannot occur in it:
  - tensors: in a body those come only from `torch` or a name imported from it, a
    `*Tensor` annotation, a torch-only method (`.cuda()`...), a configured tensor
    function, a function this file or the project declares to return a tensor, or
    a name the body reads from outside; so none of these in the text, and no such
    value bound in the scopes the body can read (enclosing functions, the module,
    and for a method its class's attributes);
  - containers: a set or dict counts as made by the code (values.is_container) when
    made by a call (`set()`, `dict()`, `Counter()`, `defaultdict()`, `OrderedDict()`,
    `dict.fromkeys()`), a comprehension, or when two different set or dict values
    meet (`d or {}`: displays, annotations, `.keys()`); hashing calls are `set()`,
    `frozenset()`, `Counter()` and `fromkeys()`. So no `{` in the text (displays,
    comprehensions), none of those names nor the annotations' (`Dict`, `Mapping`...)
    nor `keys`, no name imported as one of them, and no set or dict value at all
    bound in the scopes the body can read (two the code did not make, or one and a
    `.keys()` view, join into one it did: `S or KEYS`);
- what the text does not show: Python reads identifiers NFKC-normalized (`ｆree`
  is `free`) and the analysis reads string annotations as the code they hold
  (`"\\x54ensor"`, `"Ten" "sor"`), so a body with any non-ASCII byte, or with a
  string in an annotation, is walked; a configured tensor function counts under
  every name it is imported as;
- the walk's state: a method's `self.x = ...` (and `for self.x in`, `with ... as
  self.x`) records what `self.x` holds for the methods after it, so a method storing
  an attribute of its own instance is walked; imports inside a body are the
  function's own (restored after it); the first pass (walk.py) reads a body's
  imports and nested defs through `FunctionDef.declarations()` whether or not it is
  walked.

Only the hooks listed in `REASONED_FOR` are covered by this reasoning; the engine
skips bodies only with exactly those (tests check the list against `rules.HOOKS`).
"""

from __future__ import annotations

import ast
import itertools
import re

from .. import torch_api
from ..values import DICT, ELEMENT, SET, TENSOR, TENSORS, is_container
from .inference import CONTAINER_CALLS, DICT_ANNOTATIONS, SET_ANNOTATIONS

# The rule hooks the reasoning above covers, by event: (module, function) names.
REASONED_FOR = {
    "free_call": (
        ("kvg101_tensor_ids", "check_free_call"),
        ("kvg102_duplicate_ids", "check_free_call"),
        ("kvg103_bool_ids", "check_free_call"),
        ("kvg106_tensor_element_id", "check_free_call"),
    ),
    "function_end": (("kvg104_double_free", "check_function"),),
    "free_method": (
        ("kvg201_no_duplicate_check", "check_free_method"),
        ("kvg202_unnormalized_ids", "check_free_method"),
        ("kvg203_batched_free", "check_free_method"),
        ("kvg204_unchecked_free", "check_free_method"),
        ("kvg205_single_free", "check_free_method"),
    ),
    "call": (("kvg105_tensor_hashing", "check_call"),),
    "comparison": (("kvg105_tensor_hashing", "check_comparison"),),
    "subscript": (("kvg105_tensor_hashing", "check_subscript"),),
    "comprehension": (("kvg105_tensor_hashing", "check_comprehension"),),
}

# `torch`, any `*Tensor` type, or a torch-only method after a dot (blanks, line
# continuations and whole comments may stand between them inside brackets; a comment
# is matched up to its line's end, one way only: `#[^\n]*` alone, repeated, could split
# a line of many `#` in exponentially many ways).
_TENSOR_TEXT = re.compile(
    rb"torch|Tensor|\.(?:[\s\\]|#[^\r\n]*[\r\n])*(?:%s)\b"
    % "|".join(sorted(torch_api.TORCH_ONLY_METHODS, key=len, reverse=True)).encode()
)
# The names that make or hash a set or dict, or annotate one (last dotted parts).
CONTAINER_NAMES = (
    frozenset(name.rpartition(".")[2] for name in CONTAINER_CALLS)
    | SET_ANNOTATIONS
    | DICT_ANNOTATIONS
    | frozenset(("set", "frozenset", "Counter", "fromkeys", "keys"))
)
_WORD = re.compile(r"[A-Za-z_]\w*")
_NON_ASCII = re.compile(rb"[\x80-\xff]")
_WORD_BYTES = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_TENSOR_KINDS = (TENSOR, ELEMENT, TENSORS)


def _words(words):
    """`words` (identifiers) as `_found` searches them on UTF-8 bytes: each with
    whether it must end a word (`\\b` after it, for one ending in an ASCII character).
    A match is wherever `\\b(?:...)\\b` would match on the text, and more: bytes see
    only ASCII letters as word characters. Searched with bytes.find, one word after
    the other: a compiled alternation cost more to compile per file than the searches
    it made, and ran slower."""
    return tuple(
        (word.encode("utf-8"), word[-1:].isascii()) for word in sorted(words, key=len, reverse=True)
    )


def _found(words, data, start, end) -> bool:
    """Whether one of `words` (from `_words`, or None: none) is a whole word in
    data[start:end]."""
    if not words:
        return False
    find = data.find
    for word, bounded in words:
        size = len(word)
        at = find(word, start, end)
        while at >= 0:
            after = at + size
            if (at == 0 or data[at - 1] not in _WORD_BYTES) and (
                not bounded or after == end or data[after] not in _WORD_BYTES
            ):
                return True
            at = find(word, at + 1, end)
    return False


def covers(hooks) -> bool:
    """Whether `hooks` are exactly the ones this module's reasoning is about."""
    for event, expected in REASONED_FOR.items():
        found = tuple(
            (check.__module__.rpartition(".")[2], check.__name__)
            for check in getattr(hooks, event, ())
        )
        if found != expected:
            return False
    return True


class QuietBodies:
    """Decides, for one module's walk, which function bodies need no walking. The text
    tests are searched in the module's UTF-8 source between the first and last line
    of each def."""

    def __init__(self, module, config, names, index):
        self.lines = module.source
        self.config = config
        self.names = names  # ModuleNames: complete once the walk's first pass is done
        self.index = index
        self._data = None
        self._returns = None
        self.skipped = 0  # bodies left alone so far (tests and benchmarks read it)

    def skips(self, function, env, class_info, self_name) -> bool:
        """Whether the body of `function` (a nodes.FunctionDef whose parameters are
        bound in `env`) can be left unwalked. `class_info` and `self_name` are the
        walk's for a method (else None): the attributes its body can read."""
        node = function.ast_node
        if node is None:
            return False
        if self._data is None:
            self._prepare()
        offsets = self._offsets
        if not 1 <= node.lineno <= node.end_lineno < len(offsets):
            return False
        data, start, end = self._data, offsets[node.lineno - 1], offsets[node.end_lineno]
        if _found(self._free, data, start, end):
            return False
        # Either side of KVG105 may be ruled out, the cheaper tests first.
        method = class_info is not None and self_name is not None
        attrs = class_info.attrs.values() if method else ()
        stores = None
        if data.find(b"{", start, end) < 0 and not _found(
            self._container_words, data, start, end
        ):
            stores = method and _stores_attribute(node.body, self_name)
            if stores:
                return False
            if not _reaches(env, attrs, (SET, DICT), False):
                return self._skip(node, data, start, end)
        if (
            _TENSOR_TEXT.search(data, start, end) is not None
            or _found(self._tensor_words, data, start, end)
            or _found(self._returns_words(), data, start, end)
        ):
            return False
        if stores is None and method and _stores_attribute(node.body, self_name):
            return False
        if _reaches(env, attrs, _TENSOR_KINDS, False):
            return False
        return self._skip(node, data, start, end)

    def _skip(self, node, data, start, end) -> bool:
        """Leave the body alone, which the text tests allow, unless it holds what its text
        does not show: they read neither NFKC-equal names nor the strings annotations
        hold (asked only here, so bodies walked anyway are never searched for them)."""
        if _NON_ASCII.search(data, start, end) is not None or _string_annotation(node.body):
            return False
        self.skipped += 1
        return True

    def _prepare(self):
        self._data = b"".join(self.lines)
        self._offsets = list(itertools.accumulate(map(len, self.lines), initial=0))
        config = self.config
        self._free = _words(config.free_names)
        tensors = {name.rpartition(".")[2] for name in config.tensor_functions}
        containers = set(CONTAINER_NAMES)
        for local, full in self.names.bound:
            if full == "torch" or full.startswith("torch.") or full in config.tensor_functions:
                tensors.add(local)
            if full.rpartition(".")[2] in CONTAINER_NAMES:
                containers.add(local)
        self._tensor_words = _words(tensors)
        self._container_words = _words(containers)

    def _returns_words(self):
        """A pattern for the names in the module that this file or the project
        declares to return a tensor (`_words`)."""
        if self._returns is None:
            words = set(_WORD.findall(self._data.decode("utf-8", "replace")))
            local_returns = self.names.local_returns
            # (a view's & goes through the smaller side)
            found = {
                name for name in local_returns.keys() & words if local_returns[name].kind == TENSOR
            }
            found |= self.index.tensor_returning() & words
            self._returns = [_words(found)]
        return self._returns[0]


def _reaches(env, attrs, kinds, made) -> bool:
    """Whether a value of one of `kinds` (`made`: a container the code made), or
    something holding one, is bound in `env` or its enclosing scopes, or in `attrs`."""
    while env is not None:
        if _holds(env.vars.values(), kinds, made):
            return True
        env = env.parent
    return _holds(attrs, kinds, made)


def _holds(vals, kinds, made) -> bool:
    for val in vals:
        depth = 0
        while val is not None and depth < 50:
            if val.kind in kinds and (not made or is_container(val)):
                return True
            val = val.item
            depth += 1
    return False


def _string_annotation(statements) -> bool:
    """Whether a string is part of an annotation in the statements (a variable's, a
    nested def's parameters' or return's, a nested class's attributes'): the analysis
    reads such a string as the code it holds, which its text need not show
    (`"\\x54ensor"`, `"Ten" "sor"`)."""
    for stmt in _statements(statements, into_scopes=True):
        kind = type(stmt)
        if kind is ast.AnnAssign:
            annotations = [stmt.annotation]
        elif kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
            args = stmt.args
            annotations = [
                arg.annotation
                for arg in (*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs,
                            args.kwarg)
                if arg is not None and arg.annotation is not None
            ]
            if stmt.returns is not None:
                annotations.append(stmt.returns)
        else:
            continue
        for annotation in annotations:
            for part in ast.walk(annotation):
                if type(part) is ast.Constant and type(part.value) is str:
                    return True
    return False


def _stores_attribute(statements, owner) -> bool:
    """Whether the statements (not inside nested defs, classes or lambdas) store to
    `owner.<attribute>`: as an assignment's target, an annotated target, a for loop's
    target or a with statement's `as` target, alone or unpacked."""
    for stmt in _statements(statements, into_scopes=False):
        kind = type(stmt)
        if kind is ast.Assign:
            targets = stmt.targets
        elif kind is ast.AnnAssign or kind is ast.For or kind is ast.AsyncFor:
            targets = (stmt.target,)
        elif kind is ast.With or kind is ast.AsyncWith:
            targets = [item.optional_vars for item in stmt.items if item.optional_vars]
        else:
            continue
        for target in targets:
            if _stores(target, owner):
                return True
    return False


def _statements(statements, into_scopes):
    """The statements and every statement in the blocks they hold (in nested defs and
    classes only with `into_scopes`), in no particular order."""
    stack = list(statements)
    while stack:
        stmt = stack.pop()
        if not into_scopes and type(stmt) in _SCOPES:
            continue
        yield stmt
        for name in ("body", "orelse", "finalbody"):
            block = getattr(stmt, name, None)
            if type(block) is list:
                stack.extend(block)
        for part in getattr(stmt, "handlers", None) or ():
            stack.extend(part.body)
        for part in getattr(stmt, "cases", None) or ():
            stack.extend(part.body)


def _stores(target, owner) -> bool:
    kind = type(target)
    if kind is ast.Attribute:
        return type(target.value) is ast.Name and target.value.id == owner
    if kind is ast.Tuple or kind is ast.List:
        return any(_stores(element, owner) for element in target.elts)
    if kind is ast.Starred:
        return _stores(target.value, owner)
    return False
