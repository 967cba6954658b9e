"""Small example allocators, faithful to the engines' logic, for the demo, tests and benchmarks.

``LinkedFreeList`` is DeepSpeed 0.19.8's ``BlockedAllocator`` with a Python list in place of its
int32 tensor: the same linked free list, the same two-loop ``free()``, so the same flaw: ids are
checked one by one, duplicates within one call never. ``RefcountedPool`` is a prefix-caching pool
in the style of vLLM's ``BlockPool``: blocks carry a reference count, ``share()`` adds one (and may
revive a freed block whose contents are still cached), ``free()`` drops one.
"""

from __future__ import annotations

from collections import deque

from .spec import AllocatorSpec


class LinkedFreeList:
    """DeepSpeed's linked free list in pure Python (about a microsecond per call)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"need at least 1 block, got {num_blocks}")
        self._num_blocks = num_blocks
        self._blocks = list(range(1, num_blocks + 1))
        self._head = 0
        self._free_blocks = num_blocks

    def allocate(self, num_blocks: int) -> list:
        if num_blocks > self._free_blocks:
            raise ValueError(f"not enough free blocks to allocate {num_blocks}")
        blocks = self._blocks
        out = []
        for _ in range(num_blocks):
            head = self._head
            out.append(head)
            self._head = blocks[head]
            blocks[head] = -1
        self._free_blocks -= num_blocks
        return out

    def free(self, blocks) -> None:
        if isinstance(blocks, int):
            blocks = [blocks]
        table = self._blocks
        for block in blocks:  # validates each id; never looks for duplicates within the call
            if block < 0 or block >= self._num_blocks:
                raise ValueError(f"invalid block {block}")
            if table[block] != -1:
                raise ValueError(f"block {block} is already free")
        for block in blocks:
            table[block] = self._head
            self._head = block
            self._free_blocks += 1

    @property
    def free_blocks(self) -> int:
        return self._free_blocks


LINKED_FREE_LIST_SPEC = AllocatorSpec(size="_num_blocks", free_count="free_blocks")


class RefcountedPool:
    """A prefix-caching pool: freed blocks stay cached (revivable) until handed out again."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free = deque(range(num_blocks))
        self._cached = set()

    def allocate(self, n: int) -> list:
        if n > len(self._free):
            raise ValueError(f"not enough free blocks to allocate {n}")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._cached.discard(b)
            self.ref_cnt[b] = 1
        return out

    def share(self, ids) -> None:
        for b in ids:
            if self.ref_cnt[b] == 0:
                self._free.remove(b)
            self.ref_cnt[b] += 1

    def free(self, ids) -> None:
        for b in ids:  # like vLLM: trusts its caller to drop each reference once
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)
                self._cached.add(b)

    def num_free(self) -> int:
        return len(self._free)


REFCOUNTED_POOL_SPEC = AllocatorSpec(share="share", refcounted=True, size="num_blocks",
                                     free_count="num_free")
