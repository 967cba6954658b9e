"""KVG102: ids that may repeat, passed to a free-like call.

An allocator that validates each id against its own state (DeepSpeed 0.19.8) lets
`free([0, 0, 1])` through: block 0 goes on the free list twice and is later handed to
two sequences. Ids gathered from several sources (concatenation, unpacking,
itertools.chain, append/extend in loops) repeat as soon as two sources share a
block, as prefix-shared sequences do. De-duplicate on the way, or keep the sources
provably disjoint.
"""

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
    if call.val.dup:
        ctx.report(CODE, call.ids, MESSAGE.format(callee=call.name, reason=call.val.dup))
