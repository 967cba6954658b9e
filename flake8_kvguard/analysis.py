"""One walk over a module that tells the rules what flows into free-like calls.

The walk goes statement by statement in source order, keeps what it knows of each
local name (a `Val`), and hands the rules three kinds of events:

- a free-like call (`alloc.free(ids)`) with what is known of its ids argument;
- a use of tensor elements as hash keys (`set(t)`, `b in seen`, `d[t[i]]`);
- the end of each function, with its free-like calls, and each free-like method of a
  class (for the rules that look at a whole function).

It is flow-insensitive within a function apart from order: both branches of an `if`
update the same names, the later one winning. Good enough for naming what reaches a
call; KVG104 does its own path-sensitive pass.
"""

from __future__ import annotations

import libcst as cst

from . import torch_api
from .cstutil import children, dotted_name, keyword_arg, positional_args, source_of, walk_all
from .values import (
    AN_INT,
    A_BOOL,
    BOOL,
    DICT,
    ELEMENT,
    INT,
    NOTHING,
    OBJECT,
    SEQUENCE,
    SET,
    TENSOR,
    TENSORS,
    UNKNOWN,
    Val,
    elements,
    is_bool,
    join,
    sequence_of,
)

# Keyword names under which a free-like call may receive its ids.
IDS_KEYWORDS = frozenset(
    "blocks block_ids block block_id ids indices index free_index page_ids pages slots".split()
)

# Method names too generic to resolve through the project index: the project's
# `def get(self) -> Tensor` says nothing about `some_dict.get(key)`.
GENERIC_METHODS = frozenset(
    "get pop popleft popitem copy keys values items setdefault index count next result "
    "item tolist numpy read readline readlines write send recv run call apply forward".split()
) | frozenset(
    # What str, bytes, list, dict, set and numbers also have: `text.split(",")` says
    # nothing about a project's `def split(self) -> Tensor`.
    name
    for kind in (str, bytes, list, dict, set, tuple, int, float, object)
    for name in dir(kind)
)

HASHING_BUILTINS = {"set": "set()", "frozenset": "frozenset()"}
HASHING_CALLS = {
    "collections.Counter": "Counter()",
    "Counter": "Counter()",
    "dict.fromkeys": "dict.fromkeys()",
    "collections.OrderedDict.fromkeys": "OrderedDict.fromkeys()",
    "OrderedDict.fromkeys": "OrderedDict.fromkeys()",
}
CONTAINER_CALLS = {
    "set": SET,
    "frozenset": SET,
    "dict": DICT,
    "collections.Counter": DICT,
    "Counter": DICT,
    "collections.defaultdict": DICT,
    "defaultdict": DICT,
    "collections.OrderedDict": DICT,
    "OrderedDict": DICT,
    "dict.fromkeys": DICT,
    "collections.OrderedDict.fromkeys": DICT,
    "OrderedDict.fromkeys": DICT,
}
SET_ANNOTATIONS = frozenset("Set set FrozenSet frozenset AbstractSet MutableSet".split())
DICT_ANNOTATIONS = frozenset(
    "Dict dict DefaultDict defaultdict OrderedDict Mapping MutableMapping Counter".split()
)
SEQUENCE_ANNOTATIONS = frozenset(
    "List list Sequence MutableSequence Iterable Iterator Collection Tuple tuple".split()
)
BOOL_NOTE_LITERAL = "a bool literal"
BOOL_NOTE_COMPARISON = "a comparison"
BOOL_NOTE_MASK = "a bool mask"
MAX_DEPTH = 120

_EQUALITY_OPERATORS = (
    cst.Equal,
    cst.NotEqual,
    cst.LessThan,
    cst.LessThanEqual,
    cst.GreaterThan,
    cst.GreaterThanEqual,
)


class Env:
    """Names of one scope; a lookup falls back to the enclosing scopes."""

    __slots__ = ("vars", "parent")

    def __init__(self, parent=None):
        self.vars = {}
        self.parent = parent

    def lookup(self, name):
        env = self
        while env is not None:
            found = env.vars.get(name)
            if found is not None:
                return found
            env = env.parent
        return None


class Accumulation:
    """A list built up with append/extend: how many sources feed it."""

    __slots__ = ("depth", "sources", "items", "reason", "guarded", "parts")

    def __init__(self, depth, sources=0, items=(), reason=None, parts=0):
        self.depth = depth
        self.sources = sources
        self.items = list(items)
        self.reason = reason
        self.guarded = False
        self.parts = parts  # how many elements it may hold: 2 means "two or more"

    def value(self) -> Val:
        dup = self.reason if self.sources >= 2 and not self.guarded else None
        return sequence_of(self.items, dup=dup).replace(dup=dup)


class ClassInfo:
    __slots__ = ("name", "attrs", "node")

    def __init__(self, node):
        self.node = node
        self.name = node.name.value
        self.attrs = {}


class Scope:
    """A function (or the module) being walked."""

    def __init__(self, node, env, *, self_name=None, class_info=None, parent=None):
        self.node = node
        self.env = env
        self.self_name = self_name
        self.class_info = class_info
        self.parent = parent
        self.loop_depth = 0
        self.guards = []  # tests of the enclosing ifs
        self.dedup_loops = set()  # loop depths whose body skips ids seen before
        self.accumulations = {}
        self.free_calls = []

    def child(self, env):
        """A comprehension or lambda: new names, same function."""
        scope = Scope(
            self.node, env, self_name=self.self_name, class_info=self.class_info, parent=self
        )
        scope.loop_depth = self.loop_depth
        scope.accumulations = self.accumulations
        scope.free_calls = self.free_calls
        scope.guards = self.guards
        scope.dedup_loops = self.dedup_loops
        return scope

    def lookup(self, name):
        accumulation = self.accumulations.get(name)
        if accumulation is not None and self.env.vars.get(name) is None:
            return accumulation.value()
        return self.env.lookup(name)

    def bind(self, name, val):
        self.accumulations.pop(name, None)
        self.env.vars[name] = val


class FreeCall:
    """A call to a free-like function or method, as the rules see it."""

    __slots__ = ("call", "callee", "name", "ids", "val", "tensor_native", "scope")

    def __init__(self, call, callee, name, ids, val, tensor_native, scope):
        self.call = call  # the cst.Call
        self.callee = callee  # "self._kv_cache.free", or just "free"
        self.name = name  # "free"
        self.ids = ids  # the expression passed as ids
        self.val = val  # what is known of it
        self.tensor_native = tensor_native
        self.scope = scope


class HashUse:
    """Tensor elements used where values are hashed (KVG105)."""

    __slots__ = ("node", "what", "operand", "val", "fix")

    def __init__(self, node, what, operand, val, fix=None):
        self.node = node  # where to report
        self.what = what  # "set()", "a dict key", "membership test", ...
        self.operand = operand  # the expression holding tensor elements
        self.val = val
        self.fix = fix  # (old node, new node) or None


class FreeMethod:
    """A free-like method defined in a class (KVG201-KVG204)."""

    __slots__ = ("function", "class_info", "param", "tensor_param", "self_name", "int_ids")

    def __init__(self, function, class_info, param, tensor_param, self_name, int_ids=True):
        self.function = function
        self.class_info = class_info
        self.param = param  # name of the parameter receiving the ids
        self.tensor_param = tensor_param
        self.self_name = self_name
        # False when the annotation says the ids travel as objects (vLLM's
        # KVCacheBlock) or arrays: the rules about int ids (KVG201, KVG202) skip it.
        self.int_ids = int_ids


