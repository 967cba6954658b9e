"""KVG103: a bool used as block id(s).

`free(True)` frees block 1 to anything that calls int() or operator.index() on it,
while `blocks[True] = x` and `blocks[mask] = x` overwrite every selected element of a
tensor. A bool is never an id: pass the ids a mask selects, not the mask.
"""

from ..values import BOOL, ELEMENT, SEQUENCE, TENSOR, is_bool

CODE = "KVG103"
SUMMARY = "a bool used as block id(s): literal, comparison, mask"
MESSAGE = (
    "KVG103 {callee}() gets {what} as block ids: True is id 1 to int() but selects "
    "everything as a tensor index; pass the ids themselves, e.g. "
    "mask.nonzero().flatten().tolist()"
)
FIXABLE = False

BAD = [
    """\
def evict(allocator) -> None:
    allocator.free(True)
""",
    """\
import torch

def evict(allocator, seq_lens: torch.Tensor) -> None:
    allocator.free(seq_lens == 0)
""",
    """\
import torch

def evict(allocator, num_blocks: int) -> None:
    done = torch.zeros(num_blocks, dtype=torch.bool)
    allocator.free(done)
""",
]
GOOD = [
    """\
import torch

def evict(allocator, block_ids: torch.Tensor, done: torch.Tensor) -> None:
    allocator.free(block_ids[done].tolist())
""",
    """\
def evict(allocator, block_id: int) -> None:
    allocator.free(block_id)
""",
]


def describe(val):
    if val.note:
        return val.note
    if val.kind == BOOL:
        return "a bool"
    if val.kind == TENSOR:
        return "a bool mask"
    if val.kind == ELEMENT:
        return "a bool tensor element"
    if val.kind == SEQUENCE:
        return "bools"
    return "a bool"


def check_free_call(call, ctx):
    val = call.val
    if is_bool(val):
        what = describe(val)
        if val.kind == SEQUENCE:
            what = "a list of bools"
        ctx.report(CODE, call.ids, MESSAGE.format(callee=call.name, what=what))
