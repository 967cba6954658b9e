"""KVG202: a free-like method indexes or stores state with ids it did not normalize.

`self._blocks[block] = self._head` with `block` straight from the caller: a bool
`True` indexes (or overwrites) the whole tensor, a 0-dim tensor element stored as the
free-list head hashes by identity and drags a tensor into every later allocation.
Normalize each id once at the top of free(): reject bools, then operator.index().
"""

from .. import fuzzcmd, nodes

from ..cstutil import dotted_name, root_name, walk
from ..freeing import collection_names, iterates

CODE = "KVG202"
SUMMARY = "free-like method indexes or stores state with ids it did not normalize to int"
MESSAGE = (
    "KVG202 {method}() {how} allocator state with '{name}' as the caller passed it: a "
    "bool indexes the whole tensor and a 0-dim tensor hashes by identity; normalize "
    "each id first (reject bools, then operator.index){fuzz}"
)
FIXABLE = False

BAD = [
    """\
class BlockedAllocator:
    def free(self, blocks):
        for block in blocks:
            self._blocks[block] = self._head
            self._head = block
""",
    """\
class Pool:
    def release_blocks(self, block_ids):
        self.free_list.extend(block_ids)
""",
]
GOOD = [
    """\
import operator

class BlockedAllocator:
    def free(self, blocks):
        ids = []
        for block in blocks:
            if isinstance(block, bool):
                raise TypeError("a bool is not a block id")
            ids.append(operator.index(block))
        for block in ids:
            self._blocks[block] = self._head
            self._head = block
""",
    """\
from typing import Iterable

class BlockPool:
    def free_blocks(self, ordered_blocks: Iterable["KVCacheBlock"]) -> None:
        blocks = list(ordered_blocks)
        if len(set(map(id, blocks))) != len(blocks):
            raise ValueError("a block is listed twice")
        for block in blocks:
            block.ref_cnt -= 1
            self.free_block_queue.append(block)
""",
]

_STORES = frozenset(("append", "appendleft", "add", "extend", "insert", "put", "push", "update"))
_NORMALIZERS = frozenset(("int", "index", "item", "isinstance", "type", "tolist"))
_ID_METHODS = frozenset(("item", "tolist", "__index__", "__int__", "bit_length"))


def check_free_method(method, ctx):
    if method.tensor_param or method.self_name is None or not method.int_ids:
        return
    if method.detected and _annotated(method):
        return  # a method no name made free-like, whose caller is told to pass ints
    function = method.function
    owner = method.self_name
    collections = collection_names(function, method.param)
    ids = set(collections)  # names holding caller-given ids, unnormalized
    objects = set()  # ids used as objects (`block.ref_cnt`): not ids at all
    uses = []  # (node, name, how)
    for node in walk(function.body):
        kind = type(node)
        if kind is nodes.For:
            if iterates(node.iter, collections):
                target = node.target
                if type(target) in (nodes.Tuple, nodes.List) and len(target.elements) == 2:
                    target = target.elements[1].value  # enumerate(P)
                if type(target) is nodes.Name:
                    ids.add(target.value)
        elif kind is nodes.Assign:
            value = node.value
            for assigned in node.targets:
                target = assigned.target
                if (
                    type(target) is nodes.Name
                    and target.value in ids
                    and target.value not in collections
                ):
                    ids.discard(target.value)  # rebound: normalized or replaced
                elif (
                    type(target) is nodes.Name and target.value in collections and _normalizes(value)
                ):
                    ids.discard(target.value)
                    collections = collections - {target.value}
                elif root_name(target) == owner and type(value) is nodes.Name and value.value in ids:
                    uses.append((value, value.value, "stores into"))
        elif kind is nodes.Call:
            callee = dotted_name(node.func)
            last = callee.rpartition(".")[2] if callee else None
            if last in _NORMALIZERS:
                for arg in node.args:
                    if (
                        type(arg.value) is nodes.Name
                        and arg.value.value in ids
                        and arg.value.value not in collections
                    ):
                        ids.discard(arg.value.value)
            elif type(node.func) is nodes.Attribute and node.func.attr.value in _STORES:
                if root_name(node.func.value) == owner:
                    for arg in node.args:
                        if type(arg.value) is nodes.Name and arg.value.value in ids:
                            uses.append((arg.value, arg.value.value, "stores into"))
            elif (
                last == "heappush"
                and len(node.args) == 2
                and root_name(node.args[0].value) == owner
            ):
                arg = node.args[1].value
                if type(arg) is nodes.Name and arg.value in ids:
                    uses.append((arg, arg.value, "stores into"))
        elif kind is nodes.Subscript:
            if root_name(node.value) == owner and len(node.slice) == 1:
                index = node.slice[0].slice
                if (
                    type(index) is nodes.Index
                    and type(index.value) is nodes.Name
                    and index.value.value in ids
                ):
                    uses.append((index.value, index.value.value, "indexes"))
        elif kind is nodes.Attribute:
            if (
                type(node.value) is nodes.Name
                and node.value.value in ids
                and node.attr.value not in _ID_METHODS
            ):
                objects.add(node.value.value)
    uses = [use for use in uses if use[1] not in objects]
    if not uses:
        return
    node, name, how = uses[0]
    ctx.report(CODE, node, MESSAGE.format(fuzz=fuzzcmd.for_method(method, CODE), method=function.name.value, how=how, name=name))


def _normalizes(value):
    """`ids = [int(b) for b in ids]`, `ids = ids.tolist()`, `list(map(int, ids))`."""
    if type(value) in (nodes.ListComp, nodes.GeneratorExp, nodes.SetComp):
        elt = value.elt
        return (
            type(elt) is nodes.Call
            and (dotted_name(elt.func) or "").rpartition(".")[2] in _NORMALIZERS
        )
    if type(value) is nodes.Call:
        for node in walk(value):
            if type(node) is nodes.Name and node.value in ("int", "index", "tolist"):
                return True
            if (
                type(node) is nodes.Call
                and type(node.func) is nodes.Attribute
                and node.func.attr.value in ("tolist", "item")
            ):
                return True
    return False


def _annotated(method) -> bool:
    for param in method.function.params.params:
        if param.name.value == method.param:
            return param.annotation is not None
    return False
