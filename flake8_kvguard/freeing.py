"""What a free-like method does with the ids it is given (KVG201-KVG204).

A free corrupts an allocator on a repeated id when it changes state once per
occurrence, or for the whole array at once, and nothing rejects the repeat first.
This module reads one method body and names those changes:

- collection names: the parameter and the names that only re-wrap it
  (`blocks = [blocks]`, `ids = list(blocks)`), and loops that iterate one of them;
- aliases: the parameter and every name that holds it or a selection of it
  (`freed = blocks`, `freed = blocks[ref == 0]`, `ids = list(blocks)`);
- per-occurrence changes in a loop over the ids: a refcount decremented on the item
  (`block.ref_cnt -= 1`, `self.refs[b] -= 1`) or the item pushed on allocator state
  (`self.free.append(b)`, `heappush(self.free, b)`);
- batched changes: a refcount decremented for all ids at once
  (`self.refs[blocks] -= 1`, `np.add.at(self.refs, blocks, -1)`,
  `self.refs.index_add_(0, blocks, ...)`, or a method of the same class that does it);
  the ids pushed at once (`self.free.extend(freed)`, `self.free[a:b] = freed`,
  `self.free = torch.cat((self.free, freed))`);
- guards: a raise or assert, a de-duplication (`unique`, `set`, `Counter`,
  `dict.fromkeys`, `bincount`), or a loop that skips ids (`continue`).

What it cannot know: what a call to another object does (`self.pool.free(ids)` may
validate), whether callers can ever pass a repeat, and whether a guard it sees checks
the right thing: any raise or assert counts as validation.
"""

from __future__ import annotations

from . import nodes

from .cstutil import dotted_name, root_name, walk

DEDUP_CALLS = frozenset(
    "set frozenset Counter fromkeys unique unique_consecutive bincount".split()
)
PUSHES = frozenset("append appendleft extend extendleft put put_nowait push insert".split())
BATCH_PUSHES = frozenset(("extend", "extendleft"))
CONCATENATIONS = frozenset(("cat", "concat", "concatenate", "hstack", "append"))
SCATTER_METHODS = frozenset(("index_add_", "scatter_add_", "index_put_", "put_"))
UFUNC_AT = frozenset(("add", "subtract"))


def aliases(function, param) -> set:
    """The parameter and the names holding it, a wrapping or a selection of it."""
    names = {param}
    changed = True
    while changed:
        changed = False
        for node in walk(function.body):
            if type(node) is not nodes.Assign:
                continue
            value = node.value
            if not _derived(value, names):
                continue
            for target in node.targets:
                if type(target.target) is nodes.Name and target.target.value not in names:
                    names.add(target.target.value)
                    changed = True
    return names


def _derived(value, names) -> bool:
    kind = type(value)
    if kind is nodes.Name:
        return value.value in names
    if kind is nodes.IfExp:  # ids = [x] if isinstance(x, int) else x
        return _derived(value.body, names) or _derived(value.orelse, names)
    if kind in (nodes.List, nodes.Tuple) and len(value.elements) == 1:
        return _derived(value.elements[0].value, names)  # ids = [x]
    if _ids_of_argument(value, names):
        return True  # ids = seq.block_table
    if kind is nodes.Subscript:
        return type(value.value) is nodes.Name and value.value.value in names
    if kind is nodes.Call:
        func = value.func
        if type(func) is nodes.Name and func.value in ("list", "tuple", "sorted") and value.args:
            return _derived(value.args[0].value, names)
        if type(func) is nodes.Attribute and func.attr.value in ("tolist", "copy", "clone"):
            return _derived(func.value, names)
    return False


def _is_state(node, owner) -> bool:
    return owner is not None and root_name(node) == owner


