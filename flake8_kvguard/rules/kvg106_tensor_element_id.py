"""KVG106: a 0-dim tensor element used as an id in a free-like call.

`t[i]` and the items of `for b in t` are 0-dim tensors, not ints: they hash by
identity (an allocator's `in`/set checks miss them) and index a tensor as tensors.
Pass int(t[i]). `--fix` writes int() only where the element is proven 0-dim (the
tensor's rank is shown: `torch.arange`, `.flatten()`, `.view(-1)`, `torch.zeros(4, 8)`
indexed twice): `t[0]` of a 2-D table is a row, and int() of a row raises.
"""

from .. import nodes

from ..rewrites import builtin_call
from ..values import ELEMENT, SEQUENCE, is_bool

CODE = "KVG106"
SUMMARY = "a 0-dim tensor element used as an id in a free-like call"
MESSAGE = (
    "KVG106 {callee}() gets a 0-dim tensor element as block id: it hashes by identity "
    "and indexes as a tensor; pass int({ids})"
)
MESSAGE_MANY = (
    "KVG106 {callee}() gets 0-dim tensor elements as block ids: they hash by identity "
    "and index as tensors; pass ints, e.g. t.tolist() rather than list(t)"
)
FIXABLE = True

BAD = [
    """\
import torch

def drop_last(allocator, first: int, last: int) -> None:
    block_ids = torch.arange(first, last)
    allocator.free(block_ids[-1])
""",
    """\
import torch

def drop(allocator, block_ids: torch.Tensor) -> None:
    for block in block_ids.flatten():
        allocator.free_block(block)
""",
    """\
import torch

def drop(allocator, block_ids: torch.Tensor) -> None:
    flat = block_ids.view(-1)
    allocator.free([flat[0], flat[1]])
""",
    """\
import torch

def drop_last(allocator, block_ids: torch.Tensor) -> None:
    allocator.free(block_ids[-1])  # a row if block_ids is a table: not rewritten
""",
]
FIXED = [
    """\
import torch

def drop_last(allocator, first: int, last: int) -> None:
    block_ids = torch.arange(first, last)
    allocator.free(int(block_ids[-1]))
""",
    """\
import torch

def drop(allocator, block_ids: torch.Tensor) -> None:
    for block in block_ids.flatten():
        allocator.free_block(int(block))
""",
    """\
import torch

def drop(allocator, block_ids: torch.Tensor) -> None:
    flat = block_ids.view(-1)
    allocator.free([int(flat[0]), int(flat[1])])
""",
    None,
]
GOOD = [
    """\
import torch

def drop_last(allocator, block_ids: torch.Tensor) -> None:
    allocator.free(int(block_ids[-1]))
""",
    """\
import torch

def drop(allocator, block_ids: torch.Tensor) -> None:
    for block in block_ids.tolist():
        allocator.free_block(block)
""",
]


def check_free_call(call, ctx):
    val = call.val
    if is_bool(val):
        return  # KVG103: a bool is rejected, never coerced with int()
    ids = call.ids
    scope = call.scope
    if val.kind == ELEMENT:
        ctx.report(CODE, ids, _message(call, ctx.short(ids)), fix=_int_fix(ids, ctx, scope))
        return
    if val.kind != SEQUENCE or val.item is None or val.item.kind != ELEMENT:
        return
    if type(ids) in (nodes.List, nodes.Tuple):
        for element in ids.elements:
            if type(element) is nodes.Element and ctx.infer(element.value, scope).kind == ELEMENT:
                value = element.value
                ctx.report(
                    CODE, value, _message(call, ctx.short(value)), fix=_int_fix(value, ctx, scope)
                )
        return
    if type(ids) in (nodes.ListComp, nodes.GeneratorExp) and ids.for_in.inner_for_in is None:
        child = ctx.comprehension_scope(ids, scope)
        if ctx.infer(ids.elt, child).kind == ELEMENT:
            ctx.report(
                CODE, ids.elt, _message(call, ctx.short(ids.elt)), fix=_int_fix(ids.elt, ctx, child)
            )
            return
    ctx.report(CODE, ids, MESSAGE_MANY.format(callee=call.name))


def _message(call, ids):
    return MESSAGE.format(callee=call.name, ids=ids)


def _int_fix(node, ctx, scope):
    """int(x) only where x is proven a 0-dim element: an index of a tensor whose rank
    the code shows, or an item of a 1-D one. `tables[0]` of `torch.zeros(4, 8)` is a
    row, and int() of a row raises."""
    if not ctx.builtin_available("int", scope):
        return None
    if ctx.infer(node, scope).ndim != 0:
        return None
    return (node, builtin_call("int", node))
