"""KVG203: a free-like method decrements refcounts for all ids at once and never rejects a repeat.

lmdeploy 0.18.0 `LogicalAllocator.free` does `np.add.at(ref_count, blocks, -1)` (through
`add_ref_count`), then puts `blocks[ref_count == 0]` back on its free array. With a block
held twice, `free([b, b])` drops both references in one call and pushes b twice; with
`self.refs[blocks] -= 1` a repeat is counted once and its reference leaks. Reject
repeats before touching state: `np.unique(blocks, return_counts=True)` (or
`torch.unique`) and raise on a count above 1, or `len(set(ids)) != len(ids)`. What it
cannot know: whether a repeat can reach the call at all, and what another object's
method does (only the class's own helpers are followed); any raise, assert or
de-duplication in the method counts as a check.
"""

from .. import freeing, fuzzcmd

CODE = "KVG203"
SUMMARY = "batched free decrements refcounts for all ids at once and never rejects a repeated id"
MESSAGE = (
    "KVG203 {method}() decrements refcounts for all of '{param}' at once and never "
    "rejects a repeated id: free([b, b]) drops two references (np.add.at) or counts "
    "one (fancy indexing) and can put b on the free list twice; reject repeats first "
    "(unique with return_counts, or len(set(ids)) != len(ids)){fuzz}"
)
FIXABLE = False

BAD = [
    """\
import numpy as np

class LogicalAllocator:
    def free(self, blocks: np.ndarray):
        self.add_ref_count(blocks, -1)
        freed_blocks = blocks[self.ref_count[blocks] == 0]
        num_used = self._num_blocks - self._free_count
        self._free_blocks[num_used - len(freed_blocks):num_used] = freed_blocks
        self._free_count += len(freed_blocks)

    def add_ref_count(self, blocks: np.ndarray, value):
        np.add.at(self.ref_count, blocks, value)
""",
    """\
import torch

class PagePool:
    def free(self, pages: torch.Tensor) -> None:
        self.refs[pages] -= 1
        self.free_pages = torch.cat((self.free_pages, pages[self.refs[pages] == 0]))
""",
]
GOOD = [
    """\
import numpy as np

class LogicalAllocator:
    def free(self, blocks: np.ndarray):
        unique, counts = np.unique(blocks, return_counts=True)
        if len(unique) != len(blocks):
            raise ValueError(f"repeated block ids in free(): {unique[counts > 1]}")
        np.add.at(self.ref_count, blocks, -1)
        freed = blocks[self.ref_count[blocks] == 0]
        self._free_blocks[self._used - len(freed):self._used] = freed
""",
]


def check_free_method(method, ctx):
    if method.self_name is None:
        return
    function = method.function
    names = freeing.aliases(function, method.param)
    helpers = freeing.class_methods(method.class_info)
    decrement = freeing.batched_decrement(function, names, method.self_name, helpers)
    if decrement is None or freeing.guards(function, names):
        return
    if freeing.batched_push(function, names, method.self_name) is None:
        return
    ctx.report(CODE, function.name, MESSAGE.format(fuzz=fuzzcmd.for_method(method, CODE), method=function.name.value, param=method.param))