def guards(function, names) -> bool:
    """A raise, an assert or a de-duplication anywhere, or a `continue` (a loop that skips
    some). In a loop over the ids, a skip on a test that only tells a kind of block
    (`if block.is_null: continue`, `if block.pool is not self: continue`) lets a repeated
    id through and is no check."""
    kinds_only = set()
    for loop, _ in loops_over(function, names):
        for node in walk(loop.body):
            if type(node) is nodes.If and _tests_kind_only(node.test):
                kinds_only.update(id(n) for n in walk(node.body) if type(n) is nodes.Continue)
    for node in walk(function.body):
        kind = type(node)
        if kind in (nodes.Raise, nodes.Assert):
            return True
        if kind is nodes.Call:
            dotted = dotted_name(node.func)
            if dotted is not None and dotted.rpartition(".")[2] in DEDUP_CALLS:
                return True
        if kind is nodes.Continue and id(node) not in kinds_only:
            return True
    return False


STATE_WORDS = ("free", "release", "ref", "count", "alloc", "use", "live", "owner", "hold")
"""Words in a flag's name that speak of a block's state (`block.freed`, `block.in_use`): a
skip on such a flag can be a repeat check."""


def _tests_kind_only(test) -> bool:
    """A condition that reads only flags and identities of the item (`block.is_null`,
    `block.pool is not self`, `x is None`), never state that changes when a block is freed:
    no membership test, no comparison of values, no call, no subscript, no flag named for
    state."""
    kind = type(test)
    if kind is nodes.BooleanOperation:
        return _tests_kind_only(test.left) and _tests_kind_only(test.right)
    if kind is nodes.UnaryOperation and type(test.operator) is nodes.Not:
        return _tests_kind_only(test.expression)
    if kind is nodes.Comparison:
        return _is_flag_or_name(test.left) and all(
            type(c.operator) in (nodes.Is, nodes.IsNot) and _is_flag_or_name(c.comparator)
            for c in test.comparisons)
    return _is_flag_or_name(test)


def _is_flag_or_name(node) -> bool:
    kind = type(node)
    if kind is nodes.Name:
        return True
    if kind is nodes.Attribute and type(node.value) is nodes.Name:
        name = node.attr.value.lower()
        return not any(word in name for word in STATE_WORDS)
    return False


def loops_over(function, names):
    """`for x in ids` loops (also over list(ids), enumerate(ids), and an attribute of
    the argument: `for b in seq.block_table`), with x's name."""
    return [(loop, item) for loop, item, _ in iterates_ids(function, names)]


ID_SEQUENCE_WORDS = ("block", "page", "slot", "ids", "indices", "index", "table")
"""An attribute of the argument that holds its ids (`seq.block_table`, `req.pages`)."""


def _ids_of_argument(source, names) -> bool:
    """`seq.block_table` or `seq.get_block_ids()` for an argument `seq`."""
    if type(source) is nodes.Call and not source.args:
        source = source.func
    if type(source) is not nodes.Attribute or not _is_name_in(source.value, names):
        return False
    attr = source.attr.value.lower()
    return any(word in attr for word in ID_SEQUENCE_WORDS) and not attr.startswith(("num", "n_"))


def iterates_ids(function, names):
    """(loop, item name, iterated expression) for each `for x in ids` loop over one of
    names (also list(ids), enumerate(ids), sorted(ids)...) or over the ids an argument
    carries (`for b in seq.block_table`)."""
    found = []
    for node in walk(function.body):
        if type(node) is not nodes.For:
            continue
        source = node.iter
        target = node.target
        if (
            type(source) is nodes.Call
            and type(source.func) is nodes.Name
            and source.func.value in ("list", "tuple", "sorted", "reversed", "enumerate")
            and source.args
        ):
            if source.func.value == "enumerate":
                if type(target) in (nodes.Tuple, nodes.List) and len(target.elements) == 2:
                    target = target.elements[1].value
                else:
                    continue
            source = source.args[0].value
        if type(target) is not nodes.Name:
            continue
        if (type(source) is nodes.Name and source.value in names) or _ids_of_argument(
            source, names
        ):
            found.append((node, target.value, source))
    return found


