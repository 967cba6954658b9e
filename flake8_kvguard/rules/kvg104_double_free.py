"""KVG104: the same ids freed twice on one path of a function.

`alloc.free(ids)` twice with nothing rebinding `ids` (or the allocator) in between
frees every block twice: each goes on the free list twice and is later handed to two
sequences. The check follows the paths through the function: branches that exclude
each other, early returns and `break` are respected; a loop that frees ids it never
rebinds frees them again on its next pass.
"""

from .. import nodes

from ..analysis.paths import PathWalker, inside_loop
from ..analysis.syntax import block_body
from ..cstutil import names_in, root_name, walk_all

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
    nodes.Call,
    nodes.Await,
    nodes.Yield,
    nodes.NamedExpr,
    nodes.Lambda,
    nodes.ListComp,
    nodes.SetComp,
    nodes.DictComp,
    nodes.GeneratorExp,
)


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
    while type(node) is nodes.Call:
        func = node.func
        if type(func) is nodes.Attribute and func.attr.value == "tolist" and not node.args:
            node = func.value
            continue
        positional = [arg for arg in node.args if arg.keyword is None]
        if (
            type(func) is nodes.Name
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
        "".join(ctx.source_of(call.func).split())
        + "("
        + ",".join(
            (arg.keyword.value + "=" if arg.keyword is not None else "")
            + "".join(ctx.source_of(value).split())
            for arg, value in zip(call.args, args)
        )
        + ")"
    )
    id_names = set()
    for value in args:
        id_names |= names_in(value)
    return _Key(free, text, names_in(call.func) | id_names, id_names)


class _DoubleFrees:
    """The flow of KVG104 for `PathWalker`: the state maps each free already made on
    the path ("the same ids freed by the same callee", as text) to (call, _Key)."""

    def __init__(self, keys, ctx):
        self.keys = keys  # id(call) -> _Key
        self.ctx = ctx
        self.reported = set()

    def merge(self, states):
        merged = dict(states[0])
        for state in states[1:]:
            for text, first in state.items():
                merged.setdefault(text, first)
        return merged

    def rebind(self, state, names):
        return {text: first for text, first in state.items() if not (first[1].names & names)}

    def call(self, call, state, nested):
        key = self.keys.get(id(call))
        if key is None:
            if _unwrapped(call, self.ctx, None) is not call:
                return state  # ids.tolist(), list(ids), ...: read the ids, change nothing
            touched = set()
            func = call.func
            if type(func) is nodes.Attribute:
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
    if len(keys) == 1 and not inside_loop(node, next(iter(keys.values())).free.call):
        return
    body = node.body if type(node) is nodes.Module else block_body(node.body)
    PathWalker(_DoubleFrees(keys, ctx)).block(body, {})