class Analysis:
    """Walks one module and reports to the rules given."""

    def __init__(self, module, config, index, rules, report):
        self.module = module
        self.config = config
        self.index = index
        self.report = report
        self.free_call_rules = [r for r in rules if hasattr(r, "check_free_call")]
        self.hash_rules = [r for r in rules if hasattr(r, "check_hash_use")]
        self.function_rules = [r for r in rules if hasattr(r, "check_function")]
        self.method_rules = [r for r in rules if hasattr(r, "check_free_method")]
        self.imports = {}
        self.local_returns = {}
        self.local_tensor_params = set()
        self.shadowed = set()
        self._depth = 0
        self._tensor_functions = sorted(config.tensor_functions)
        self._tensor_native = sorted(config.tensor_native)

    # ------------------------------------------------------------------ driver

    def run(self):
        for stmt in self.module.body:
            if type(stmt) in (cst.FunctionDef, cst.ClassDef):
                self.shadowed.add(stmt.name.value)  # a module-level def or class shadows a builtin
        self._prepass(self.module.body, in_class=False)
        scope = Scope(self.module, Env())
        self.module_scope = scope
        self.exec_block(self.module.body, scope)
        self._end_function(scope, None)

    def _prepass(self, body, in_class):
        """Imports and the return annotations of this file's own functions."""
        for stmt in body:
            kind = type(stmt)
            if kind is cst.SimpleStatementLine:
                for small in stmt.body:
                    if type(small) in (cst.Import, cst.ImportFrom):
                        self._record_import(small)
            elif kind is cst.FunctionDef:
                name = stmt.name.value
                if stmt.returns is not None:
                    val = self.annotation_val(stmt.returns.annotation)
                    previous = self.local_returns.get(name)
                    if previous is None:
                        self.local_returns[name] = val
                    elif previous != val:
                        self.local_returns[name] = NOTHING
                param = self._ids_param(stmt, in_class)
                if param is not None and param.annotation is not None:
                    if self.annotation_val(param.annotation.annotation).kind == TENSOR:
                        self.local_tensor_params.add(name)
                self._prepass(_block_body(stmt.body), in_class=False)
            elif kind is cst.ClassDef:
                self._prepass(_block_body(stmt.body), in_class=True)
            else:
                for block in _compound_blocks(stmt):
                    self._prepass(block, in_class)

    def _record_import(self, node):
        if type(node) is cst.Import:
            for alias in node.names:
                full = dotted_name(alias.name)
                if full is None:
                    continue
                if alias.asname is not None and type(alias.asname.name) is cst.Name:
                    self.imports[alias.asname.name.value] = full
                else:
                    first = full.split(".")[0]
                    self.imports[first] = first
        else:
            if node.relative or node.module is None:
                module = None
            else:
                module = dotted_name(node.module)
            if isinstance(node.names, cst.ImportStar):
                return
            for alias in node.names:
                name = dotted_name(alias.name)
                if name is None:
                    continue
                local = name
                if alias.asname is not None and type(alias.asname.name) is cst.Name:
                    local = alias.asname.name.value
                self.imports[local] = f"{module}.{name}" if module else f".{name}"

    def canonical(self, dotted):
        """`torch.cat` for `th.cat` after `import torch as th`, and so on."""
        if dotted is None:
            return None
        first, _, rest = dotted.partition(".")
        target = self.imports.get(first)
        if target is None:
            return dotted
        return f"{target}.{rest}" if rest else target

    def _end_function(self, scope, method):
        for rule in self.function_rules:
            rule.check_function(scope.node, scope.free_calls, self)

    # ------------------------------------------------------------- statements

    def exec_block(self, body, scope):
        for stmt in body:
            self.exec_stmt(stmt, scope)

    def exec_stmt(self, stmt, scope):
        kind = type(stmt)
        if kind is cst.SimpleStatementLine:
            for small in stmt.body:
                self.exec_small(small, scope)
        elif kind is cst.If:
            while True:  # an elif chain, without recursing once per elif
                self.scan(stmt.test, scope)
                scope.guards.append(stmt.test)
                self.exec_block(_block_body(stmt.body), scope)
                scope.guards.pop()
                orelse = stmt.orelse
                if type(orelse) is cst.If:
                    stmt = orelse
                    continue
                if orelse is not None:
                    self.exec_block(_block_body(orelse.body), scope)
                break
        elif kind is cst.For:
            self.scan(stmt.iter, scope)
            self.bind_loop_target(stmt.target, stmt.iter, scope)
            self._exec_loop_body(stmt.body, scope)
            if stmt.orelse is not None:
                self.exec_block(_block_body(stmt.orelse.body), scope)
        elif kind is cst.While:
            self.scan(stmt.test, scope)
            self._exec_loop_body(stmt.body, scope)
            if stmt.orelse is not None:
                self.exec_block(_block_body(stmt.orelse.body), scope)
        elif kind is cst.FunctionDef:
            self.exec_function(stmt, scope)
        elif kind is cst.ClassDef:
            self.exec_class(stmt, scope)
        elif kind in (cst.Try, cst.TryStar):
            self.exec_block(_block_body(stmt.body), scope)
            for handler in stmt.handlers:
                if handler.type is not None:
                    self.scan(handler.type, scope)
                if handler.name is not None and type(handler.name.name) is cst.Name:
                    scope.bind(handler.name.name.value, NOTHING)
                self.exec_block(_block_body(handler.body), scope)
            if stmt.orelse is not None:
                self.exec_block(_block_body(stmt.orelse.body), scope)
            if stmt.finalbody is not None:
                self.exec_block(_block_body(stmt.finalbody.body), scope)
        elif kind is cst.With:
            for item in stmt.items:
                self.scan(item.item, scope)
                if item.asname is not None:
                    self.bind(item.asname.name, NOTHING, scope)
            self.exec_block(_block_body(stmt.body), scope)
        elif kind is cst.Match:
            self.scan(stmt.subject, scope)
            for case in stmt.cases:
                for node in walk_all(case.pattern):
                    name = getattr(node, "name", None)
                    if type(name) is cst.Name:
                        scope.bind(name.value, NOTHING)
                    rest = getattr(node, "rest", None)
                    if type(rest) is cst.Name:
                        scope.bind(rest.value, NOTHING)
                if case.guard is not None:
                    self.scan(case.guard, scope)
                self.exec_block(_block_body(case.body), scope)
        else:
            # Anything newer than this code: still find the calls inside.
            for child in children(stmt):
                if isinstance(child, cst.BaseExpression):
                    self.scan(child, scope)
                elif isinstance(child, (cst.BaseSuite,)):
                    self.exec_block(_block_body(child), scope)

    def _exec_loop_body(self, body, scope):
        scope.loop_depth += 1
        statements = _block_body(body)
        if _skips_seen(statements):
            scope.dedup_loops.add(scope.loop_depth)
        self.exec_block(statements, scope)
        scope.dedup_loops.discard(scope.loop_depth)
        scope.loop_depth -= 1

    def exec_small(self, small, scope):
        kind = type(small)
        if kind is cst.Expr:
            self.scan(small.value, scope)
        elif kind is cst.Assign:
            self.scan(small.value, scope)
            val = self.infer(small.value, scope)
            for target in small.targets:
                self.assign(target.target, small.value, val, scope)
        elif kind is cst.AnnAssign:
            if small.value is not None:
                self.scan(small.value, scope)
            val = self.annotation_val(small.annotation.annotation)
            if val.kind == UNKNOWN and small.value is not None:
                val = self.infer(small.value, scope)
            in_class_body = scope.class_info is not None and scope.node is scope.class_info.node
            if in_class_body and type(small.target) is cst.Name:
                scope.class_info.attrs[small.target.value] = val
            if small.value is not None or type(small.target) is not cst.Name:
                self.assign(small.target, small.value, val, scope)
        elif kind is cst.AugAssign:
            self.scan(small.value, scope)
            self.scan_target(small.target, scope)
            target = small.target
            if type(target) is cst.Subscript:
                self._subscript_event(target, scope)
            if type(target) is cst.Name and type(small.operator) is cst.AddAssign:
                accumulation = scope.accumulations.get(target.value)
                if accumulation is not None:
                    self._accumulate(accumulation, "extend", small.value, scope)
                    return
            if type(target) is cst.Name:
                current = scope.lookup(target.value)
                if current is None or current.kind not in (TENSOR, SEQUENCE):
                    scope.bind(target.value, NOTHING)
        elif kind in (cst.Return, cst.Raise, cst.Assert):
            for child in children(small):
                self.scan(child, scope)
        elif kind is cst.Del:
            for name in _del_names(small.target):
                scope.bind(name, NOTHING)
        elif kind in (cst.Import, cst.ImportFrom):
            self._record_import(small)
        elif kind in (cst.Pass, cst.Break, cst.Continue, cst.Global, cst.Nonlocal):
            pass
        else:
            for child in children(small):
                if isinstance(child, cst.BaseExpression):
                    self.scan(child, scope)

    def exec_function(self, node, scope):
        for decorator in node.decorators:
            self.scan(decorator.decorator, scope)
        in_class = scope.class_info is not None and scope.node is scope.class_info.node
        env = Env(scope.env if not in_class else self.module_scope.env)
        self_name = None
        params = _all_params(node.params)
        if in_class and params and not _is_static(node):
            if not _has_decorator(node, "classmethod"):
                self_name = params[0].name.value
        for param in params:
            if param.default is not None:
                self.scan(param.default, scope)
            val = NOTHING
            if param.annotation is not None:
                val = self.annotation_val(param.annotation.annotation)
            env.vars[param.name.value] = val
        star_arg = node.params.star_arg
        if isinstance(star_arg, cst.Param):
            env.vars[star_arg.name.value] = NOTHING
        if node.params.star_kwarg is not None:
            env.vars[node.params.star_kwarg.name.value] = NOTHING
        inner = Scope(
            node,
            env,
            self_name=self_name,
            class_info=scope.class_info if in_class else None,
            parent=scope,
        )
        if in_class and node.name.value in self.config.free_names and self.method_rules:
            self._free_method(node, scope.class_info, in_class)
        # An import inside a function names things for that function only.
        module_imports = self.imports
        self.imports = dict(module_imports)
        try:
            self.exec_block(_block_body(node.body), inner)
            self._end_function(inner, node)
        finally:
            self.imports = module_imports
        if not in_class:
            scope.bind(node.name.value, NOTHING)

    def exec_class(self, node, scope):
        for decorator in node.decorators:
            self.scan(decorator.decorator, scope)
        for arg in node.bases:
            self.scan(arg.value, scope)
        info = ClassInfo(node)
        inner = Scope(node, Env(self.module_scope.env), class_info=info, parent=scope)
        self.exec_block(_block_body(node.body), inner)
        scope.bind(node.name.value, NOTHING)

    def _ids_param(self, function, in_class):
        params = _all_params(function.params)
        if in_class and not _is_static(function):
            params = params[1:]
        return params[0] if params else None

    def _free_method(self, node, class_info, in_class):
        param = self._ids_param(node, in_class)
        if param is None:
            return
        tensor_param = False
        int_ids = True
        if param.annotation is not None:
            annotation = param.annotation.annotation
            val = self.annotation_val(annotation)
            if val.kind == TENSOR:
                tensor_param = True
            elif not _mentions_int(annotation):
                int_ids = False  # ids that travel as objects (KVCacheBlock), or arrays
        params = _all_params(node.params)
        self_name = params[0].name.value if params and not _is_static(node) else None
        method = FreeMethod(node, class_info, param.name.value, tensor_param, self_name, int_ids)
        for rule in self.method_rules:
            rule.check_free_method(method, self)

    # ------------------------------------------------------------- bindings

    def assign(self, target, value_node, val, scope):
        kind = type(target)
        if kind is cst.Name:
            name = target.value
            scope.bind(name, val)
            accumulation = self._start_accumulation(value_node, val, scope)
            if accumulation is not None:
                scope.accumulations[name] = accumulation
                scope.env.vars.pop(name, None)
        elif kind in (cst.Tuple, cst.List):
            parts = [element.value for element in target.elements]
            if val.kind == TENSORS:
                item_vals = [Val(TENSOR, item=val.item)] * len(parts)
            elif (
                type(value_node) in (cst.Tuple, cst.List)
                and len(value_node.elements) == len(parts)
                and not any(type(e) is cst.StarredElement for e in value_node.elements)
            ):
                item_vals = [self.infer(e.value, scope) for e in value_node.elements]
            else:
                item_vals = [elements(val)] * len(parts)
            for part, item_val in zip(parts, item_vals):
                if type(part) is cst.StarredElement:
                    self.assign(part.value, None, Val(SEQUENCE, item=item_val), scope)
                else:
                    self.assign(part, None, item_val, scope)
        elif kind is cst.Attribute:
            self.scan(target.value, scope)
            owner = target.value
            info = scope.class_info
            if info is not None and type(owner) is cst.Name and owner.value == scope.self_name:
                attr = target.attr.value
                previous = info.attrs.get(attr)
                info.attrs[attr] = val if previous is None or previous == val else NOTHING
        elif kind is cst.Subscript:
            self.scan_target(target, scope)
            self._subscript_event(target, scope)
        elif kind is cst.StarredElement:
            self.assign(target.value, None, Val(SEQUENCE), scope)

    def bind(self, target, val, scope):
        self.assign(target, None, val, scope)

    def scan_target(self, target, scope):
        """Expressions read while storing to a subscript or attribute target."""
        if type(target) is cst.Subscript:
            self.scan(target.value, scope)
            for element in target.slice:
                self.scan(element.slice, scope)
        elif type(target) is cst.Attribute:
            self.scan(target.value, scope)

    def bind_loop_target(self, target, iter_node, scope):
        for name, val in self.loop_bindings(target, iter_node, scope):
            self.assign(name, None, val, scope)

    def loop_bindings(self, target, iter_node, scope):
        """(target node, Val) pairs bound by `for target in iter_node`."""
        if (
            type(iter_node) is cst.Call
            and type(iter_node.func) is cst.Name
            and iter_node.func.value not in self.shadowed
        ):
            builtin = iter_node.func.value
            args = positional_args(iter_node)
            if builtin == "range":
                return [(target, AN_INT)]
            if (
                builtin == "enumerate"
                and args
                and type(target) in (cst.Tuple, cst.List)
                and len(target.elements) == 2
            ):
                item = elements(self.infer(args[0].value, scope))
                return [(target.elements[0].value, AN_INT), (target.elements[1].value, item)]
            if (
                builtin == "zip"
                and args
                and type(target) in (cst.Tuple, cst.List)
                and len(target.elements) == len(args)
            ):
                return [
                    (element.value, elements(self.infer(arg.value, scope)))
                    for element, arg in zip(target.elements, args)
                ]
        return [(target, elements(self.infer(iter_node, scope)))]

    def _start_accumulation(self, value_node, val, scope):
        if value_node is None:
            return None
        kind = type(value_node)
        if kind is cst.List:
            has_items = bool(value_node.elements)
            sources = 2 if val.dup else (1 if has_items else 0)
            parts = (
                min(2, len(value_node.elements))
                if not any(type(e) is cst.StarredElement for e in value_node.elements)
                else 2
            )
            return Accumulation(
                scope.loop_depth, sources, [val.item] if val.item else [], val.dup, parts
            )
        if (
            kind is cst.Call
            and type(value_node.func) is cst.Name
            and value_node.func.value == "list"
        ):
            args = positional_args(value_node)
            sources = 2 if val.dup else (1 if args else 0)
            # list(x) holds x's parts: one source, however many elements it has.
            return Accumulation(
                scope.loop_depth, sources, [val.item] if val.item else [], val.dup, 1 if args else 0
            )
        return None

    def _accumulate(self, accumulation, method, value, scope):
        depth = scope.loop_depth - accumulation.depth
        added_parts = 2 if depth >= 1 or method == "extend" else 1
        accumulation.parts = min(2, accumulation.parts + added_parts)
        if method == "append" or method == "insert":
            accumulation.items.append(self.infer(value, scope) if value is not None else NOTHING)
            if depth >= 2:
                accumulation.sources += 2
                reason = "append() in nested loops"
            else:
                accumulation.sources += 1
                reason = "append() from several places"
        else:
            added = self.infer(value, scope) if value is not None else NOTHING
            accumulation.items.append(elements(added))
            if depth >= 1 or added.dup:
                accumulation.sources += 2
                reason = "extend() in a loop" if depth >= 1 else "extend() with repeated ids"
            else:
                accumulation.sources += 1
                reason = "extend() from several places"
        if accumulation.reason is None or "loop" in reason or "repeated" in reason:
            accumulation.reason = reason
        if self._guarded(scope):
            accumulation.guarded = True

    def _guarded(self, scope):
        if any(depth in scope.dedup_loops for depth in range(1, scope.loop_depth + 1)):
            return True
        for test in scope.guards:
            for node in walk_all(test):
                if type(node) is cst.ComparisonTarget and type(node.operator) is cst.NotIn:
                    return True
        return False

    # ------------------------------------------------------------ expressions

    def scan(self, root, scope):
        """Find the calls, comparisons and subscripts inside an expression, innermost
        first, and hand them to the rules."""
        stack = [(root, scope, False)]
        while stack:
            node, current, done = stack.pop()
            kind = type(node)
            if done:
                if kind is cst.Call:
                    self._call_event(node, current)
                elif kind is cst.Comparison:
                    self._comparison_event(node, current)
                elif kind is cst.Subscript:
                    self._subscript_event(node, current)
                elif kind is cst.NamedExpr:
                    self.assign(node.target, node.value, self.infer(node.value, current), current)
                continue
            if kind in _LEAVES:
                continue
            if kind in _COMPREHENSIONS:
                self._scan_comprehension(node, current)
                continue
            if kind is cst.Lambda:
                env = Env(current.env)
                for param in _all_params(node.params):
                    env.vars[param.name.value] = NOTHING
                stack.append((node.body, current.child(env), False))
                continue
            if kind in _EVENTS:
                stack.append((node, current, True))
                if kind is cst.NamedExpr:
                    stack.append((node.value, current, False))
                    continue
            for child in reversed(children(node)):
                stack.append((child, current, False))

    def _scan_comprehension(self, node, scope):
        child = self.comprehension_scope(node, scope, scan=True)
        if type(node) is cst.DictComp:
            self.scan(node.key, child)
            self.scan(node.value, child)
        else:
            self.scan(node.elt, child)
        if type(node) in (cst.SetComp, cst.DictComp) and self.hash_rules:
            key = node.key if type(node) is cst.DictComp else node.elt
            val = self.infer(key, child)
            if val.kind == ELEMENT:
                what = (
                    "a set comprehension"
                    if type(node) is cst.SetComp
                    else "dict comprehension keys"
                )
                fix = self._comprehension_fix(node, key, child)
                self._hash_event(HashUse(node, what, key, val, fix))

    def comprehension_scope(self, node, scope, scan=False):
        """A scope with the comprehension's targets bound. With `scan`, the iterables
        and conditions are scanned for events on the way (once, by the walk)."""
        env = Env(scope.env)
        child = scope.child(env)
        for_in = node.for_in
        first = True
        while for_in is not None:
            outer = scope if first else child
            if scan:
                self.scan(for_in.iter, outer)
            for target, val in self.loop_bindings(for_in.target, for_in.iter, outer):
                _bind_names(target, val, env)
            if scan:
                for condition in for_in.ifs:
                    self.scan(condition.test, child)
            first = False
            for_in = for_in.inner_for_in
        return child

    def _call_event(self, call, scope):
        func = call.func
        if type(func) is cst.Attribute:
            name = func.attr.value
        elif type(func) is cst.Name:
            name = func.value
        else:
            return
        if name in self.config.free_names:
            self._free_call(call, name, scope)
        if type(func) is cst.Attribute:
            receiver = func.value
            args = positional_args(call)
            if name in ("append", "extend", "insert") and type(receiver) is cst.Name:
                accumulation = scope.accumulations.get(receiver.value)
                if accumulation is not None and scope.env.vars.get(receiver.value) is None:
                    value = args[-1].value if args else None
                    self._accumulate(accumulation, name, value, scope)
            if self.hash_rules and args and (name in _SET_KEYED or name in _DICT_KEYED):
                container = self.infer(receiver, scope)
                wanted = SET if name in _SET_KEYED else DICT
                if container.kind == wanted and _is_container(container):
                    val = self.infer(args[0].value, scope)
                    if val.kind == ELEMENT:
                        what = f"{name}() on a {'set' if container.kind == SET else 'dict'}"
                        self._hash_event(HashUse(call, what, args[0].value, val))
        if self.hash_rules:
            self._hashing_call(call, scope)

    def _hashing_call(self, call, scope):
        func = call.func
        dotted = dotted_name(func)
        if dotted is None:
            return
        if (
            type(func) is cst.Name
            and dotted in HASHING_BUILTINS
            and dotted not in self.shadowed
            and dotted not in self.imports
        ):
            what = HASHING_BUILTINS[dotted]
        else:
            what = HASHING_CALLS.get(self.canonical(dotted))
            if what is None:
                return
        args = positional_args(call)
        if not args:
            return
        operand = args[0].value
        val = self.infer(operand, scope)
        if elements(val).kind != ELEMENT:
            return
        fix = None
        replacement = self._tolist_of(operand, val, scope)
        if replacement is not None:
            fix = (operand, replacement)
        self._hash_event(HashUse(call, what, operand, val, fix))

    def _tolist_of(self, operand, val, scope):
        """`t.tolist()` for an operand that is a definite tensor, or `list(t)` of one."""
        from .cstutil import method_call

        if val.kind in (TENSOR, ELEMENT) and not val.optional:
            return method_call(operand, "tolist")
        if (
            type(operand) is cst.Call
            and type(operand.func) is cst.Name
            and operand.func.value in ("list", "tuple")
            and operand.func.value not in self.shadowed
            and len(operand.args) == 1
            and operand.args[0].keyword is None
            and not operand.args[0].star
        ):
            inner = operand.args[0].value
            inner_val = self.infer(inner, scope)
            if inner_val.kind == TENSOR and not inner_val.optional:
                return method_call(inner, "tolist")
        return None

    def _comprehension_fix(self, node, key, scope):
        for_in = node.for_in
        if for_in.inner_for_in is not None or for_in.ifs or type(key) is not cst.Name:
            return None
        target = for_in.target
        if type(target) is not cst.Name or target.value != key.value:
            return None
        uses = sum(1 for n in walk_all(node) if type(n) is cst.Name and n.value == key.value)
        if uses != 2:  # the target and the key: the element is used for nothing else
            return None
        iter_val = self.infer(for_in.iter, scope.parent or scope)
        if iter_val.kind != TENSOR or iter_val.optional:
            return None
        from .cstutil import method_call

        return (for_in.iter, method_call(for_in.iter, "tolist"))

    def _comparison_event(self, node, scope):
        if not self.hash_rules:
            return
        left = node.left
        for target in node.comparisons:
            if type(target.operator) in (cst.In, cst.NotIn):
                container = self.infer(target.comparator, scope)
                if _is_container(container):
                    val = self.infer(left, scope)
                    if val.kind == ELEMENT:
                        self._hash_event(
                            HashUse(node, f"membership test in a {container.kind}", left, val)
                        )
            left = target.comparator

    def _subscript_event(self, node, scope):
        if (
            not self.hash_rules
            or len(node.slice) != 1
            or type(node.slice[0].slice) is not cst.Index
        ):
            return
        container = self.infer(node.value, scope)
        if container.kind == DICT and _is_container(container):
            key = node.slice[0].slice.value
            val = self.infer(key, scope)
            if val.kind == ELEMENT:
                self._hash_event(HashUse(node, "a dict key", key, val))

    def _hash_event(self, use):
        for rule in self.hash_rules:
            rule.check_hash_use(use, self)

    def _free_call(self, call, name, scope):
        args = positional_args(call)
        ids = args[0] if args else None
        if ids is None:
            ids = next(
                (a for a in call.args if a.keyword is not None and a.keyword.value in IDS_KEYWORDS),
                None,
            )
        if (
            ids is None
            or type(ids.value) in _NOT_IDS
            or (type(ids.value) is cst.Name and ids.value.value == "None")
        ):
            return
        callee = dotted_name(call.func) or name
        val = self.infer(ids.value, scope)
        native = self.is_tensor_native(callee, name, call.func, scope)
        free = FreeCall(call, callee, name, ids.value, val, native, scope)
        scope.free_calls.append(free)
        for rule in self.free_call_rules:
            rule.check_free_call(free, self)

    def is_tensor_native(self, callee, name, func=None, scope=None):
        """Whether the free-like callee takes its ids as a tensor.

        Configured names first. Then the receiver: where the code says what class it is
        (an annotation, `self.x = Cls(...)`, a constructor parameter stored on self, a
        factory's return annotation), that class's method decides, found in this file
        or the project index and through its bases. An unresolved receiver, or a
        resolved one whose method says nothing, counts as taking tensors when any
        definition of that name in the project does: quiet rather than wrong (see
        docs/lint.md)."""
        for entry in self._tensor_native:
            if callee == entry or name == entry or callee.endswith("." + entry):
                return True
        if type(func) is cst.Attribute and scope is not None:
            receiver = self.infer(func.value, scope)
            if receiver.kind == OBJECT and receiver.cls:
                takes = self.index.method_takes(receiver.cls, name)
                if takes is not None:
                    return takes == "t"
        return name in self.local_tensor_params or self.index.takes_tensors(name)

    def class_val(self, name):
        """An instance of `name`, when it is a class this file or the project defines."""
        if name and self.index.is_class(name):
            return Val(OBJECT, cls=name)
        return None

    # --------------------------------------------------------------- inference

    def infer(self, node, scope) -> Val:
        """What is known of the value of an expression."""
        if self._depth > MAX_DEPTH:
            return NOTHING
        self._depth += 1
        try:
            return self._infer(node, scope)
        finally:
            self._depth -= 1

    def _infer(self, node, scope) -> Val:
        kind = type(node)
        if kind is cst.Name:
            value = node.value
            if value == "True" or value == "False":
                return Val(BOOL, note=BOOL_NOTE_LITERAL)
            found = scope.lookup(value)
            return found if found is not None else NOTHING
        if kind is cst.Integer:
            return AN_INT
        if kind is cst.Call:
            return self._infer_call(node, scope)
        if kind is cst.Attribute:
            return self._infer_attribute(node, scope)
        if kind is cst.Subscript:
            return self._infer_subscript(node, scope)
        if kind is cst.List or kind is cst.Tuple:
            return self._infer_display(node, scope)
        if kind is cst.Comparison:
            return self._infer_comparison(node, scope)
        if kind is cst.BinaryOperation:
            return self._infer_binary(node, scope)
        if kind is cst.UnaryOperation:
            operator = type(node.operator)
            if operator is cst.Not:
                return Val(BOOL, note="a negation")
            inner = self.infer(node.expression, scope)
            if operator is cst.BitInvert and inner.kind in (TENSOR, ELEMENT):
                return inner.replace(dup=None)
            if operator in (cst.Minus, cst.Plus) and inner.kind in (INT, TENSOR, ELEMENT):
                return inner.replace(dup=None) if inner.kind != INT else AN_INT
            return NOTHING
        if kind is cst.BooleanOperation:
            return join([self.infer(node.left, scope), self.infer(node.right, scope)])
        if kind is cst.IfExp:
            return join([self.infer(node.body, scope), self.infer(node.orelse, scope)])
        if kind is cst.NamedExpr:
            return self.infer(node.value, scope)
        if kind in (cst.ListComp, cst.GeneratorExp, cst.SetComp):
            return self._infer_comprehension(node, scope)
        if kind is cst.DictComp:
            return Val(DICT, note="comprehension")
        if kind is cst.Set:
            return Val(SET, item=join(self._display_items(node, scope)), note="display")
        if kind is cst.Dict:
            return Val(DICT, note="display")
        return NOTHING

    def _display_items(self, node, scope):
        items = []
        for element in node.elements:
            if type(element) is cst.StarredElement:
                items.append(elements(self.infer(element.value, scope)))
            else:
                items.append(self.infer(element.value, scope))
        return items

    def _infer_display(self, node, scope):
        items = []
        starred = plain = 0
        inner_dup = None
        for element in node.elements:
            if type(element) is cst.StarredElement:
                starred += 1
                inner = self.infer(element.value, scope)
                inner_dup = inner_dup or inner.dup
                items.append(elements(inner))
            else:
                plain += 1
                items.append(self.infer(element.value, scope))
        dup = None
        if starred >= 2 or (starred and plain):
            dup = "unpacking of several sources"
        elif starred:
            dup = inner_dup
        return sequence_of(items, dup=dup)

    def _infer_comprehension(self, node, scope):
        child = self.comprehension_scope(node, scope)
        elt = self.infer(node.elt, child)
        nested = node.for_in.inner_for_in is not None
        dup = None
        if nested:
            dup = "a comprehension flattening several sources"
        elif (
            type(node.elt) is cst.Name
            and type(node.for_in.target) is cst.Name
            and node.elt.value == node.for_in.target.value
        ):
            dup = self.infer(node.for_in.iter, scope).dup
        if type(node) is cst.SetComp:
            return Val(SET, item=elt, note="comprehension")
        return Val(SEQUENCE, item=elt, dup=dup)

    def _infer_comparison(self, node, scope):
        operators = [type(target.operator) for target in node.comparisons]
        if all(op in _EQUALITY_OPERATORS for op in operators):
            vals = [self.infer(node.left, scope)] + [
                self.infer(t.comparator, scope) for t in node.comparisons
            ]
            kinds = {val.kind for val in vals}
            if TENSOR in kinds:
                return Val(TENSOR, item=A_BOOL, note=BOOL_NOTE_MASK)
            if ELEMENT in kinds:
                return Val(ELEMENT, item=A_BOOL, note=BOOL_NOTE_MASK)
        return Val(BOOL, note=BOOL_NOTE_COMPARISON)

    def _infer_binary(self, node, scope):
        operator = type(node.operator)
        left = self.infer(node.left, scope)
        right = self.infer(node.right, scope)
        kinds = {left.kind, right.kind}
        if operator is cst.Add:
            if SEQUENCE in kinds and TENSOR not in kinds and ELEMENT not in kinds:
                return sequence_of([elements(left), elements(right)], dup="concatenation")
        elif operator is cst.Multiply:
            if SEQUENCE in kinds and TENSOR not in kinds:
                seq = left if left.kind == SEQUENCE else right
                return seq.replace(dup="repetition")
        elif operator in (cst.BitAnd, cst.BitOr, cst.BitXor):
            if TENSOR in kinds or ELEMENT in kinds:
                kind = TENSOR if TENSOR in kinds else ELEMENT
                if is_bool(left) and is_bool(right):
                    return Val(kind, item=A_BOOL, note=BOOL_NOTE_MASK)
                return Val(kind)
            if kinds == {SET}:
                made = _is_container(left) and _is_container(right)
                item = join([left.item or NOTHING, right.item or NOTHING])
                return Val(SET, item=item, note="operator" if made else "display")
            if kinds == {BOOL}:
                return Val(BOOL, note=left.note or right.note)
        if TENSOR in kinds:
            item = (
                AN_INT
                if {left.kind, right.kind} <= {TENSOR, INT}
                and all(
                    v.kind == INT or (v.item is not None and v.item.kind == INT)
                    for v in (left, right)
                )
                else None
            )
            return Val(TENSOR, item=item)
        if ELEMENT in kinds:
            return Val(ELEMENT)
        if kinds == {INT} and operator not in (cst.Divide, cst.Power):
            return AN_INT
        return NOTHING

    def _infer_attribute(self, node, scope):
        owner = node.value
        attr = node.attr.value
        if (
            type(owner) is cst.Name
            and owner.value == scope.self_name
            and scope.class_info is not None
        ):
            found = scope.class_info.attrs.get(attr)
            return found if found is not None else NOTHING
        inner = self.infer(owner, scope)
        if inner.kind in (TENSOR, ELEMENT) and attr in torch_api.TENSOR_ATTRIBUTES:
            return inner if attr == "data" else inner.replace(dup=None)
        if inner.kind == TENSORS and attr in torch_api.TUPLE_TENSOR_FIELDS:
            return Val(TENSOR, item=AN_INT if attr == "indices" else inner.item)
        return NOTHING

    def _infer_subscript(self, node, scope):
        base = self.infer(node.value, scope)
        kind = base.kind
        if kind in (TENSOR, ELEMENT):
            indices = []
            slices = 0
            for element in node.slice:
                index = element.slice
                if type(index) is cst.Slice:
                    slices += 1
                    continue
                if type(index) is not cst.Index or index.star is not None:
                    return Val(TENSOR, item=base.item, dup=base.dup)
                if type(index.value) is cst.Name and index.value.value in ("None", "Ellipsis"):
                    return Val(TENSOR, item=base.item, dup=base.dup)
                if type(index.value) is cst.Ellipsis:
                    return Val(TENSOR, item=base.item, dup=base.dup)
                indices.append(self.infer(index.value, scope))
            ints = all(index.kind == INT for index in indices)
            left = None  # dimensions left, where the base's rank is known
            if ints and base.ndim is not None and base.ndim >= len(indices):
                left = base.ndim - len(indices)
            if slices:  # a slice keeps the ids
                return Val(TENSOR, item=base.item, dup=base.dup, ndim=left if ints else None)
            if ints:
                if left is not None and left > 0:
                    return Val(TENSOR, item=base.item, ndim=left)  # a row of a table
                return Val(ELEMENT, item=base.item, ndim=left)
            if len(indices) == 1 and indices[0].kind in (TENSOR, ELEMENT) and is_bool(indices[0]):
                return Val(TENSOR, item=base.item, dup=base.dup)  # a mask keeps each id once
            return Val(TENSOR, item=base.item)
        if kind == TENSORS:
            if len(node.slice) == 1 and type(node.slice[0].slice) is cst.Index:
                return Val(TENSOR, item=base.item)
            return base
        if kind == SEQUENCE:
            if len(node.slice) == 1 and type(node.slice[0].slice) is cst.Slice:
                return base
            return base.item if base.item is not None else NOTHING
        return NOTHING

    def _infer_call(self, node, scope):
        func = node.func
        kind = type(func)
        if kind is cst.Attribute:
            method = func.attr.value
            dotted = dotted_name(func)
            canonical = self.canonical(dotted)
            if canonical is not None:
                module, _, function = canonical.rpartition(".")
                if module == "torch":
                    return self._torch_function(function, node, scope)
                if canonical == "itertools.chain.from_iterable":
                    return Val(SEQUENCE, dup="itertools.chain.from_iterable()")
                if canonical == "itertools.chain":
                    return self._chain(node, scope)
                if canonical in CONTAINER_CALLS:
                    return Val(CONTAINER_CALLS[canonical])
            receiver = self.infer(func.value, scope)
            if receiver.kind in (TENSOR, ELEMENT):
                return self._tensor_method(receiver, method, node, scope)
            if receiver.kind == SEQUENCE:
                if method == "copy":
                    return receiver
                if method == "pop":
                    return receiver.item if receiver.item is not None else NOTHING
            if receiver.kind in (SET, DICT):
                if method == "copy":
                    return receiver
                if method == "keys":
                    return Val(SET, note="keys")
            if method in torch_api.TORCH_ONLY_METHODS and receiver.kind in (UNKNOWN,):
                return self._tensor_method(Val(TENSOR), method, node, scope)
            if method == "tolist" and receiver.kind == UNKNOWN:
                return Val(SEQUENCE)
            if receiver.kind == UNKNOWN and type(func.value) in (cst.Name, cst.Attribute):
                instance = self.class_val(method)  # module.Pool(...)
                if instance is not None:
                    return instance
            return self._declared_tensor(dotted or method, method, is_method=True)
        if kind is cst.Name:
            name = func.value
            canonical = self.canonical(name)
            module, _, function = canonical.rpartition(".")
            if module == "torch":
                return self._torch_function(function, node, scope)
            if name not in self.imports and scope.lookup(name) is None:
                builtin = self._builtin(name, node, scope)
                if builtin is not None:
                    return builtin
            if canonical == "itertools.chain":
                return self._chain(node, scope)
            if (
                canonical in CONTAINER_CALLS
                and canonical != "set"
                and canonical != "frozenset"
                and canonical != "dict"
            ):
                return Val(CONTAINER_CALLS[canonical])
            bound = scope.lookup(name)
            if bound is None or bound.kind == UNKNOWN:  # a class statement binds nothing known
                instance = self.class_val(name)
                if instance is not None:
                    return instance
            return self._declared_tensor(canonical, name, is_method=False)
        return NOTHING

    def _chain(self, node, scope):
        parts = [elements(self.infer(arg.value, scope)) for arg in node.args]
        dup = "itertools.chain()" if len(node.args) >= 2 or any(a.star for a in node.args) else None
        return sequence_of(parts, dup=dup)

    def _builtin(self, name, node, scope):
        args = positional_args(node)
        first = self.infer(args[0].value, scope) if args else None
        if name in ("list", "tuple", "sorted", "reversed"):
            if first is None:
                return Val(SEQUENCE)
            if first.kind == TENSOR:
                return Val(SEQUENCE, item=Val(ELEMENT, item=first.item), dup=first.dup)
            if first.kind == SEQUENCE:
                return first
            if first.kind == SET:
                return Val(SEQUENCE, item=first.item)
            if first.kind == TENSORS:
                return Val(SEQUENCE, item=Val(TENSOR, item=first.item))
            return Val(SEQUENCE)
        if name in ("set", "frozenset"):
            return Val(SET, item=elements(first) if first is not None else None)
        if name == "dict":
            return Val(DICT)
        if name in ("int", "len", "ord", "hash"):
            return AN_INT
        if name == "bool":
            return Val(BOOL, note="bool()")
        if name in ("isinstance", "issubclass", "callable", "hasattr", "any", "all"):
            return Val(BOOL, note=f"{name}()")
        if name == "range":
            return Val(SEQUENCE, item=AN_INT)
        if name == "map" and len(args) >= 2:
            source = self.infer(args[1].value, scope)
            if type(args[0].value) is cst.Name and args[0].value.value == "int":
                return Val(SEQUENCE, item=AN_INT, dup=source.dup)
            return Val(SEQUENCE, dup=source.dup)
        return None

    def _torch_function(self, function, node, scope):
        args = positional_args(node)
        if function == "where" and len(node.args) == 1:
            return Val(TENSORS, item=AN_INT)
        if function in torch_api.TUPLE_KEYWORDS:
            for keyword in torch_api.TUPLE_KEYWORDS[function]:
                arg = keyword_arg(node, keyword)
                if arg is not None and not (
                    type(arg.value) is cst.Name and arg.value.value == "False"
                ):
                    return Val(TENSORS, item=AN_INT if function == "nonzero" else None)
        if function in torch_api.TENSOR_TUPLE_FUNCTIONS:
            first = self.infer(args[0].value, scope) if args else NOTHING
            return Val(TENSORS, item=first.item if first.kind in (TENSOR, ELEMENT) else None)
        if function not in torch_api.TENSOR_FUNCTIONS:
            return NOTHING
        first_node = args[0].value if args else None
        first = self.infer(first_node, scope) if first_node is not None else NOTHING
        item = None
        dtype = keyword_arg(node, "dtype")
        if function in torch_api.BOOL_FUNCTIONS:
            item = A_BOOL
        elif dtype is not None:
            item = self._dtype_item(dtype.value)
        elif function in (
            "arange",
            "randint",
            "randperm",
            "nonzero",
            "argsort",
            "tril_indices",
            "triu_indices",
            "searchsorted",
            "bucketize",
            "bincount",
        ):
            item = AN_INT
        elif (
            function in ("tensor", "as_tensor", "asarray")
            or function in torch_api.ID_PRESERVING
            or function in torch_api.CONCATENATIONS
        ):
            source = elements(first) if function in torch_api.CONCATENATIONS else first
            if source.kind in (TENSOR, ELEMENT, SEQUENCE):
                item = source.item
                if source.kind == SEQUENCE and item is not None and item.kind in (TENSOR, ELEMENT):
                    item = item.item
            elif source.kind in (INT, BOOL):
                item = source
        elif function == "where" and len(args) == 3:
            item = None
        dup = None
        if function in torch_api.CONCATENATIONS:
            dup = self._concatenation_dup(function, first_node, scope)
        elif function in torch_api.ID_PRESERVING:
            dup = first.dup
        note = BOOL_NOTE_MASK if item is not None and item.kind == BOOL else None
        return Val(TENSOR, item=item, dup=dup, note=note, ndim=self._torch_ndim(function, node, scope))

    def _torch_ndim(self, function, node, scope):
        """The rank of torch.<function>(...)'s result where the call proves it."""
        args = positional_args(node)
        if function in ("arange", "randperm", "linspace", "logspace"):
            return 1
        if function in ("zeros", "ones", "empty", "rand", "randn", "full"):
            if not args:
                return None
            first = args[0].value
            if type(first) in (cst.Tuple, cst.List):
                if any(type(e) is cst.StarredElement for e in first.elements):
                    return None
                return len(first.elements)
            shape = args[:1] if function == "full" else args
            # zeros(n) is 1-D only if n is an int: zeros(shape) takes a whole shape.
            if any(a.star or self.infer(a.value, scope).kind != INT for a in shape):
                return None
            return len(shape)
        if function in ("tensor", "as_tensor") and args:
            data = args[0].value
            if type(data) in (cst.List, cst.Tuple) and data.elements:
                parts = [e.value for e in data.elements if type(e) is cst.Element]
                if len(parts) == len(data.elements):
                    if all(_is_int_literal(p) for p in parts):
                        return 1
                    if all(type(p) in (cst.List, cst.Tuple) for p in parts):
                        return 2
            return None
        if function in ("flatten", "masked_select"):
            return 1
        if function == "unique" and keyword_arg(node, "dim") is None:
            return 1
        return None

    def _concatenation_dup(self, function, parts, scope):
        """Why torch.cat(parts) may repeat an id: it joins two or more tensors the
        code visibly gathers (a literal list, or a list it fills itself). A list of
        unknown origin is not taken to hold several parts."""
        if parts is None:
            return None
        if type(parts) is cst.Name:
            accumulation = scope.accumulations.get(parts.value)
            if accumulation is not None and scope.env.vars.get(parts.value) is None:
                if accumulation.parts >= 2 and not accumulation.guarded:
                    return f"torch.{function}() of several tensors"
            return None
        if type(parts) in (cst.List, cst.Tuple):
            count = 0
            for element in parts.elements:
                count += 2 if type(element) is cst.StarredElement else 1
            if count >= 2:
                return f"torch.{function}() of several tensors"
            if count == 1 and type(parts.elements[0]) is not cst.StarredElement:
                return self.infer(parts.elements[0].value, scope).dup
            return None
        return None

    def _dtype_item(self, node):
        dotted = self.canonical(dotted_name(node))
        if dotted in torch_api.BOOL_DTYPES:
            return A_BOOL
        if dotted is not None and (
            dotted.startswith("torch.int")
            or dotted.startswith("torch.uint")
            or dotted in ("torch.long", "torch.short", "int")
        ):
            return AN_INT
        return None

    def _tensor_method(self, receiver, method, node, scope):
        bool_receiver = is_bool(receiver)
        if method == "tolist":
            scalar = A_BOOL if bool_receiver else AN_INT
            if receiver.kind == ELEMENT:
                return scalar
            return Val(SEQUENCE, item=scalar, dup=receiver.dup)
        if method == "item":
            return A_BOOL if bool_receiver else AN_INT
        if method in torch_api.INT_METHODS:
            return AN_INT
        if method in torch_api.TUPLE_KEYWORDS:
            for keyword in torch_api.TUPLE_KEYWORDS[method]:
                arg = keyword_arg(node, keyword)
                if arg is not None and not (
                    type(arg.value) is cst.Name and arg.value.value == "False"
                ):
                    return Val(TENSORS)
        if method in torch_api.TENSOR_TUPLE_METHODS:
            return Val(TENSORS, item=receiver.item)
        if method not in torch_api.TENSOR_METHODS:
            return NOTHING
        kind = receiver.kind
        if kind == ELEMENT and method in torch_api.RESHAPING_METHODS:
            kind = TENSOR
        if method == "nonzero":
            return Val(TENSOR, item=AN_INT)
        item = None
        if method in torch_api.BOOL_METHODS:
            item = A_BOOL
        elif method in ("long", "int", "short"):
            item = AN_INT
        elif method in ("to", "type"):
            item = receiver.item
            for arg in node.args:
                if arg.keyword is None or arg.keyword.value == "dtype":
                    dtype_item = self._dtype_item(arg.value)
                    if dtype_item is not None:
                        item = dtype_item
        elif method in torch_api.SAME_IDS_METHODS:
            item = receiver.item
        dup = receiver.dup if method in torch_api.SAME_IDS_METHODS else None
        note = BOOL_NOTE_MASK if item is not None and item.kind == BOOL else None
        ndim = None
        if method in ("flatten", "ravel", "masked_select") or (
            method in ("view", "reshape")
            and len(node.args) == 1
            and type(node.args[0].value) is cst.UnaryOperation
            and source_of(node.args[0].value).replace(" ", "") == "-1"
        ):
            ndim = 1
        elif method in _SHAPE_KEEPING:
            ndim = receiver.ndim
        if ndim == 1 and kind == ELEMENT:
            kind = TENSOR
        return Val(kind, item=item, dup=dup, optional=False, note=note, ndim=ndim)

    def _declared_tensor(self, dotted, name, is_method):
        """A call whose result configuration, this file or the project index declares
        to be a tensor."""
        for entry in self._tensor_functions:
            if dotted == entry or name == entry or dotted.endswith("." + entry):
                return Val(TENSOR)
        local = self.local_returns.get(name)
        if local is not None:
            return local if local.kind in (TENSOR, OBJECT) else NOTHING
        if is_method and name in GENERIC_METHODS:
            return NOTHING
        kind = self.index.returns_tensor(name)
        if kind is None:
            instance = self.class_val(self.index.factory_class(name))
            return instance if instance is not None else NOTHING
        if kind == "b":
            return Val(TENSOR, item=A_BOOL, note=BOOL_NOTE_MASK)
        return Val(TENSOR, optional=kind == "o")

    # -------------------------------------------------------------- annotations

    def annotation_val(self, node) -> Val:
        """What an annotation says of a value."""
        if self._depth > MAX_DEPTH:
            return NOTHING
        self._depth += 1
        try:
            return self._annotation_val(node)
        finally:
            self._depth -= 1

    def _annotation_val(self, node) -> Val:
        kind = type(node)
        if kind is cst.SimpleString:
            text = node.evaluated_value if isinstance(node.evaluated_value, str) else None
            if not text or len(text) > 200:
                return NOTHING
            try:
                return self.annotation_val(cst.parse_expression(text))
            except (cst.ParserSyntaxError, RecursionError, ValueError):
                return NOTHING
        if kind in (cst.Name, cst.Attribute):
            dotted = dotted_name(node)
            canonical = self.canonical(dotted)
            if canonical is None:
                return NOTHING
            last = canonical.rpartition(".")[2]
            if last in torch_api.TENSOR_TYPES and self._is_torch(dotted, canonical):
                if last in torch_api.BOOL_TENSOR_TYPES:
                    return Val(TENSOR, item=A_BOOL, note=BOOL_NOTE_MASK)
                return Val(TENSOR, item=None if last == "Tensor" else AN_INT)
            if canonical in ("int", "builtins.int"):
                return AN_INT
            if canonical in ("bool", "builtins.bool"):
                return Val(BOOL, note="a bool")
            if last in SET_ANNOTATIONS:
                return Val(SET, note="annotation")
            if last in DICT_ANNOTATIONS:
                return Val(DICT, note="annotation")
            return self.class_val(last) or NOTHING
        if kind is cst.Subscript:
            base = self.canonical(dotted_name(node.value))
            if base is None:
                return NOTHING
            last = base.rpartition(".")[2]
            parts = [e.slice.value for e in node.slice if type(e.slice) is cst.Index]
            if not parts:
                return NOTHING
            if last == "Optional":
                inner = self.annotation_val(parts[0])
                return inner.replace(optional=True) if inner.kind in (TENSOR, OBJECT) else NOTHING
            if last == "Union":
                return self._union(
                    [self.annotation_val(p) if not _is_none(p) else None for p in parts]
                )
            if last in SEQUENCE_ANNOTATIONS:
                item = self.annotation_val(parts[0])
                return Val(SEQUENCE, item=item if item.kind != UNKNOWN else None)
            if last in SET_ANNOTATIONS:
                return Val(SET, note="annotation")
            if last in DICT_ANNOTATIONS:
                return Val(DICT, note="annotation")
            if last in torch_api.DTYPE_ANNOTATIONS:
                inner = self.annotation_val(parts[0])
                if inner.kind == TENSOR:
                    if last in torch_api.BOOL_DTYPE_ANNOTATIONS:
                        return Val(TENSOR, item=A_BOOL, note=BOOL_NOTE_MASK)
                    return Val(TENSOR, item=AN_INT if last.startswith(("Int", "UInt")) else None)
            if last == "Annotated":
                return self.annotation_val(parts[0])
            return NOTHING
        if kind is cst.BinaryOperation and type(node.operator) is cst.BitOr:
            options = []
            for side in (node.left, node.right):
                options.append(None if _is_none(side) else self.annotation_val(side))
            return self._union(options)
        return NOTHING

    def _union(self, options):
        known = [o for o in options if o is not None]
        if known and all(o.kind == TENSOR for o in known):
            merged = join(known)
            if merged.kind != TENSOR:
                merged = Val(TENSOR)
            return merged.replace(optional=len(known) != len(options) or merged.optional)
        return NOTHING

    def _is_torch(self, dotted, canonical):
        if canonical.startswith("torch."):
            return True
        # A bare `Tensor` that nothing imported from elsewhere is taken to be torch's.
        return "." not in dotted and dotted not in self.imports