def per_occurrence_change(loop, item, owner, decrementers=frozenset()):
    """(node, what) for the first change of state the loop makes per id, or None.
    `decrementers` names the methods that drop their own instance's count
    (`block.decr_ref()`, found by what their bodies do)."""
    for node in walk(loop.body):
        kind = type(node)
        if (
            kind is nodes.Call
            and type(node.func) is nodes.Attribute
            and node.func.attr.value in decrementers
            and _is_name_in(node.func.value, {item})
        ):
            return node, "decrements the refcount of each"
        if kind is nodes.AugAssign and type(node.operator) is nodes.SubtractAssign:
            target = node.target
            if type(target) is nodes.Attribute and root_name(target) == item:
                return node, "decrements the refcount of each"
            if (
                type(target) is nodes.Subscript
                and _is_state(target.value, owner)
                and _index_is(target, {item})
            ):
                return node, "decrements the refcount of each"
        elif kind is nodes.Call and type(node.func) is nodes.Attribute:
            if node.func.attr.value in PUSHES and _is_state(node.func.value, owner):
                if any(_mentions(arg.value, {item}) for arg in node.args):
                    return node, "pushes each"
        elif kind is nodes.Call and (dotted_name(node.func) or "").endswith("heappush"):
            if len(node.args) == 2 and _is_state(node.args[0].value, owner):
                if _mentions(node.args[1].value, {item}):
                    return node, "pushes each"
    return None


def batched_decrement(function, names, owner, helpers):
    """The first statement that decrements refcounts for all ids at once, or None.
    `helpers` maps names of the class's own methods to their FunctionDef."""
    for node in walk(function.body):
        kind = type(node)
        if kind is nodes.AugAssign and type(node.operator) is nodes.SubtractAssign:
            target = node.target
            if (
                type(target) is nodes.Subscript
                and _is_state(target.value, owner)
                and _index_is(target, names)
            ):
                return node
        elif kind is nodes.Call:
            if _ufunc_at(node, names, owner) or _scatter(node, names, owner):
                return node
            func = node.func
            if (
                type(func) is nodes.Attribute
                and type(func.value) is nodes.Name
                and func.value.value == owner
                and func.attr.value in helpers
                and node.args
                and _mentions(node.args[0].value, names)
            ):
                helper = helpers[func.attr.value]
                params = [p.name.value for p in helper.params.params]
                if len(params) >= 2 and _decrements_all(helper, params[0], params[1]):
                    return node
    return None


def _decrements_all(helper, self_name, param) -> bool:
    for node in walk(helper.body):
        if type(node) is nodes.Call and (
            _ufunc_at(node, {param}, self_name, any_sign=True)
            or _scatter(node, {param}, self_name)
        ):
            return True
        if (
            type(node) is nodes.AugAssign
            and type(node.operator) in (nodes.SubtractAssign, nodes.AddAssign)
            and type(node.target) is nodes.Subscript
            and _is_state(node.target.value, self_name)
            and _index_is(node.target, {param})
        ):
            return True
    return False


def _ufunc_at(call, names, owner, any_sign=False) -> bool:
    """np.add.at(self.refs, ids, -1) / np.subtract.at(self.refs, ids, 1)."""
    func = call.func
    if not (
        type(func) is nodes.Attribute
        and func.attr.value == "at"
        and type(func.value) is nodes.Attribute
        and func.value.attr.value in UFUNC_AT
    ):
        return False
    args = call.args
    if len(args) < 2 or not _is_state(args[0].value, owner):
        return False
    if not _mentions(args[1].value, names):
        return False
    if any_sign or func.value.attr.value == "subtract":
        return True
    return len(args) >= 3 and type(args[2].value) is nodes.UnaryOperation


