"""SGLang's KV-slot allocators and request rows, checked against 0.5.23.

``TokenToKVPoolAllocator`` (page size 1): ``alloc(n)`` returns an int64 tensor of slots (a view of
its free list) or ``None``; ``free(free_index)`` takes a tensor, usually an int32 view of
``req_to_token``, and ``torch.cat``s it onto the free list with no check at all: a duplicate, a
slot that is already free, and a bool mask (promoted to 0/1, so padding slot 0 and live slot 1
enter the free list) are all accepted. Slot 0 is padding and never handed out.

``PagedTokenToKVPoolAllocator`` hands out token slots page by page and keeps pages on its free
list; it is tracked by page. ``alloc``/``alloc_extend``/``alloc_decode`` return token slots (a
new page shows up as its slot at offset 0), ``free(tokens)`` releases
``torch.unique(tokens // page_size)``, so it legally de-duplicates within one call, never across
calls, and a bool mask becomes padding page 0. Every page release goes through
``_release_page_ids``, which is what the spec guards; ``free()``/``free_page_ids()`` get a check
of the form of their argument first.

Free groups: between ``free_group_begin()`` and ``free_group_end()`` frees are deferred. The
token allocator's are checked at the deferred call, and ``free_group_end()`` of an open group
releases them without a second check; the paged allocator's are checked when the group ends
and they reach ``_release_page_ids``. A ``free_group_end()`` without an open group that frees
again (before sglang#36739 the pending list was never cleared) is a ``double-free``.

The token allocator's free count for ``Guard.check()`` adds an open group's deferred slots to
``available_size()``: the guard counted them free at the deferred call. ``resize(config)``
rebuilds either allocator with another size and ends in ``clear()``: the ledger takes the new
size (an id past it is out of range from then on) and forgets every live block.

``ReqToTokenPool`` hands out request rows (``alloc_rows``/``free_rows``, plain lists; row 0 is
padding). ``clear()`` returns everything on all three.
"""

from __future__ import annotations

import functools

from ..marks import guard_of
from ..spec import AllocatorSpec
from .methods import adapter, allocating, checking, resetting, resizing, settled

TOKEN_ALLOCATOR = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
PAGED_ALLOCATOR = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
REQ_TO_TOKEN_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"


def group_open(allocator) -> bool:
    """Whether ``free()`` would defer right now. Before sglang#36739 a flag said so
    (``is_not_in_free_group``); since then ``free_group`` is ``None`` outside a group."""
    flag = getattr(allocator, "is_not_in_free_group", None)
    if flag is not None:
        return not flag
    return getattr(allocator, "free_group", None) is not None


def _unused(n, free_tensors) -> list:
    """Ids ``1..n-1`` that none of ``free_tensors`` holds: what is handed out right now."""
    import torch

    used = torch.ones(n, dtype=torch.bool)
    used[0] = False
    for t in free_tensors:
        if t is not None and t.numel():
            used[t.reshape(-1).long().cpu()] = False
    return used.nonzero().flatten().tolist()


def _free_slots(allocator) -> int:
    """``available_size()`` plus the slots deferred in an open free group: the caller gave them
    up at the deferred call, where the guard counted them, and ``free_group_end()`` puts them
    on the free list without a second check."""
    free = allocator.available_size()
    if group_open(allocator):
        free += sum(t.numel() for t in allocator.free_group or ())
    return free


def _used_slots(allocator) -> list:
    # Slots deferred in an open group were given up already: not live.
    return _unused(allocator.size + 1, [allocator.free_pages, allocator.release_pages,
                                        *(allocator.free_group or ())])


def _used_pages(allocator) -> list:
    ps = allocator.page_size
    deferred = [t // ps for t in (allocator.free_group or ())]
    return _unused(allocator.num_pages + 1, [allocator.free_pages, *allocator.staged_pages,
                                             *deferred, *allocator.free_page_ids_group])


def new_pages(allocator, tokens):
    """The pages an allocation handed out: a fresh page's first slot (offset 0) is in the
    result, a page that was already partly filled contributes later slots only."""
    if tokens is None:
        return None
    ps = allocator.page_size
    return (tokens[tokens % ps == 0] // ps).tolist()


SPECS = {
    TOKEN_ALLOCATOR: AllocatorSpec(
        alloc="alloc", free="free", tensor_ok=True, size=lambda a: a.size + 1,
        free_count=_free_slots, live_ids=_used_slots,
        adapter=adapter(settled("free_group_end", group_open), resetting("clear"),
                        resizing("resize")),
    ),
    PAGED_ALLOCATOR: AllocatorSpec(
        alloc=None, free="_release_page_ids", tensor_ok=True, size=lambda a: a.num_pages + 1,
        free_count=lambda a: a.available_size() // a.page_size, live_ids=_used_pages,
        adapter=adapter(
            allocating("alloc", new_pages), allocating("alloc_extend", new_pages),
            allocating("alloc_decode", new_pages), checking("free"), checking("free_page_ids"),
            resetting("clear"), resizing("resize"),
        ),
    ),
    REQ_TO_TOKEN_POOL: AllocatorSpec(
        alloc="alloc_rows", free="free_rows", size=lambda p: p.size + 1,
        free_count="available_size",
        live_ids=lambda p: sorted(set(range(1, p.size + 1)).difference(p.free_slots)),
        adapter=adapter(resetting("clear")),
    ),
}


# --- the request lifecycle around the row pool (kvguard.boundaries) --------------------------
#
# ``ReqToTokenPool.alloc(reqs)`` gives each request of a batch a row (``req.kv.req_pool_idx``)
# through ``alloc_rows``; ``free(req)`` gives its row back through ``free_rows``. Each row's
# holder is its request's ``rid``: after ``alloc`` every request holds its row, and ``free``
# runs as the request, so a late ``free(req)`` of an aborted request whose row index was kept
# (the overlap loop's result processed after the abort freed it) is a ``stale-free`` once the
# row went to another request.


def _pool_guard(pool):
    return guard_of(pool)


def _rows_held(original):
    @functools.wraps(original)
    def alloc(self, reqs, *args, **kwargs):
        rows = original(self, reqs, *args, **kwargs)
        guard = _pool_guard(self)
        if guard is not None and rows is not None:
            for req, row in zip(reqs, rows):
                rid = getattr(req, "rid", None)
                if rid is not None and row is not None:
                    guard.add_holder([row], rid)
        return rows
    return alloc


def _request_rid(args, kwargs):
    req = args[0] if args else kwargs.get("req")
    return getattr(req, "rid", None)


BOUNDARIES = {
    REQ_TO_TOKEN_POOL: {"alloc": ("around", _rows_held), "free": _request_rid},
}
