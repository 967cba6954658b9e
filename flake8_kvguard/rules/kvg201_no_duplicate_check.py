"""KVG201: a free-like method validates ids one by one but never rejects duplicates.

DeepSpeed 0.19.8 `BlockedAllocator.free` checks each id against its state ("already
free?") in one loop and mutates in a second: `free([0, 0, 1])` passes validation,
block 0 goes on the free list twice, the free count is off by one and block 0 is later
handed to two sequences. Validating each id is not enough; reject repeats within the
call too.
"""

from .. import effects, freeing, fuzzcmd, nodes

from ..cstutil import dotted_name, root_name, walk
from ..freeing import collection_names, iterates

CODE = "KVG201"
SUMMARY = "free-like method validates ids one by one but never rejects duplicates"
MESSAGE = (
    "KVG201 {method}() validates '{param}' id by id but never rejects an id repeated "
    "within the call: free([b, b]) passes and puts b on the free list twice; check "
    "len(set(ids)) != len(ids) before changing any state{fuzz}"
)
FIXABLE = False

BAD = [
    """\
class BlockedAllocator:
    def free(self, blocks):
        for block in blocks:
            if block < 0 or block >= self._num_blocks:
                raise ValueError(f"Invalid block {block} provided to free")
            if self._blocks[block] != -1:
                raise ValueError(f"Block {block} is already free")
        for block in blocks:
            self._blocks[block] = self._head
            self._head = block
            self._free_blocks += 1
""",
    """\
class RefPool:
    def release(self, block_ids):
        for b in block_ids:
            if b < 0 or b >= self.num_blocks:  # a range check: a repeat passes it
                raise ValueError(f"block {b} out of range")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_list.append(b)
""",
]
GOOD = [
    """\
import operator

class BlockedAllocator:
    def free(self, blocks):
        ids = [operator.index(block) for block in blocks]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate block ids")
        for block in ids:
            if self._blocks[block] != -1:
                raise ValueError(f"Block {block} is already free")
        for block in ids:
            self._blocks[block] = self._head
            self._head = block
""",
    """\
import operator

class Pool:
    def free(self, blocks):
        for block in blocks:
            block = operator.index(block)
            if self._is_free[block]:
                raise ValueError(f"Block {block} is already free")
            self._is_free[block] = True  # a repeat fails the check above
""",
]

_DEDUP_CALLS = frozenset(
    ("set", "frozenset", "Counter", "fromkeys", "unique", "unique_consecutive")
)
_MUTATORS = frozenset(
    ("add", "append", "appendleft", "remove", "discard", "pop", "put", "push", "extend")
)
_CHECKS = (nodes.Raise, nodes.Assert)


def _validation_loops(function, names):
    loops = []
    for node in walk(function.body):
        if type(node) is nodes.For and iterates(node.iter, names):
            if any(type(inner) in _CHECKS for inner in walk(node.body)):
                loops.append(node)
        elif type(node) in (nodes.Assert, nodes.If):
            test = node.test
            checks = type(node) is nodes.Assert or any(
                type(inner) is nodes.Raise for inner in walk(node.body)
            )
            if checks and _validates_each(test, names):
                loops.append(node)
    return loops


def _validates_each(test, names):
    for node in walk(test):
        if type(node) in (nodes.GeneratorExp, nodes.ListComp) and iterates(node.for_in.iter, names):
            return True
    return False


def _deduplicates(function, names):
    for node in walk(function.body):
        if type(node) is nodes.Call:
            dotted = dotted_name(node.func)
            last = dotted.rpartition(".")[2] if dotted else None
            if last in _DEDUP_CALLS:
                return True
    return False


def _mutates_per_id(loop):
    """A loop that changes state for each id catches a repeat with its own check."""
    if type(loop) is not nodes.For:
        return False
    target = loop.target.value if type(loop.target) is nodes.Name else None
    for node in walk(loop.body):
        kind = type(node)
        if kind is nodes.Assign or kind is nodes.AugAssign:
            targets = [t.target for t in node.targets] if kind is nodes.Assign else [node.target]
            for target_node in targets:
                if type(target_node) is nodes.Subscript and root_name(target_node.value) not in (
                    None,
                    target,
                ):
                    return True
        elif kind is nodes.Del:
            return True
        elif (
            kind is nodes.Call
            and type(node.func) is nodes.Attribute
            and node.func.attr.value in _MUTATORS
        ):
            return True
    # A membership test (`if b in self._free: raise`) checks each id against state
    # but catches a repeat only if the same loop then changes that state.
    return False


def _checks_state_per_id(loop, names, owner):
    """A loop that changes state for each id and, before that, tests the state of each
    (already free, past zero): a repeat fails the test. A range test alone does not
    catch one."""
    if not _mutates_per_id(loop):
        return False
    if type(loop.target) is not nodes.Name:
        return True
    item = loop.target.value
    if freeing.per_occurrence_change(loop, item, owner) is None:
        return True  # stores only (`self._blocks[b] = -1`): a repeat stores it again
    return effects.CHECK_FREE in effects.checks_in(loop.body, set(names) | {item}, owner)


def check_free_method(method, ctx):
    if not method.int_ids:
        return
    function = method.function
    names = collection_names(function, method.param)
    loops = _validation_loops(function, names)
    if not loops or any(_checks_state_per_id(loop, names, method.self_name) for loop in loops):
        return
    if _deduplicates(function, names):
        return
    message = MESSAGE.format(fuzz=fuzzcmd.for_method(method, CODE), method=function.name.value, param=method.param)
    ctx.report(CODE, function.name, message)
