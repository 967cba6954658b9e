"""The walk over one module: statements in source order, bindings, expression scans.

It goes statement by statement, keeps what it knows of each local name (a `Val`,
inferred by `Inference`) and hands what it meets to `Events`, which calls the
rules. It is flow-insensitive within a function apart from order: both branches of
an `if` update the same names, the later one winning. Good enough for naming what
reaches a call; a rule that needs paths uses `paths.PathWalker`.
"""

from __future__ import annotations

from .. import nodes

from ..cstutil import children, positional_args, walk_all
from ..values import NOTHING, SEQUENCE, TENSOR, TENSORS, UNKNOWN, Val, elements
from . import quiet
from .events import Events
from .inference import Inference
from .names import ModuleNames
from .scopes import Accumulation, ClassInfo, Env, Scope
from .syntax import (
    all_params,
    block_body,
    compound_blocks,
    del_names,
    has_decorator,
    ids_param,
    is_static,
    skips_seen,
)
from .view import RuleView

_LEAVES = frozenset(
    (
        nodes.Name,
        nodes.Integer,
        nodes.Float,
        nodes.Imaginary,
        nodes.SimpleString,
        nodes.Ellipsis,
    )
)
_COMPREHENSIONS = frozenset((nodes.ListComp, nodes.SetComp, nodes.DictComp, nodes.GeneratorExp))
_EVENTS = frozenset((nodes.Call, nodes.Comparison, nodes.Subscript, nodes.NamedExpr))
_ACCUMULATING = frozenset(("append", "extend", "insert"))


