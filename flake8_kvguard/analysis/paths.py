"""A path-sensitive walk over one function, for rules that need flow (KVG104).

`PathWalker` follows the statements of a function along its paths: the branches of
an `if`/`elif`/`match` and the handlers of a `try` exclude each other and merge
after; `return`, `raise`, `break` and `continue` end a path where they stand; a loop
body is walked twice (entry, then as reached again), so that what its first pass
does is seen by its second. It carries a rule's state along each path and leaves its
meaning to a `flow` object:

- `flow.call(call, state, nested)`: the state after a call (arguments are applied
  first, in evaluation order); `nested` is true inside a lambda or comprehension,
  which may not run;
- `flow.rebind(state, names)`: the state after `names` are bound anew;
- `flow.merge(states)`: one state for paths that join (a list of at least one).

A state is any value the flow likes, never changed in place (the walker hands the
same state to several branches); `None` means no path reaches the point.
"""

from __future__ import annotations

from .. import nodes

from ..cstutil import children, names_in, root_name
from .syntax import block_body

_NESTED = (nodes.Lambda, nodes.ListComp, nodes.SetComp, nodes.DictComp, nodes.GeneratorExp)


class Outcome:
    """Where the paths of a block end: falling through, at `break`, at `continue`."""

    __slots__ = ("fall", "breaks", "continues")

    def __init__(self):
        self.fall = None
        self.breaks = []
        self.continues = []


