"""What a method does to its allocator's state, whatever the method is called.

An allocator's release method is known by its body, not its name: it puts the ids it
is given back on a free list, a free deque, set or tensor (`self.free.append(b)`,
`self.free_pages = torch.cat((self.free_pages, ids))`, `self.free_slots[n] = b`),
drops a reference per id (`self.refs[b] -= 1`, `block.ref_cnt -= 1`, or a method of
the block's class that decrements its own count: `page.sub_ref()`), or clears a
bitmap (`self.used[b] = False`). `summarize` names those changes (`Effects`) and the
checks that guard them; the index keeps one summary per method (`Effects.code`) so
that a call site elsewhere knows what the method it reaches does.

The state is told by its name (a free list is called free/avail/empty..., a count
ref/cnt/count, a bitmap used/alloc/busy): what the method is called does not matter.
"""

from __future__ import annotations

from . import nodes

from .cstutil import dotted_name, root_name, walk
from .freeing import DEDUP_CALLS, aliases, iterates_ids

FREE_WORDS = ("free", "avail", "empty", "unused", "idle", "vacant", "spare", "recycl", "reusable")
COUNT_WORDS = ("ref", "cnt", "count", "usage", "pin")
USED_WORDS = ("used", "alloc", "busy", "occupied", "in_use", "taken", "live")
PUSH_ONE = frozenset("append appendleft put put_nowait push insert".split())
PUSH_ALL = frozenset("extend extendleft".split())
SET_ADD = frozenset(("add",))
SET_ADD_ALL = frozenset(("update",))
DROP = frozenset(("remove", "discard", "pop"))
CONCATENATIONS = frozenset(("cat", "concat", "concatenate", "hstack", "append"))
GENERIC = frozenset(
    "append appendleft extend extendleft add update insert put put_nowait push pop remove "
    "discard clear set get copy __init__ __call__ __setitem__ __delitem__ __exit__ "
    "__del__ reset close".split()
)
"""Method names never taken for releases by behaviour: containers have them too."""

# Effects.code letters: kinds, then how, then checks.
PUSH, DECREMENT, CLEAR = "p", "d", "c"
EACH, ALL, ONE = "e", "a", "o"
CHECK_DUP, CHECK_FREE, CHECK_RANGE, CHECK_INT = "u", "f", "r", "i"


def _has_word(name, words) -> bool:
    name = name.lower()
    return any(word in name for word in words)


def _state_attr(node, owner):
    """`free` for self.free / self.free[...] / self.pool.free, when rooted at `owner`."""
    if owner is None or root_name(node) != owner:
        return None
    while type(node) is nodes.Subscript:
        node = node.value
    if type(node) is nodes.Attribute:
        return node.attr.value
    return None


class Effects:
    """What one method does with the ids it is given: `kinds` (PUSH, DECREMENT,
    CLEAR), `how` (EACH id in a loop, ALL at once, ONE id: the parameter itself),
    `checks` (CHECK_DUP, CHECK_FREE already-free or past-zero, CHECK_RANGE, CHECK_INT),
    `node` the first change found."""

    __slots__ = ("kinds", "how", "checks", "node", "param", "source")

    def __init__(self, kinds, how, checks, node, param, source):
        self.kinds = kinds
        self.how = how
        self.checks = checks
        self.node = node
        self.param = param
        self.source = source  # the expression the ids come from: "seq.block_table"

    @property
    def code(self) -> str:
        """The summary as the index keeps it: "pd/e/fr"."""
        return "".join(sorted(self.kinds)) + "/" + self.how + "/" + "".join(sorted(self.checks))

    @property
    def releases(self) -> bool:
        return bool(self.kinds)


def releases_code(code) -> bool:
    return bool(code) and code[:1] in (PUSH, DECREMENT, CLEAR)