def _scatter(call, names, owner) -> bool:
    """self.refs.index_add_(0, ids, -ones) and the like."""
    func = call.func
    return (
        type(func) is nodes.Attribute
        and func.attr.value in SCATTER_METHODS
        and _is_state(func.value, owner)
        and any(_mentions(arg.value, names) for arg in call.args)
    )


def batched_push(function, names, owner):
    """The first statement that puts all of the ids (or a selection) on allocator state
    at once, or None."""
    for node in walk(function.body):
        kind = type(node)
        if kind is nodes.Call and type(node.func) is nodes.Attribute:
            if (
                node.func.attr.value in BATCH_PUSHES
                and _is_state(node.func.value, owner)
                and node.args
                and _derived(node.args[0].value, names)
            ):
                return node
        elif kind is nodes.Assign:
            for target in node.targets:
                target = target.target
                if (
                    type(target) is nodes.Subscript
                    and _is_state(target.value, owner)
                    and all(type(e.slice) is nodes.Slice for e in target.slice)
                    and _derived(node.value, names)
                ):
                    return node  # self.free[a:b] = freed
                if _is_state(target, owner) and _concatenates(node.value, target, names):
                    return node  # self.free = torch.cat((self.free, freed))
    return None


def _concatenates(value, target, names) -> bool:
    if type(value) is not nodes.Call or not value.args:
        return False
    dotted = dotted_name(value.func) or ""
    if dotted.rpartition(".")[2] not in CONCATENATIONS or "." not in dotted:
        return False
    parts = value.args[0].value
    if type(parts) not in (nodes.Tuple, nodes.List):
        return False
    values = [e.value for e in parts.elements]
    target_text = dotted_name(target)
    return any(_derived(v, names) for v in values) and any(
        dotted_name(v) == target_text for v in values
    )


def _is_name_in(node, names) -> bool:
    return type(node) is nodes.Name and node.value in names


def _index_is(subscript, names) -> bool:
    return (
        len(subscript.slice) == 1
        and type(subscript.slice[0].slice) is nodes.Index
        and _is_name_in(subscript.slice[0].slice.value, names)
    )


def _mentions(node, names) -> bool:
    return any(type(n) is nodes.Name and n.value in names for n in walk(node))


def class_methods(class_info) -> dict:
    """{name: FunctionDef} of the methods a class defines in its own body."""
    found = {}
    body = class_info.node.body
    for stmt in getattr(body, "body", ()):
        if type(stmt) is nodes.FunctionDef:
            found[stmt.name.value] = stmt
    return found


def iterates(node, names):
    """`for x in P`, `for x in list(P)`, `for i, x in enumerate(P)` over one of names."""
    if type(node) is nodes.Name:
        return node.value in names
    if (
        type(node) is nodes.Call
        and type(node.func) is nodes.Name
        and node.func.value in ("list", "tuple", "enumerate", "sorted")
    ):
        return bool(node.args) and iterates(node.args[0].value, names)
    return False


def collection_names(function, param):
    """The parameter and the names that only re-wrap it (`blocks = [blocks]`)."""
    names = {param}
    for node in walk(function.body):
        if (
            type(node) is nodes.Assign
            and len(node.targets) == 1
            and type(node.targets[0].target) is nodes.Name
        ):
            value = node.value
            wraps = False
            if type(value) is nodes.Name:
                wraps = value.value in names  # an alias: freed = blocks
            elif type(value) in (nodes.List, nodes.Tuple) and len(value.elements) == 1:
                element = value.elements[0].value
                wraps = type(element) is nodes.Name and element.value in names
            elif iterates(value, names):
                wraps = True
            elif type(value) in (nodes.ListComp, nodes.GeneratorExp) and iterates(
                value.for_in.iter, names
            ):
                wraps = value.for_in.inner_for_in is None  # [operator.index(b) for b in blocks]
            if wraps:
                names.add(node.targets[0].target.value)
    return names