class Analysis:
    """Walks one module and calls the hooks given (rules/contract.py's `Hooks`) with
    a `RuleView`; `report(code, node, message, fix=None, related=None)` receives
    the findings."""

    def __init__(self, module, config, index, hooks, report, skip_quiet=False):
        self.module = module
        self.config = config
        self.hooks = hooks
        self.names = ModuleNames()
        self.inference = inference = Inference(self.names, config, index)
        self.view = RuleView(inference, self.names, report, module)
        self.events = Events(hooks, self.view, inference, self.names, config, index)
        self.infer = inference.infer
        # `skip_quiet`: leave alone the function bodies quiet.py shows cannot matter
        # (only for the hooks it was reasoned for).
        self.quiet = None
        if skip_quiet and quiet.covers(hooks):
            self.quiet = quiet.QuietBodies(module, config, self.names, index)

    def run(self):
        for stmt in self.module.body:
            if type(stmt) in (nodes.FunctionDef, nodes.ClassDef):
                # A module-level def or class shadows a builtin.
                self.names.shadowed.add(stmt.name.value)
        self._prepass(self.module.body, in_class=False)
        scope = Scope(self.module, Env())
        self.module_scope = scope
        self.exec_block(self.module.body, scope)
        self.events.function_end(scope)

    def _prepass(self, body, in_class):
        """Imports and the return annotations of this file's own functions."""
        for stmt in body:
            kind = type(stmt)
            if kind is nodes.SimpleStatementLine:
                for small in stmt.body:
                    if type(small) in (nodes.Import, nodes.ImportFrom):
                        self.names.record_import(small)
            elif kind is nodes.Import or kind is nodes.ImportFrom:  # from declarations()
                self.names.record_import(stmt)
            elif kind is nodes.FunctionDef:
                name = stmt.name.value
                if stmt.returns is not None:
                    val = self.inference.annotation_val(stmt.returns.annotation)
                    previous = self.names.local_returns.get(name)
                    if previous is None:
                        self.names.local_returns[name] = val
                    elif previous != val:
                        self.names.local_returns[name] = NOTHING
                param = ids_param(stmt, in_class)
                if param is not None and param.annotation is not None:
                    if self.inference.annotation_val(param.annotation.annotation).kind == TENSOR:
                        self.names.local_tensor_params.add(name)
                # Without converting a body nothing else reads (nodes.FunctionDef).
                declarations = stmt.declarations()
                if declarations is None:
                    declarations = block_body(stmt.body)
                self._prepass(declarations, in_class=False)
            elif kind is nodes.ClassDef:
                self._prepass(block_body(stmt.body), in_class=True)
            else:
                for block in compound_blocks(stmt):
                    self._prepass(block, in_class)

    # ------------------------------------------------------------- statements

    def exec_block(self, body, scope):
        for stmt in body:
            self.exec_stmt(stmt, scope)

    def exec_stmt(self, stmt, scope):
        kind = type(stmt)
        if kind is nodes.SimpleStatementLine:
            for small in stmt.body:
                self.exec_small(small, scope)
        elif kind is nodes.If:
            while True:  # an elif chain, without recursing once per elif
                self.scan(stmt.test, scope)
                scope.guards.append(stmt.test)
                self.exec_block(block_body(stmt.body), scope)
                scope.guards.pop()
                orelse = stmt.orelse
                if type(orelse) is nodes.If:
                    stmt = orelse
                    continue
                if orelse is not None:
                    self.exec_block(block_body(orelse.body), scope)
                break
        elif kind is nodes.For:
            self.scan(stmt.iter, scope)
            self.bind_loop_target(stmt.target, stmt.iter, scope)
            self._exec_loop_body(stmt.body, scope)
            if stmt.orelse is not None:
                self.exec_block(block_body(stmt.orelse.body), scope)
        elif kind is nodes.While:
            self.scan(stmt.test, scope)
            self._exec_loop_body(stmt.body, scope)
            if stmt.orelse is not None:
                self.exec_block(block_body(stmt.orelse.body), scope)
        elif kind is nodes.FunctionDef:
            self.exec_function(stmt, scope)
        elif kind is nodes.ClassDef:
            self.exec_class(stmt, scope)
        elif kind in (nodes.Try, nodes.TryStar):
            self.exec_block(block_body(stmt.body), scope)
            for handler in stmt.handlers:
                if handler.type is not None:
                    self.scan(handler.type, scope)
                if handler.name is not None and type(handler.name.name) is nodes.Name:
                    scope.bind(handler.name.name.value, NOTHING)
                self.exec_block(block_body(handler.body), scope)
            if stmt.orelse is not None:
                self.exec_block(block_body(stmt.orelse.body), scope)
            if stmt.finalbody is not None:
                self.exec_block(block_body(stmt.finalbody.body), scope)
        elif kind is nodes.With:
            for item in stmt.items:
                self.scan(item.item, scope)
                if item.asname is not None:
                    self.bind(item.asname.name, NOTHING, scope)
            self.exec_block(block_body(stmt.body), scope)
        elif kind is nodes.Match:
            self.scan(stmt.subject, scope)
            for case in stmt.cases:
                for node in walk_all(case.pattern):
                    name = getattr(node, "name", None)
                    if type(name) is nodes.Name:
                        scope.bind(name.value, NOTHING)
                    rest = getattr(node, "rest", None)
                    if type(rest) is nodes.Name:
                        scope.bind(rest.value, NOTHING)
                if case.guard is not None:
                    self.scan(case.guard, scope)
                self.exec_block(block_body(case.body), scope)
        else:
            # Anything newer than this code: still find the calls inside.
            for child in children(stmt):
                if isinstance(child, nodes.BaseExpression):
                    self.scan(child, scope)
                elif isinstance(child, (nodes.BaseSuite,)):
                    self.exec_block(block_body(child), scope)

    def _exec_loop_body(self, body, scope):
        scope.loop_depth += 1
        statements = block_body(body)
        if skips_seen(statements):
            scope.dedup_loops.add(scope.loop_depth)
        self.exec_block(statements, scope)
        scope.dedup_loops.discard(scope.loop_depth)
        scope.loop_depth -= 1

    def exec_small(self, small, scope):
        kind = type(small)
        if kind is nodes.Expr:
            self.scan(small.value, scope)
        elif kind is nodes.Assign:
            self.scan(small.value, scope)
            val = self.infer(small.value, scope)
            for target in small.targets:
                self.assign(target.target, small.value, val, scope)
        elif kind is nodes.AnnAssign:
            if small.value is not None:
                self.scan(small.value, scope)
            val = self.inference.annotation_val(small.annotation.annotation)
            if val.kind == UNKNOWN and small.value is not None:
                val = self.infer(small.value, scope)
            in_class_body = scope.class_info is not None and scope.node is scope.class_info.node
            if in_class_body and type(small.target) is nodes.Name:
                scope.class_info.attrs[small.target.value] = val
            if small.value is not None or type(small.target) is not nodes.Name:
                self.assign(small.target, small.value, val, scope)
        elif kind is nodes.AugAssign:
            self.scan(small.value, scope)
            self.scan_target(small.target, scope)
            target = small.target
            if type(target) is nodes.Subscript:
                self._subscript_event(target, scope)
            if type(target) is nodes.Name and type(small.operator) is nodes.AddAssign:
                accumulation = scope.accumulations.get(target.value)
                if accumulation is not None:
                    self._accumulate(accumulation, "extend", small.value, scope)
                    return
            if type(target) is nodes.Name:
                current = scope.lookup(target.value)
                if current is None or current.kind not in (TENSOR, SEQUENCE):
                    scope.bind(target.value, NOTHING)
        elif kind in (nodes.Return, nodes.Raise, nodes.Assert):
            for child in children(small):
                self.scan(child, scope)
        elif kind is nodes.Del:
            for name in del_names(small.target):
                scope.bind(name, NOTHING)
        elif kind in (nodes.Import, nodes.ImportFrom):
            self.names.record_import(small)
        elif kind in (nodes.Pass, nodes.Break, nodes.Continue, nodes.Global, nodes.Nonlocal):
            pass
        else:
            for child in children(small):
                if isinstance(child, nodes.BaseExpression):
                    self.scan(child, scope)

    def exec_function(self, node, scope):
        for decorator in node.decorators:
            self.scan(decorator.decorator, scope)
        in_class = scope.class_info is not None and scope.node is scope.class_info.node
        env = Env(scope.env if not in_class else self.module_scope.env)
        self_name = None
        params = all_params(node.params)
        if in_class and params and not is_static(node):
            if not has_decorator(node, "classmethod"):
                self_name = params[0].name.value
        for param in params:
            if param.default is not None:
                self.scan(param.default, scope)
            val = NOTHING
            if param.annotation is not None:
                val = self.inference.annotation_val(param.annotation.annotation)
            env.vars[param.name.value] = val
        star_arg = node.params.star_arg
        if isinstance(star_arg, nodes.Param):
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
        if in_class and node.name.value in self.config.free_names and self.hooks.free_method:
            self.events.free_method(node, scope.class_info, in_class)
        if self.quiet is None or not self.quiet.skips(
            node, env, scope.class_info if in_class else None, self_name
        ):
            # An import inside a function names things for that function only.
            names = self.names
            module_imports = names.imports
            names.imports = dict(module_imports)
            try:
                self.exec_block(block_body(node.body), inner)
                self.events.function_end(inner)
            finally:
                names.imports = module_imports
        if not in_class:
            scope.bind(node.name.value, NOTHING)

    def exec_class(self, node, scope):
        for decorator in node.decorators:
            self.scan(decorator.decorator, scope)
        for arg in node.bases:
            self.scan(arg.value, scope)
        info = ClassInfo(node)
        inner = Scope(node, Env(self.module_scope.env), class_info=info, parent=scope)
        self.exec_block(block_body(node.body), inner)
        scope.bind(node.name.value, NOTHING)

    # ------------------------------------------------------------- bindings

    def assign(self, target, value_node, val, scope):
        kind = type(target)
        if kind is nodes.Name:
            name = target.value
            scope.bind(name, val)
            accumulation = self._start_accumulation(value_node, val, scope)
            if accumulation is not None:
                scope.accumulations[name] = accumulation
                scope.env.vars.pop(name, None)
        elif kind in (nodes.Tuple, nodes.List):
            parts = [element.value for element in target.elements]
            if val.kind == TENSORS:
                item_vals = [Val(TENSOR, item=val.item)] * len(parts)
            elif (
                type(value_node) in (nodes.Tuple, nodes.List)
                and len(value_node.elements) == len(parts)
                and not any(type(e) is nodes.StarredElement for e in value_node.elements)
            ):
                item_vals = [self.infer(e.value, scope) for e in value_node.elements]
            else:
                item_vals = [elements(val)] * len(parts)
            for part, item_val in zip(parts, item_vals):
                if type(part) is nodes.StarredElement:
                    self.assign(part.value, None, Val(SEQUENCE, item=item_val), scope)
                else:
                    self.assign(part, None, item_val, scope)
        elif kind is nodes.Attribute:
            self.scan(target.value, scope)
            owner = target.value
            info = scope.class_info
            if info is not None and type(owner) is nodes.Name and owner.value == scope.self_name:
                attr = target.attr.value
                previous = info.attrs.get(attr)
                info.attrs[attr] = val if previous is None or previous == val else NOTHING
        elif kind is nodes.Subscript:
            self.scan_target(target, scope)
            self._subscript_event(target, scope)
        elif kind is nodes.StarredElement:
            self.assign(target.value, None, Val(SEQUENCE), scope)

    def bind(self, target, val, scope):
        self.assign(target, None, val, scope)

    def scan_target(self, target, scope):
        """Expressions read while storing to a subscript or attribute target."""
        if type(target) is nodes.Subscript:
            self.scan(target.value, scope)
            for element in target.slice:
                self.scan(element.slice, scope)
        elif type(target) is nodes.Attribute:
            self.scan(target.value, scope)

    def bind_loop_target(self, target, iter_node, scope):
        for name, val in self.inference.loop_bindings(target, iter_node, scope):
            self.assign(name, None, val, scope)

    def _start_accumulation(self, value_node, val, scope):
        if value_node is None:
            return None
        kind = type(value_node)
        if kind is nodes.List:
            has_items = bool(value_node.elements)
            sources = 2 if val.dup else (1 if has_items else 0)
            parts = (
                min(2, len(value_node.elements))
                if not any(type(e) is nodes.StarredElement for e in value_node.elements)
                else 2
            )
            return Accumulation(
                scope.loop_depth, sources, [val.item] if val.item else [], val.dup, parts
            )
        if (
            kind is nodes.Call
            and type(value_node.func) is nodes.Name
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
                if type(node) is nodes.ComparisonTarget and type(node.operator) is nodes.NotIn:
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
                if kind is nodes.Call:
                    self._call_event(node, current)
                elif kind is nodes.Comparison:
                    self._comparison_event(node, current)
                elif kind is nodes.Subscript:
                    self._subscript_event(node, current)
                elif kind is nodes.NamedExpr:
                    self.assign(node.target, node.value, self.infer(node.value, current), current)
                continue
            if kind in _LEAVES:
                continue
            if kind in _COMPREHENSIONS:
                self._scan_comprehension(node, current)
                continue
            if kind is nodes.Lambda:
                env = Env(current.env)
                for param in all_params(node.params):
                    env.vars[param.name.value] = NOTHING
                stack.append((node.body, current.child(env), False))
                continue
            if kind in _EVENTS:
                stack.append((node, current, True))
                if kind is nodes.NamedExpr:
                    stack.append((node.value, current, False))
                    continue
            for child in reversed(children(node)):
                stack.append((child, current, False))

    def _scan_comprehension(self, node, scope):
        child = self.inference.comprehension_scope(node, scope, visit=self.scan)
        if type(node) is nodes.DictComp:
            self.scan(node.key, child)
            self.scan(node.value, child)
        else:
            self.scan(node.elt, child)
        if type(node) in (nodes.SetComp, nodes.DictComp):
            self.events.expression(self.hooks.comprehension, node, child)

    def _call_event(self, call, scope):
        func = call.func
        if type(func) is nodes.Attribute:
            name = func.attr.value
        elif type(func) is nodes.Name:
            name = func.value
        else:
            return
        if name in self.config.free_names:
            self.events.free_call(call, name, scope)
        if type(func) is nodes.Attribute and name in _ACCUMULATING:
            receiver = func.value
            if type(receiver) is nodes.Name:
                accumulation = scope.accumulations.get(receiver.value)
                if accumulation is not None and scope.env.vars.get(receiver.value) is None:
                    args = positional_args(call)
                    value = args[-1].value if args else None
                    self._accumulate(accumulation, name, value, scope)
        if self.hooks.call:
            self.events.expression(self.hooks.call, call, scope)

    def _comparison_event(self, node, scope):
        if self.hooks.comparison:
            self.events.expression(self.hooks.comparison, node, scope)

    def _subscript_event(self, node, scope):
        if self.hooks.subscript:
            self.events.expression(self.hooks.subscript, node, scope)