def summarize(function, self_name, param, decrementers=frozenset()):
    """The Effects of a method on its own instance's state, or None when it changes
    none with the ids of `param`. `decrementers` names methods (of any class in the
    project) that decrement their own instance's count: `block.decr_ref()`."""
    if self_name is None or param is None:
        return None
    names = aliases(function, param)
    one = {param}  # the id itself, and names holding it converted: slot = int(req_idx)
    for node in walk(function.body):
        if (
            type(node) is nodes.Assign
            and type(node.value) is nodes.Call
            and _is_id(node.value, one)
            and len(node.targets) == 1
        ):
            target = node.targets[0].target
            if type(target) is nodes.Name:
                one.add(target.value)
    names |= one
    kinds = set()
    first = None
    how = None
    for loop, item, source in iterates_ids(function, names):
        found = _per_item(loop.body, {item}, self_name, decrementers)
        if found:
            kinds.update(k for k, _ in found)
            first = first or found[0][1]
            how = how or EACH
            source_text = dotted_name(source) or param
    if how is None:
        # One id, or all at once? `self.free.append(x)` and an `int` annotation say
        # one; `self.free.extend(x)`, `self.refs[x] -= 1` alone say all.
        single = _per_item(function.body, one, self_name, decrementers, single=True)
        batched = _batched(function, names, self_name)
        if single and (not batched or _annotated_int(function, param) or any(
            k == PUSH for k, _ in single
        )):
            found, how = single, ONE
        else:
            found, how = batched, ALL if batched else None
        if found:
            kinds.update(k for k, _ in found)
            first = found[0][1]
            source_text = param
    if not kinds:
        return None
    checks = _checks(function, names, self_name)
    return Effects(frozenset(kinds), how, frozenset(checks), first, param, source_text)


def _annotated_int(function, param) -> bool:
    for p in function.params.params:
        if p.name.value == param and p.annotation is not None:
            annotation = p.annotation.annotation
            return type(annotation) is nodes.Name and annotation.value == "int"
    return False


def _mentions(node, names) -> bool:
    return any(type(n) is nodes.Name and n.value in names for n in walk(node))


def _is(node, names) -> bool:
    return type(node) is nodes.Name and node.value in names


def _is_id(node, names) -> bool:
    """An id of `names`, as it is or converted: `b`, `int(b)`, `operator.index(b)`."""
    if type(node) is nodes.Call and len(node.args) == 1:
        func = (dotted_name(node.func) or "").rpartition(".")[2]
        if func in ("int", "index"):
            node = node.args[0].value
    return _is(node, names)


def _index_of(subscript, names) -> bool:
    return (
        len(subscript.slice) == 1
        and type(subscript.slice[0].slice) is nodes.Index
        and _is(subscript.slice[0].slice.value, names)
    )


def _per_item(body, items, owner, decrementers, single=False):
    """[(kind, node)] for the changes made with one id (an item of the loop, or the
    parameter itself when `single`)."""
    found = []
    for node in walk(body):
        kind = type(node)
        if kind is nodes.AugAssign and type(node.operator) is nodes.SubtractAssign:
            target = node.target
            if type(target) is nodes.Subscript and _index_of(target, items):
                attr = _state_attr(target.value, owner)
                if attr is not None and _has_word(attr, COUNT_WORDS):
                    found.append((DECREMENT, node))
            elif (
                not single
                and type(target) is nodes.Attribute
                and _is(target.value, items)
                and _has_word(target.attr.value, COUNT_WORDS)
            ):
                found.append((DECREMENT, node))
        elif kind is nodes.Call and type(node.func) is nodes.Attribute:
            method = node.func.attr.value
            receiver = node.func.value
            args = [a.value for a in node.args if a.keyword is None]
            if not single and _is(receiver, items) and method in decrementers:
                found.append((DECREMENT, node))
                continue
            attr = _state_attr(receiver, owner)
            if attr is None:
                continue
            if (
                method in PUSH_ONE
                and args
                and _is_id(args[-1], items)
                and _has_word(attr, FREE_WORDS)
            ):
                found.append((PUSH, node))
            elif method in DROP and args and _is(args[0], items) and _has_word(attr, USED_WORDS):
                found.append((CLEAR, node))
        elif kind is nodes.Call and (dotted_name(node.func) or "").endswith("heappush"):
            if len(node.args) == 2 and _is_id(node.args[1].value, items):
                attr = _state_attr(node.args[0].value, owner)
                if attr is not None and _has_word(attr, FREE_WORDS):
                    found.append((PUSH, node))
        elif kind is nodes.Assign:
            for target in node.targets:
                target = target.target
                if type(target) is not nodes.Subscript:
                    continue
                attr = _state_attr(target.value, owner)
                if attr is None:
                    continue
                value = node.value
                if _index_of(target, items) and type(value) is nodes.Name:
                    cleared = (value.value == "False" and _has_word(attr, USED_WORDS)) or (
                        value.value == "True" and _has_word(attr, FREE_WORDS)
                    )
                    if cleared:
                        found.append((CLEAR, node))
                elif (
                    _is_id(value, items)
                    and _has_word(attr, FREE_WORDS)
                    and not any(type(e.slice) is nodes.Slice for e in target.slice)
                ):
                    found.append((PUSH, node))  # self.free_slots[self.n_free] = b
        elif kind is nodes.Del:
            target = node.target
            if type(target) is nodes.Subscript and _index_of(target, items):
                attr = _state_attr(target.value, owner)
                if attr is not None and _has_word(attr, USED_WORDS):
                    found.append((CLEAR, node))
    return found


