"""KVG104: the same ids freed twice on one path of a function.

`alloc.free(ids)` twice with nothing rebinding `ids` (or the allocator) in between
frees every block twice: each goes on the free list twice and is later handed to two
sequences. The check follows the paths through the function: branches that exclude
each other, early returns and `break` are respected; a loop that frees ids it never
rebinds frees them again on its next pass.
"""

import libcst as cst

from ..cstutil import children, names_in, root_name, source_of, walk_all

CODE = "KVG104"
SUMMARY = "the same ids freed twice on one path of a function"
MESSAGE = (
    "KVG104 {callee}({ids}) frees ids that line {{related_line}} already freed, with "
    "nothing rebinding them in between: every block goes on the free list twice; free "
    "once, or rebind the name after freeing"
)
MESSAGE_LOOP = (
    "KVG104 {callee}({ids}) frees the same ids on every pass of the loop, with nothing "
    "rebinding them in between: every block goes on the free list again; free once, "
    "after the loop"
)
FIXABLE = False

BAD = [
    """\
def abort(allocator, seq) -> None:
    allocator.free(seq.block_ids)
    if seq.has_draft:
        seq.draft = None
    allocator.free(seq.block_ids)
""",
    """\
def drop_all(allocator, block_ids, groups) -> None:
    for group in groups:
        allocator.free(block_ids)
""",
]
GOOD = [
    """\
def abort(allocator, seq, preempted: bool) -> None:
    if preempted:
        allocator.free(seq.block_ids)
        return
    allocator.free(seq.block_ids)
""",
    """\
def drop_all(kv_cache, seq, groups: int) -> None:
    for group in range(groups):
        kv_cache.free(seq.block_ids[group], cache_group=group)
""",
    """\
def reuse(allocator, seq) -> None:
    allocator.free(seq.block_ids)
    seq.block_ids = allocator.allocate(4)
    allocator.free(seq.block_ids)
""",
]

_OPAQUE = (
    cst.Call,
    cst.Await,
    cst.Yield,
    cst.NamedExpr,
    cst.Lambda,
    cst.ListComp,
    cst.SetComp,
    cst.DictComp,
    cst.GeneratorExp,
)
_NESTED = (cst.Lambda, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)


class _Key:
    __slots__ = ("free", "text", "names", "id_names")

    def __init__(self, free, text, names, id_names):
        self.free = free
        self.text = text
        self.names = names  # every name the call reads: rebinding any means new ids
        self.id_names = id_names  # names the ids are read from: calls on them may mutate


_SAME_IDS_BUILTINS = frozenset(("list", "tuple", "sorted", "set", "frozenset", "int"))


def _unwrapped(node, ctx, scope):
    """The value under wrappers that keep its ids: `ids.tolist()`, `list(ids)`,
    `tuple()`, `sorted()`, `set()`, `int()`, nested in any order. `free(ids.tolist())`
    then `free(ids)` frees the same ids twice: a KVG101 fix must not hide this."""
    while type(node) is cst.Call:
        func = node.func
        if (
            type(func) is cst.Attribute
            and func.attr.value == "tolist"
            and not node.args
        ):
            node = func.value
            continue
        positional = [arg for arg in node.args if arg.keyword is None]
        if (
            type(func) is cst.Name
            and func.value in _SAME_IDS_BUILTINS
            and len(positional) == 1
            and not positional[0].star
            and (len(node.args) == 1 or func.value == "sorted")
            and (scope is None or ctx.builtin_available(func.value, scope))
        ):
            node = positional[0].value
            continue
        break
    return node


def _key(free, ctx):
    """What identifies "the same ids freed by the same callee", or None when the call
    computes something (a call, await, comprehension) that may differ each time."""
    call = free.call
    args = [_unwrapped(arg.value, ctx, free.scope) for arg in call.args]
    for part in [call.func] + args:
        for node in walk_all(part):
            if isinstance(node, _OPAQUE):
                return None
    text = (
        "".join(source_of(call.func).split())
        + "("
        + ",".join(
            (arg.keyword.value + "=" if arg.keyword is not None else "")
            + "".join(source_of(value).split())
            for arg, value in zip(call.args, args)
        )
        + ")"
    )
    id_names = set()
    for value in args:
        id_names |= names_in(value)
    return _Key(free, text, names_in(call.func) | id_names, id_names)


def _block(suite):
    if type(suite) is cst.SimpleStatementSuite:
        return [cst.SimpleStatementLine(body=suite.body)]
    return suite.body


class _Outcome:
    __slots__ = ("fall", "breaks", "continues")

    def __init__(self):
        self.fall = None
        self.breaks = []
        self.continues = []