class PathWalker:
    """Walks the statements of one function along its paths (see the module)."""

    def __init__(self, flow):
        self.flow = flow
        # Inside a loop's second pass, nested loops are walked once: their own
        # effects were seen on the first pass, and walking each level twice would
        # cost 2**depth.
        self.single_pass = 0

    def merge(self, *states):
        reached = [state for state in states if state is not None]
        return self.flow.merge(reached) if reached else None

    def rebind(self, state, names):
        if state is None or not names:
            return state
        return self.flow.rebind(state, names)

    def block(self, statements, state):
        outcome = Outcome()
        for stmt in statements:
            if state is None:
                break
            state = self.statement(stmt, state, outcome)
        outcome.fall = state
        return outcome

    def statement(self, stmt, state, outcome):
        kind = type(stmt)
        if kind is nodes.SimpleStatementLine:
            for small in stmt.body:
                state = self.small(small, state, outcome)
                if state is None:
                    return None
            return state
        if kind is nodes.If:
            ends = []
            while True:  # an elif chain, without recursing once per elif
                state = self.expression(stmt.test, state)
                taken = self.block(block_body(stmt.body), state)
                ends.append(taken.fall)
                outcome.breaks += taken.breaks
                outcome.continues += taken.continues
                orelse = stmt.orelse
                if type(orelse) is nodes.If:
                    stmt = orelse
                    continue
                if orelse is None:
                    ends.append(state)
                else:
                    other = self.block(block_body(orelse.body), state)
                    ends.append(other.fall)
                    outcome.breaks += other.breaks
                    outcome.continues += other.continues
                return self.merge(*ends)
        if kind in (nodes.For, nodes.While):
            return self.loop(stmt, state, outcome)
        if kind in (nodes.Try, nodes.TryStar):
            body = self.block(block_body(stmt.body), state)
            ends = []
            for handler in stmt.handlers:
                names = set()
                if handler.name is not None:
                    names = names_in(handler.name.name)
                handled = self.block(block_body(handler.body), self.rebind(state, names))
                ends.append(handled.fall)
                outcome.breaks += handled.breaks
                outcome.continues += handled.continues
            after_body = body.fall
            if stmt.orelse is not None and after_body is not None:
                orelse = self.block(block_body(stmt.orelse.body), after_body)
                after_body = orelse.fall
                outcome.breaks += orelse.breaks
                outcome.continues += orelse.continues
            outcome.breaks += body.breaks
            outcome.continues += body.continues
            merged = self.merge(after_body, *ends)
            if stmt.finalbody is not None:
                start = merged if merged is not None else state
                final = self.block(block_body(stmt.finalbody.body), start)
                outcome.breaks += final.breaks
                outcome.continues += final.continues
                return final.fall if merged is not None else None
            return merged
        if kind is nodes.With:
            for item in stmt.items:
                state = self.expression(item.item, state)
                if item.asname is not None:
                    state = self.rebind(state, names_in(item.asname.name))
            inner = self.block(block_body(stmt.body), state)
            outcome.breaks += inner.breaks
            outcome.continues += inner.continues
            return inner.fall
        if kind is nodes.Match:
            state = self.expression(stmt.subject, state)
            ends = []
            for case in stmt.cases:
                case_state = self.rebind(state, names_in(case.pattern))
                inner = self.block(block_body(case.body), case_state)
                outcome.breaks += inner.breaks
                outcome.continues += inner.continues
                ends.append(inner.fall)
            return self.merge(state, *ends)
        if kind in (nodes.FunctionDef, nodes.ClassDef):
            return self.rebind(state, {stmt.name.value})
        for child in children(stmt):
            if isinstance(child, nodes.BaseExpression):
                state = self.expression(child, state)
        return state

    def loop(self, stmt, state, outcome):
        targets = set()
        if type(stmt) is nodes.For:
            state = self.expression(stmt.iter, state)
            targets = names_in(stmt.target)
        else:
            state = self.expression(stmt.test, state)
        entry = self.rebind(state, targets)
        first = self.block(block_body(stmt.body), entry)
        back = self.merge(first.fall, *first.continues)
        exits = [entry, back] + first.breaks
        if back is not None and not self.single_pass:
            again = self.rebind(self.merge(entry, back), targets)
            if type(stmt) is nodes.While:
                again = self.expression(stmt.test, again)
            self.single_pass += 1
            try:
                second = self.block(block_body(stmt.body), again)
            finally:
                self.single_pass -= 1
            exits += [second.fall] + second.continues + second.breaks
        normal_exit = self.merge(*exits[:2])
        if stmt.orelse is not None:
            orelse = self.block(block_body(stmt.orelse.body), normal_exit)
            outcome.breaks += orelse.breaks
            outcome.continues += orelse.continues
            return self.merge(orelse.fall, *exits[2:])
        return self.merge(*exits)

    def small(self, small, state, outcome):
        kind = type(small)
        if kind is nodes.Return or kind is nodes.Raise:
            for child in children(small):
                state = self.expression(child, state)
            return None
        if kind is nodes.Break:
            outcome.breaks.append(state)
            return None
        if kind is nodes.Continue:
            outcome.continues.append(state)
            return None
        if kind is nodes.Assign:
            state = self.expression(small.value, state)
            for target in small.targets:
                state = self.store(target.target, state)
            return state
        if kind is nodes.AnnAssign:
            if small.value is not None:
                state = self.expression(small.value, state)
                state = self.store(small.target, state)
            return state
        if kind is nodes.AugAssign:
            state = self.expression(small.value, state)
            return self.store(small.target, state)
        if kind is nodes.Del:
            return self.store(small.target, state)
        if kind in (nodes.Import, nodes.ImportFrom):
            names = set()
            if not isinstance(small.names, nodes.ImportStar):
                for alias in small.names:
                    bound = alias.asname.name if alias.asname is not None else alias.name
                    names |= names_in(bound)
            return self.rebind(state, names)
        for child in children(small):
            if isinstance(child, nodes.BaseExpression):
                state = self.expression(child, state)
        return state

    def store(self, target, state):
        kind = type(target)
        if kind in (nodes.Tuple, nodes.List):
            for element in target.elements:
                state = self.store(element.value, state)
            return state
        if kind is nodes.StarredElement:
            return self.store(target.value, state)
        if kind is not nodes.Name:
            state = self.expression(target, state)
        root = root_name(target)
        return self.rebind(state, {root} if root else set())

    def expression(self, node, state):
        """Apply the calls of an expression in evaluation order (arguments first)."""
        if state is None:
            return None
        stack = [(node, False, False)]
        while stack:
            current, done, nested = stack.pop()
            kind = type(current)
            if done:
                if kind is nodes.Call:
                    state = self.flow.call(current, state, nested)
                elif kind is nodes.NamedExpr:
                    state = self.rebind(state, names_in(current.target))
                continue
            if kind in (nodes.Call, nodes.NamedExpr):
                stack.append((current, True, nested))
            inner = nested or isinstance(current, _NESTED)
            for child in reversed(children(current)):
                stack.append((child, False, inner))
        return state


def inside_loop(function, node):
    """Whether `node` sits in a loop of `function` (not of a nested def or lambda): a
    cheap test before a path walk."""
    stack = [(function, False)]
    while stack:
        current, in_loop = stack.pop()
        if current is node:
            return in_loop
        if current is not function and type(current) in (nodes.FunctionDef, nodes.ClassDef, nodes.Lambda):
            continue
        looping = in_loop or type(current) in (nodes.For, nodes.While)
        for child in children(current):
            stack.append((child, looping))
    return False