def _batched(function, names, owner):
    found = []
    for node in walk(function.body):
        kind = type(node)
        if kind is nodes.Call and type(node.func) is nodes.Attribute:
            attr = _state_attr(node.func.value, owner)
            method = node.func.attr.value
            args = [a.value for a in node.args if a.keyword is None]
            if attr is None or not args or not _mentions(args[0], names):
                continue
            if method in PUSH_ALL and _has_word(attr, FREE_WORDS):
                found.append((PUSH, node))
        elif kind is nodes.AugAssign:
            target = node.target
            attr = _state_attr(target, owner)
            if attr is None:
                continue
            if (
                type(node.operator) is nodes.SubtractAssign
                and type(target) is nodes.Subscript
                and _index_of(target, names)
                and _has_word(attr, COUNT_WORDS)
            ):
                found.append((DECREMENT, node))
            elif type(node.operator) is nodes.AddAssign and (
                _is(node.value, names) or type(node.value) in (nodes.List, nodes.ListComp)
            ):
                if type(target) is nodes.Attribute and _has_word(attr, FREE_WORDS):
                    found.append((PUSH, node))  # self.free_list += ids
        elif kind is nodes.Assign:
            for target in node.targets:
                target = target.target
                attr = _state_attr(target, owner)
                if attr is None or not _has_word(attr, FREE_WORDS):
                    continue
                value = node.value
                if type(target) is nodes.Subscript and all(
                    type(e.slice) is nodes.Slice for e in target.slice
                ):
                    if _mentions(value, names):
                        found.append((PUSH, node))  # self.free[a:b] = ids
                elif type(target) is nodes.Attribute and _concatenates(value, target, names):
                    found.append((PUSH, node))  # self.free = torch.cat((self.free, ids))
    return found


def _concatenates(value, target, names) -> bool:
    if type(value) is nodes.BinaryOperation and type(value.operator) is nodes.Add:
        parts = [value.left, value.right]
    elif type(value) is nodes.Call and value.args:
        dotted = dotted_name(value.func) or ""
        if dotted.rpartition(".")[2] not in CONCATENATIONS:
            return False
        first = value.args[0].value
        if type(first) not in (nodes.Tuple, nodes.List):
            return False
        parts = [e.value for e in first.elements]
    else:
        return False
    text = dotted_name(target)
    return any(dotted_name(p) == text for p in parts) and any(
        _mentions(p, names) for p in parts if dotted_name(p) != text
    )


def _checks(function, names, owner):
    """What guards the changes: a de-duplication, an already-free or past-zero test
    (one that reads the allocator's state or the item's count), a range test, an int
    normalisation."""
    ids = set(names)
    for loop, item, _ in iterates_ids(function, names):
        ids.add(item)
    return checks_in(function.body, ids, owner)


