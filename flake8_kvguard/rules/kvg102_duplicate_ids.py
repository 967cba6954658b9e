"""KVG102: ids that may repeat, passed to a free-like call.

An allocator that validates each id against its own state (DeepSpeed 0.19.8) lets
`free([0, 0, 1])` through: block 0 goes on the free list twice and is later handed to
two sequences. Ids gathered from several sources (concatenation, unpacking,
itertools.chain, append/extend in loops) repeat as soon as two sources share a
block, as prefix-shared sequences do. De-duplicate on the way, or keep the sources
provably disjoint.
"""

from .. import nodes
from ..values import OBJECT, SEQUENCE, UNKNOWN

CODE = "KVG102"
SUMMARY = "possibly duplicated ids passed to a free-like call"
MESSAGE = (
    "KVG102 {callee}() gets ids that may repeat ({reason}): a block freed twice in one "
    "call goes on the free list twice; de-duplicate first, e.g. list(dict.fromkeys(ids))"
)
FIXABLE = False

BAD = [
    """\
def finish(allocator, prefix_blocks: list[int], own_blocks: list[int]) -> None:
    allocator.free(prefix_blocks + own_blocks)
""",
    """\
def finish(allocator, seq, fork) -> None:
    allocator.free(seq.block_ids + fork.block_ids)  # a fork shares its prefix blocks
""",
    """\
import itertools

def finish(allocator, seqs) -> None:
    allocator.free(list(itertools.chain(*[s.blocks for s in seqs])))
""",
    """\
def finish(allocator, seqs) -> None:
    ids = []
    for seq in seqs:
        ids.extend(seq.block_ids)
    allocator.free(ids)
""",
    """\
import torch

def finish(allocator, a: torch.Tensor, b: torch.Tensor) -> None:
    allocator.free(torch.cat([a, b]).tolist())
""",
]
GOOD = [
    """\
def finish(allocator, prefix_blocks: list[int], own_blocks: list[int]) -> None:
    allocator.free(list(dict.fromkeys(prefix_blocks + own_blocks)))
""",
    """\
def finish(allocator, seqs) -> None:
    ids = []
    for seq in seqs:
        for block in seq.block_ids:
            if block not in ids:
                ids.append(block)
    allocator.free(ids)
""",
    """\
def finish(allocator, seq) -> None:
    ids = []
    for block in seq.block_ids:
        ids.append(block)
    allocator.free(ids)
""",
]


def check_free_call(call, ctx):
    reason = call.val.dup
    if not reason and _concatenates_id_lists(call.ids, call.scope, ctx):
        reason = "concatenation of two id lists"
    if reason:
        ctx.report(CODE, call.ids, MESSAGE.format(callee=call.name, reason=reason))


_ID_LIST_ENDINGS = ("ids", "blocks", "pages", "slots", "indices", "table", "tables", "list")
_COUNT_STARTS = ("num", "n_", "len", "count", "total", "max", "min")


def _concatenates_id_lists(node, scope, ctx) -> bool:
    """`a + b` where each side holds ids by what is known of it or by its name
    (`seq.block_ids + other.block_ids`, `prefix_pages + new_pages`): what inference
    cannot type, the names tell; a number on either side makes it a sum."""
    if type(node) is not nodes.BinaryOperation or type(node.operator) is not nodes.Add:
        return False
    return all(_holds_ids(side, scope, ctx) for side in (node.left, node.right))


def _holds_ids(node, scope, ctx) -> bool:
    if type(node) is nodes.BinaryOperation and type(node.operator) is nodes.Add:
        return _concatenates_id_lists(node, scope, ctx)
    val = ctx.infer(node, scope)
    if val.kind == SEQUENCE:
        return True
    if val.kind not in (UNKNOWN, OBJECT) and val.kind is not None:
        return False
    if type(node) is nodes.Call and not node.args:
        node = node.func  # seq.get_block_ids()
    if type(node) is nodes.Attribute:
        name = node.attr.value
    elif type(node) is nodes.Name:
        name = node.value
    else:
        return type(node) in (nodes.List, nodes.ListComp)
    name = name.lower()
    return name.endswith(_ID_LIST_ENDINGS) and not name.startswith(_COUNT_STARTS)
