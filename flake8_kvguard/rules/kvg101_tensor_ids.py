"""KVG101: a torch tensor passed as ids to a free-like call that does not take tensors.

The elements of a tensor are 0-dim tensors: they hash by identity, so the allocator's
`in`/set/dict checks never see a duplicate or an already-free id, and `blocks[t] = x`
indexes with a tensor. DeepSpeed 0.19.8 `DSStateManager.flush_sequence` frees
`seq.all_block_ids()`, a `torch.Tensor`, this way.
"""

from ..rewrites import method_call
from ..values import TENSOR, is_bool

CODE = "KVG101"
SUMMARY = "torch tensor passed as ids to a free-like call that does not take tensors"
MESSAGE = (
    "KVG101 {callee}() gets a torch.Tensor as block ids: its elements are 0-dim tensors "
    "that hash by identity, so duplicate and already-free ids go unnoticed; "
    "pass {ids}.tolist()"
)
FIXABLE = True

BAD = [
    """\
import torch

def flush(allocator, seq) -> None:
    ids = torch.cat(seq.block_groups)
    allocator.free(ids)
""",
    """\
import torch

class Sequence:
    def all_block_ids(self) -> torch.Tensor:
        return self._ids

def flush(kv_cache, seq: Sequence) -> None:
    kv_cache.free(seq.all_block_ids())
""",
    """\
from torch import Tensor

def release(pool, block_table: Tensor, row: int) -> None:
    pool.release_blocks(block_table[row, 1:])
""",
]
FIXED = [
    """\
import torch

def flush(allocator, seq) -> None:
    ids = torch.cat(seq.block_groups)
    allocator.free(ids.tolist())
""",
    """\
import torch

class Sequence:
    def all_block_ids(self) -> torch.Tensor:
        return self._ids

def flush(kv_cache, seq: Sequence) -> None:
    kv_cache.free(seq.all_block_ids().tolist())
""",
    """\
from torch import Tensor

def release(pool, block_table: Tensor, row: int) -> None:
    pool.release_blocks(block_table[row, 1:].tolist())
""",
]
GOOD = [
    """\
def flush(allocator, seq) -> None:
    allocator.free(seq.all_block_ids().tolist())
""",
    """\
import torch

class TokenAllocator:
    def free(self, free_index: torch.Tensor) -> None:
        if torch.unique(free_index).numel() != free_index.numel():
            raise ValueError("repeated ids")
        self.free_pages = torch.cat((self.free_pages, free_index))

def release(allocator: TokenAllocator, indices: torch.Tensor) -> None:
    allocator.free(indices)  # free() is annotated to take a tensor
""",
]


UNSURE = (
    " (the receiver's class is unknown here, and of the project's {callee}() methods some "
    "take tensors and some do not: name its class, e.g. with an annotation, if this one "
    "takes tensors)"
)


def check_free_call(call, ctx):
    val = call.val
    if val.kind != TENSOR or is_bool(val):
        return
    if call.tensor_native and not (call.unsure and not val.optional):
        return
    message = MESSAGE.format(callee=call.name, ids=ctx.short(call.ids))
    fix = None
    if call.unsure:
        message += UNSURE.format(callee=call.name)  # no fix: this one may take tensors
    elif not val.optional:
        fix = (call.ids, method_call(call.ids, "tolist"))
    ctx.report(CODE, call.ids, message, fix=fix)