def checks_in(body, ids, owner):
    """The checks (CHECK_*) made on `ids` within `body`."""
    found = set()
    for node in walk(body):
        kind = type(node)
        if kind is nodes.Call:
            dotted = dotted_name(node.func) or ""
            last = dotted.rpartition(".")[2]
            if last in DEDUP_CALLS:
                found.add(CHECK_DUP)
            elif last in ("index", "int", "isinstance", "__index__"):
                found.add(CHECK_INT)
        elif kind in (nodes.If, nodes.Assert, nodes.While):
            if kind is not nodes.Assert and not _stops(node.body):
                # A test around a change guards it only as a membership test
                # (`if b not in self.free: self.free.append(b)`); `if refs[b] == 0:`
                # says when to push, not whether b was held.
                if _changes_state(node.body, owner) and _tests_membership(node.test, ids, owner):
                    found.add(CHECK_FREE)
                continue
            for part in walk(node.test):
                if type(part) is nodes.Comparison:
                    found.update(_comparison_checks(part, ids, owner))
                elif type(part) is nodes.Subscript and _index_of(part, ids):
                    if _state_attr(part.value, owner) is not None:
                        found.add(CHECK_FREE)  # if self.is_free[b]: raise
                elif type(part) is nodes.Attribute and _is(part.value, ids):
                    if _has_word(part.attr.value, COUNT_WORDS + FREE_WORDS + USED_WORDS):
                        found.add(CHECK_FREE)  # if block.ref_cnt <= 0: raise
    return found


def _comparison_checks(comparison, ids, owner):
    found = set()
    left = comparison.left
    for target in comparison.comparisons:
        op = type(target.operator)
        right = target.comparator
        if op in (nodes.In, nodes.NotIn):
            if _mentions(left, ids) and root_name(right) == owner:
                found.add(CHECK_FREE)  # b in self.free
        elif _mentions(left, ids) or _mentions(right, ids):
            reads_state = any(
                type(p) is nodes.Subscript and _state_attr(p.value, owner) is not None
                for side in (left, right)
                for p in walk(side)
            )
            found.add(CHECK_FREE if reads_state else CHECK_RANGE)
        left = right
    return found


def _tests_membership(test, ids, owner) -> bool:
    for part in walk(test):
        if type(part) is nodes.Comparison and CHECK_FREE in _comparison_checks(part, ids, owner):
            if any(type(t.operator) in (nodes.In, nodes.NotIn) for t in part.comparisons):
                return True
    return False


def _changes_state(body, owner) -> bool:
    """Whether `body` changes the allocator's state (a test around it guards it:
    `if b not in self.free: self.free.append(b)`)."""
    for node in walk(body):
        kind = type(node)
        if kind is nodes.AugAssign and root_name(node.target) == owner:
            return True
        if kind is nodes.Assign and any(
            type(t.target) is nodes.Subscript and root_name(t.target) == owner
            for t in node.targets
        ):
            return True
        if (
            kind is nodes.Call
            and type(node.func) is nodes.Attribute
            and node.func.attr.value in PUSH_ONE | PUSH_ALL | SET_ADD | DROP
            and root_name(node.func.value) == owner
        ):
            return True
    return False


def _stops(body) -> bool:
    return any(
        type(n) in (nodes.Raise, nodes.Continue, nodes.Return, nodes.Assert) for n in walk(body)
    )


def decrements_itself(function, self_name) -> bool:
    """A method that drops its own instance's count (`def sub_ref(self): self.ref_cnt
    -= 1`): called on a block, it releases a reference."""
    if self_name is None:
        return False
    for node in walk(function.body):
        if (
            type(node) is nodes.AugAssign
            and type(node.operator) is nodes.SubtractAssign
            and type(node.target) is nodes.Attribute
            and _is(node.target.value, {self_name})
            and _has_word(node.target.attr.value, COUNT_WORDS)
        ):
            return True
    return False