def _merge(*states):
    merged = None
    for state in states:
        if state is None:
            continue
        if merged is None:
            merged = dict(state)
        else:
            for text, first in state.items():
                merged.setdefault(text, first)
    return merged


def _reset(state, names):
    if state is None or not names:
        return state
    return {text: first for text, first in state.items() if not (first[1].names & names)}


class _Paths:
    """Walks the statements of one function along its paths."""

    def __init__(self, keys, ctx):
        self.keys = keys  # id(call) -> _Key
        self.ctx = ctx
        self.reported = set()
        # Inside a loop's second pass, nested loops are walked once: their own
        # repeats were found on the first pass, and walking each level twice would
        # cost 2**depth.
        self.single_pass = 0

    def block(self, statements, state):
        outcome = _Outcome()
        for stmt in statements:
            if state is None:
                break
            state = self.statement(stmt, state, outcome)
        outcome.fall = state
        return outcome

    def statement(self, stmt, state, outcome):
        kind = type(stmt)
        if kind is cst.SimpleStatementLine:
            for small in stmt.body:
                state = self.small(small, state, outcome)
                if state is None:
                    return None
            return state
        if kind is cst.If:
            ends = []
            while True:  # an elif chain, without recursing once per elif
                state = self.expression(stmt.test, state)
                taken = self.block(_block(stmt.body), state)
                ends.append(taken.fall)
                outcome.breaks += taken.breaks
                outcome.continues += taken.continues
                orelse = stmt.orelse
                if type(orelse) is cst.If:
                    stmt = orelse
                    continue
                if orelse is None:
                    ends.append(state)
                else:
                    other = self.block(_block(orelse.body), state)
                    ends.append(other.fall)
                    outcome.breaks += other.breaks
                    outcome.continues += other.continues
                return _merge(*ends)
        if kind in (cst.For, cst.While):
            return self.loop(stmt, state, outcome)
        if kind in (cst.Try, cst.TryStar):
            body = self.block(_block(stmt.body), state)
            ends = []
            for handler in stmt.handlers:
                names = set()
                if handler.name is not None:
                    names = names_in(handler.name.name)
                handled = self.block(_block(handler.body), _reset(state, names))
                ends.append(handled.fall)
                outcome.breaks += handled.breaks
                outcome.continues += handled.continues
            after_body = body.fall
            if stmt.orelse is not None and after_body is not None:
                orelse = self.block(_block(stmt.orelse.body), after_body)
                after_body = orelse.fall
                outcome.breaks += orelse.breaks
                outcome.continues += orelse.continues
            outcome.breaks += body.breaks
            outcome.continues += body.continues
            merged = _merge(after_body, *ends)
            if stmt.finalbody is not None:
                start = merged if merged is not None else state
                final = self.block(_block(stmt.finalbody.body), start)
                outcome.breaks += final.breaks
                outcome.continues += final.continues
                return final.fall if merged is not None else None
            return merged
        if kind is cst.With:
            for item in stmt.items:
                state = self.expression(item.item, state)
                if item.asname is not None:
                    state = _reset(state, names_in(item.asname.name))
            inner = self.block(_block(stmt.body), state)
            outcome.breaks += inner.breaks
            outcome.continues += inner.continues
            return inner.fall
        if kind is cst.Match:
            state = self.expression(stmt.subject, state)
            ends = []
            for case in stmt.cases:
                case_state = _reset(state, names_in(case.pattern))
                inner = self.block(_block(case.body), case_state)
                outcome.breaks += inner.breaks
                outcome.continues += inner.continues
                ends.append(inner.fall)
            return _merge(state, *ends)
        if kind in (cst.FunctionDef, cst.ClassDef):
            return _reset(state, {stmt.name.value})
        for child in children(stmt):
            if isinstance(child, cst.BaseExpression):
                state = self.expression(child, state)
        return state

    def loop(self, stmt, state, outcome):
        targets = set()
        if type(stmt) is cst.For:
            state = self.expression(stmt.iter, state)
            targets = names_in(stmt.target)
        else:
            state = self.expression(stmt.test, state)
        entry = _reset(state, targets)
        first = self.block(_block(stmt.body), dict(entry))
        back = _merge(first.fall, *first.continues)
        exits = [entry, back] + first.breaks
        if back is not None and not self.single_pass:
            again = _reset(_merge(entry, back), targets)
            if type(stmt) is cst.While:
                again = self.expression(stmt.test, again)
            self.single_pass += 1
            try:
                second = self.block(_block(stmt.body), again)
            finally:
                self.single_pass -= 1
            exits += [second.fall] + second.continues + second.breaks
        normal_exit = _merge(*exits[:2])
        if stmt.orelse is not None:
            orelse = self.block(_block(stmt.orelse.body), normal_exit)
            outcome.breaks += orelse.breaks
            outcome.continues += orelse.continues
            return _merge(orelse.fall, *exits[2:])
        return _merge(*exits)

    def small(self, small, state, outcome):
        kind = type(small)
        if kind is cst.Return or kind is cst.Raise:
            for child in children(small):
                state = self.expression(child, state)
            return None
        if kind is cst.Break:
            outcome.breaks.append(state)
            return None
        if kind is cst.Continue:
            outcome.continues.append(state)
            return None
        if kind is cst.Assign:
            state = self.expression(small.value, state)
            for target in small.targets:
                state = self.store(target.target, state)
            return state
        if kind is cst.AnnAssign:
            if small.value is not None:
                state = self.expression(small.value, state)
                state = self.store(small.target, state)
            return state
        if kind is cst.AugAssign:
            state = self.expression(small.value, state)
            return self.store(small.target, state)
        if kind is cst.Del:
            return self.store(small.target, state)
        if kind in (cst.Import, cst.ImportFrom):
            names = set()
            if not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    bound = alias.asname.name if alias.asname is not None else alias.name
                    names |= names_in(bound)
            return _reset(state, names)
        for child in children(small):
            if isinstance(child, cst.BaseExpression):
                state = self.expression(child, state)
        return state

    def store(self, target, state):
        kind = type(target)
        if kind in (cst.Tuple, cst.List):
            for element in target.elements:
                state = self.store(element.value, state)
            return state
        if kind is cst.StarredElement:
            return self.store(target.value, state)
        if kind is not cst.Name:
            state = self.expression(target, state)
        root = root_name(target)
        return _reset(state, {root} if root else set())

    def expression(self, node, state):
        """Apply the calls of an expression in evaluation order (arguments first)."""
        if state is None:
            return None
        stack = [(node, False, False)]
        while stack:
            current, done, nested = stack.pop()
            kind = type(current)
            if done:
                if kind is cst.Call:
                    state = self.call(current, state, nested)
                elif kind is cst.NamedExpr:
                    state = _reset(state, names_in(current.target))
                continue
            if kind in (cst.Call, cst.NamedExpr):
                stack.append((current, True, nested))
            inner = nested or isinstance(current, _NESTED)
            for child in reversed(children(current)):
                stack.append((child, False, inner))
        return state

    def call(self, call, state, nested):
        key = self.keys.get(id(call))
        if key is None:
            if _unwrapped(call, self.ctx, None) is not call:
                return state  # ids.tolist(), list(ids), ...: read the ids, change nothing
            touched = set()
            func = call.func
            if type(func) is cst.Attribute:
                root = root_name(func.value)
                if root:
                    touched.add(root)
            for arg in call.args:
                root = root_name(arg.value)
                if root:
                    touched.add(root)
            return {
                text: first for text, first in state.items() if not (first[1].id_names & touched)
            }
        if nested:
            return state
        previous = state.get(key.text)
        if previous is not None:
            self.report(key, previous[1])
            return state
        state = dict(state)
        state[key.text] = (call, key)
        return state

    def report(self, key, first):
        call = key.free.call
        if id(call) in self.reported:
            return
        self.reported.add(id(call))
        ids = self.ctx.short(key.free.ids)
        if first.free.call is call:
            message = MESSAGE_LOOP.format(callee=key.free.callee, ids=ids)
            self.ctx.report(CODE, call, message)
        else:
            message = MESSAGE.format(callee=key.free.callee, ids=ids)
            self.ctx.report(CODE, call, message, related=first.free.call)


def check_function(node, free_calls, ctx):
    keys = {}
    for free in free_calls:
        key = _key(free, ctx)
        if key is not None:
            keys[id(free.call)] = key
    if not keys:
        return
    if len(keys) == 1 and not _inside_loop(node, next(iter(keys.values())).free.call):
        return
    body = node.body if type(node) is cst.Module else _block(node.body)
    _Paths(keys, ctx).block(body, {})


def _inside_loop(function, call):
    """Whether a call sits in a loop of the function (cheap check before the walk)."""
    stack = [(function, False)]
    while stack:
        current, in_loop = stack.pop()
        if current is call:
            return in_loop
        if current is not function and type(current) in (cst.FunctionDef, cst.ClassDef, cst.Lambda):
            continue
        looping = in_loop or type(current) in (cst.For, cst.While)
        for child in children(current):
            stack.append((child, looping))
    return False