# ---------------------------------------------------------------------- helpers

_LEAVES = frozenset(
    (
        cst.Name,
        cst.Integer,
        cst.Float,
        cst.Imaginary,
        cst.SimpleString,
        cst.Ellipsis,
    )
)
_COMPREHENSIONS = frozenset((cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp))
_EVENTS = frozenset((cst.Call, cst.Comparison, cst.Subscript, cst.NamedExpr))
_SET_KEYED = frozenset(("add", "discard", "remove"))
# Tensor methods whose result has the receiver's shape.
_SHAPE_KEEPING = frozenset(
    "long int short to type cuda cpu clone contiguous detach pin_memory abs neg".split()
)
# Literals that cannot be block ids: `cache.release("session-a")` releases something else.
_NOT_IDS = frozenset(
    (
        cst.SimpleString,
        cst.ConcatenatedString,
        cst.FormattedString,
        cst.Float,
        cst.Imaginary,
        cst.Dict,
        cst.Lambda,
    )
)
_DICT_KEYED = frozenset(("setdefault", "get", "pop"))


def _is_int_literal(node):
    if type(node) is cst.UnaryOperation:
        node = node.expression
    return type(node) is cst.Integer


def _bind_names(target, val, env):
    """Bind a comprehension target without side effects on the enclosing function."""
    kind = type(target)
    if kind is cst.Name:
        env.vars[target.value] = val
    elif kind in (cst.Tuple, cst.List):
        parts = target.elements
        item = Val(TENSOR, item=val.item) if val.kind == TENSORS else elements(val)
        for part in parts:
            _bind_names(part.value, item if len(parts) else NOTHING, env)
    elif kind is cst.StarredElement:
        _bind_names(target.value, Val(SEQUENCE), env)


