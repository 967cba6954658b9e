"""Small allocators of the shapes engines use beyond "allocate(n) -> ids, free(ids)", written
for these tests (no engine's code): each says which shape it has, and its spec.

- ``SeqBlockManager``: ids carried in the sequence (``allocate(seq)`` extends
  ``seq.block_table``, ``deallocate(seq)`` frees it), reference counts, and an allocation that
  also shares (a prompt whose prefix is cached takes a reference to the cached blocks).
- ``RequestPagePool``: a request-to-page pool: ``alloc_pages(req, n)`` extends ``req.pages``,
  ``free_request(req)`` frees them, ``free_page(page)`` frees one, ``clear()`` frees all.
- ``SingleIdPool``: one id per call: ``allocate_one()``, ``retain(b)``, ``release(b)``, beside
  a batch ``release_many(ids)``.
- ``GroupedPool``: sub-pools, one free list per group (``allocate(n, group)``).
- ``LazyFreePool``: ``lazy_free()`` batches frees by shadowing ``free`` on the instance, then
  deletes that attribute and frees the batch.
"""

from __future__ import annotations

import contextlib

import kvguard


class Seq:
    def __init__(self, n_blocks: int, prefix: "Seq | None" = None, shared: int = 0) -> None:
        self.n_blocks = n_blocks
        self.prefix = prefix
        self.shared = shared
        self.block_table: list = []


class SeqBlockManager:
    """Blocks with reference counts; a sequence's blocks live in ``seq.block_table``."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, seq: Seq) -> None:
        if seq.prefix is not None:  # a prefix-cache hit: new references to cached blocks
            for b in seq.prefix.block_table[:seq.shared]:
                self.ref_counts[b] += 1
                seq.block_table.append(b)
        while len(seq.block_table) < seq.n_blocks:
            b = self.free_ids.pop(0)
            self.ref_counts[b] = 1
            seq.block_table.append(b)

    def fork(self, child: Seq, parent: Seq) -> None:
        """Copy-on-write fork: the child references every block of the parent."""
        for b in parent.block_table:
            self.ref_counts[b] += 1
        child.block_table = list(parent.block_table)

    def deallocate(self, seq: Seq) -> None:
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)
        seq.block_table = []


SEQ_SPEC = kvguard.AllocatorSpec(
    alloc="allocate(seq.block_table)", free="deallocate(seq.block_table)", refcounted=True,
    alloc_shares=True, share="fork(parent.block_table)", refcounts="ref_counts",
    size="num_blocks", free_count="num_free")


class Request:
    def __init__(self) -> None:
        self.pages: list = []


class RequestPagePool:
    """A request-to-page pool with a reset."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free_pages = list(range(num_pages))

    def available(self) -> int:
        return len(self.free_pages)

    def alloc_pages(self, req: Request, n: int) -> None:
        taken, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        req.pages.extend(taken)

    def free_request(self, req: Request) -> None:
        self.free_pages.extend(req.pages)
        req.pages = []

    def free_page(self, page: int) -> None:
        self.free_pages.append(page)

    def clear(self) -> None:
        self.free_pages = list(range(self.num_pages))


PAGE_SPEC = kvguard.AllocatorSpec(
    alloc="alloc_pages(req.pages)", free="free_request(req.pages)", also_free="free_page(page)",
    reset="clear", size="num_pages", free_count="available")


class SingleIdPool:
    """One id per call, reference counted."""

    def __init__(self, n: int) -> None:
        self.size = n
        self.refs = [0] * n
        self.free_list = list(range(n))

    def allocate_one(self) -> int:
        b = self.free_list.pop()
        self.refs[b] = 1
        return b

    def retain(self, b: int) -> None:
        self.refs[b] += 1

    def release(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_list.append(b)

    def release_many(self, ids) -> None:
        for b in ids:
            self.release(b)


SINGLE_SPEC = kvguard.AllocatorSpec(
    alloc="allocate_one", free="release(b)", share="retain(b)", also_free="release_many",
    refcounted=True,
    size="size", free_count=lambda p: len(p.free_list), refcounts="refs")


class GroupedPool:
    """Sub-pools: ids are numbered per group."""

    def __init__(self, groups: int, n: int) -> None:
        self.sizes = [n] * groups
        self.free_lists = [list(range(n)) for _ in range(groups)]

    def allocate(self, n: int, group: int = 0) -> list:
        taken = self.free_lists[group][:n]
        del self.free_lists[group][:n]
        return taken

    def free(self, ids, group: int = 0) -> None:
        self.free_lists[group].extend(ids)

    def free_counts(self) -> list:
        return [len(f) for f in self.free_lists]


GROUPED_SPEC = kvguard.AllocatorSpec(pool_arg="group", size="sizes", free_count="free_counts")


class LazyFreePool:
    """``with pool.lazy_free():`` collects frees and releases them at the end, by shadowing
    ``free`` on the instance for the duration."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.free_list = list(range(n))

    def allocate(self, n: int) -> list:
        taken, self.free_list = self.free_list[:n], self.free_list[n:]
        return taken

    def free(self, ids) -> None:
        self.free_list.extend(ids)

    @contextlib.contextmanager
    def lazy_free(self):
        pending: list = []
        self.free = pending.extend
        try:
            yield
        finally:
            del self.free
            type(self).free(self, pending)


LAZY_SPEC = kvguard.AllocatorSpec(size="n", free_count=lambda p: len(p.free_list))
