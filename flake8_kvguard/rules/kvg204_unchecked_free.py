"""KVG204: a free-like method changes state once per id with no check at all.

aphrodite-engine 0.24.1 `BlockPool.free_blocks` decrements `block.ref_cnt` once per
block in the list and queues the block when it reaches zero, with no check: a block
listed twice loses a reference it does not own and is queued while its other owner
still uses it (the class of vllm#42571). The same holds for a free that pushes each
id, or the whole batch, on a free list without any validation. Reject repeats (and
already-free ids) before changing state. What it cannot know: whether callers can
pass a repeat, or whether the free list itself tolerates one (a set does: `add` is
not counted as a push); any raise, assert or de-duplication in the method counts as
a check, and so does a `continue`, unless it is in the loop over the ids and its
condition only tells a kind of block (a flag or an identity of the item:
`if block.is_null: continue`), which lets a repeat through.
"""

from .. import effects, freeing, fuzzcmd
from ..cstutil import dotted_name

CODE = "KVG204"
SUMMARY = "free-like method changes allocator state once per id with no validation at all"
MESSAGE = (
    "KVG204 {method}() {what} id in '{param}' with no check at all: an id passed twice "
    "is released twice (a reference it does not own, a second slot on the free list) "
    "and later handed to two owners; reject repeated and already-free ids before "
    "changing state{fuzz}"
)
FIXABLE = False

BAD = [
    """\
from typing import Iterable

class BlockPool:
    def free_blocks(self, ordered_blocks: Iterable["KVCacheBlock"]) -> None:
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
""",
    """\
import torch

class TokenAllocator:
    def free(self, free_index: torch.Tensor) -> None:
        self.free_pages = torch.cat((self.free_pages, free_index))
""",
    """\
from typing import Iterable

class BlockPool:
    def free_blocks(self, ordered_blocks: Iterable["KVCacheBlock"]) -> None:
        for block in ordered_blocks:
            if block.is_null:  # skips a kind of block, not a repeat
                continue
            if block.pool is not None and block.pool is not self:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
""",
]
GOOD = [
    """\
from typing import Iterable

class BlockPool:
    def free_blocks(self, ordered_blocks: Iterable["KVCacheBlock"]) -> None:
        blocks = list(ordered_blocks)
        if len({id(block) for block in blocks}) != len(blocks):
            raise ValueError("a block is listed twice")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
""",
    """\
class SlotPool:
    def free(self, slots: list) -> None:
        for slot in slots:
            self.free_slots.add(slot)  # a set keeps one of each
""",
    """\
class SlotPool:
    def free(self, slots: list) -> None:
        for slot in slots:
            if slot in self.free_slots:  # already free, or a repeat: skipped
                continue
            self.free_slots.append(slot)
""",
]


def check_free_method(method, ctx):
    if method.self_name is None:
        return
    function = method.function
    owner = method.self_name
    names = freeing.aliases(function, method.param)
    if freeing.guards(function, names):
        return
    found = None
    param = method.param
    for loop, item, source in freeing.iterates_ids(function, names):
        found = freeing.per_occurrence_change(loop, item, owner, method.decrementers)
        if found is not None and effects.CHECK_FREE in effects.checks_in(
            loop.body, names | {item}, owner
        ):
            return  # `if b not in self.free: self.free.append(b)`: a repeat is skipped
        if found is not None:
            param = dotted_name(source) or param  # `seq.block_table`
            break
    if found is None:
        push = freeing.batched_push(function, names, owner)
        if push is None:
            return
        found = (push, "pushes each")
    helpers = freeing.class_methods(method.class_info)
    if freeing.batched_decrement(function, names, owner, helpers) is not None:
        return  # KVG203 says it, with the reason that fits
    node, what = found
    message = MESSAGE.format(fuzz=fuzzcmd.for_method(method, CODE), method=function.name.value, what=what, param=param)
    ctx.report(CODE, function.name, message)