def _block_body(suite):
    """The statements of an indented block or of a one-line `if x: a; b`."""
    body = suite.body
    if type(suite) is cst.SimpleStatementSuite:
        return [cst.SimpleStatementLine(body=body)]
    return body


def _compound_blocks(stmt):
    blocks = []
    while type(stmt) is cst.If and type(stmt.orelse) is cst.If:  # an elif chain
        blocks.append(_block_body(stmt.body))
        stmt = stmt.orelse
    for name in ("body", "orelse", "finalbody"):
        part = getattr(stmt, name, None)
        if part is None:
            continue
        if isinstance(part, cst.BaseSuite):
            blocks.append(_block_body(part))
        elif hasattr(part, "body") and isinstance(part.body, cst.BaseSuite):
            blocks.append(_block_body(part.body))
    for handler in getattr(stmt, "handlers", ()) or ():
        blocks.append(_block_body(handler.body))
    for case in getattr(stmt, "cases", ()) or ():
        blocks.append(_block_body(case.body))
    return blocks


def _all_params(params):
    found = list(params.posonly_params) + list(params.params) + list(params.kwonly_params)
    return found


def _has_decorator(function, name):
    for decorator in function.decorators:
        dotted = dotted_name(decorator.decorator)
        if dotted is not None and dotted.rpartition(".")[2] == name:
            return True
    return False


def _is_static(function):
    return _has_decorator(function, "staticmethod")


def _is_none(node):
    return (type(node) is cst.Name and node.value == "None") or (
        type(node) is cst.SimpleString and node.evaluated_value == "None"
    )


def _mentions_int(annotation):
    for node in walk_all(annotation):
        if type(node) is cst.Name and node.value in ("int", "Tensor", "LongTensor", "IntTensor"):
            return True
        if type(node) is cst.SimpleString and "int" in str(node.evaluated_value):
            return True
    return False


def _is_container(val):
    """A set or dict the checker saw being made by a call or a comprehension.

    Literal displays (`{}`), annotations (`Dict[int, X]`) and `.keys()` views do
    not count: every file has them, and counting them would make the textual
    pre-filter parse most files that mention torch (see prefilter.py)."""
    return val.kind in (SET, DICT) and val.note not in ("display", "annotation", "keys")


def _del_names(target):
    if type(target) is cst.Name:
        return [target.value]
    if type(target) in (cst.Tuple, cst.List):
        found = []
        for element in target.elements:
            found.extend(_del_names(element.value))
        return found
    return []


def _target_names(target):
    if type(target) is cst.Name:
        return [target.value]
    if type(target) in (cst.Tuple, cst.List):
        found = []
        for element in target.elements:
            found.extend(_target_names(element.value))
        return found
    if type(target) is cst.StarredElement:
        return _target_names(target.value)
    return []


def _skips_seen(statements):
    """A loop body that starts with `if x in seen: continue` de-duplicates."""
    for stmt in statements:
        if type(stmt) is not cst.If:
            continue
        body = _block_body(stmt.body)
        if (
            len(body) == 1
            and type(body[0]) is cst.SimpleStatementLine
            and any(type(small) is cst.Continue for small in body[0].body)
        ):
            for node in walk_all(stmt.test):
                if type(node) is cst.ComparisonTarget and type(node.operator) is cst.In:
                    return True
    return False
