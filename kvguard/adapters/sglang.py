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
from ..owners import holding
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


# --- the token allocator's holders (module-level functions of SGLang's scheduler) -------------
#
# Token slots (pages, for the paged allocator) are handed out for a whole batch at once, by
# ``alloc_for_extend(batch)`` and ``alloc_for_decode(batch, token_per_req)`` in
# ``sglang.srt.mem_cache.allocation``, and given back per request by ``release_kv_cache(req,
# tree_cache, ...)`` in ``sglang.srt.mem_cache.common``: the scheduler's finish, abort and
# retract paths all go through it. So after a batch allocation each request holds the slots
# written for it (in batch order, ``extend_lens`` or ``token_per_req`` each), and
# ``release_kv_cache`` runs as ``req.rid``; what the request still held afterwards (the prefix
# the radix tree kept, locked or cached) is no longer its. A late release on behalf of a request
# whose slots another request was handed meanwhile (an abort that freed them while its batch was
# in flight) is then a ``stale-free``.

ALLOCATION = "sglang.srt.mem_cache.allocation"
COMMON = "sglang.srt.mem_cache.common"


def _slot_guard(tree_cache):
    allocator = getattr(tree_cache, "token_to_kv_pool_allocator", None)
    return (guard_of(allocator), allocator) if allocator is not None else (None, None)


def _ledger_ids(allocator, slots: list) -> list:
    """Slots as the guard counts them: pages for a paged allocator, slots otherwise."""
    page = getattr(allocator, "page_size", 1) or 1
    return slots if page == 1 else list(dict.fromkeys(s // page for s in slots))


def _holds_what_it_was_given(lengths_of):
    def make(original):
        @functools.wraps(original)
        def allocates_for_batch(batch, *args, **kwargs):
            result = original(batch, *args, **kwargs)
            out = result[0] if isinstance(result, tuple) else result
            guard, allocator = _slot_guard(getattr(batch, "tree_cache", None))
            reqs = getattr(batch, "reqs", None)
            if guard is None or out is None or not reqs:
                return result
            slots = out.reshape(-1).tolist()
            lengths = lengths_of(batch, reqs, args, kwargs)
            if lengths is None or sum(lengths) != len(slots):
                return result  # a shape this reading does not know: no holders
            start = 0
            for req, n in zip(reqs, lengths):
                rid = getattr(req, "rid", None)
                if rid is not None and n:
                    guard.add_holder(_ledger_ids(allocator, slots[start:start + n]), rid)
                start += n
            return result
        return allocates_for_batch
    return make


def _extend_lengths(batch, reqs, args, kwargs):
    lengths = getattr(batch, "extend_lens", None)
    return list(lengths) if lengths is not None and len(lengths) == len(reqs) else None


def _decode_lengths(batch, reqs, args, kwargs):
    per_req = args[0] if args else kwargs.get("token_per_req")
    return [per_req] * len(reqs) if isinstance(per_req, int) else None


def _row_slots(req, tree_cache) -> list:
    """The slots of the request's row, up to what it allocated: what it holds."""
    kv = getattr(req, "kv", None)
    row = getattr(kv, "req_pool_idx", None)
    n = getattr(kv, "kv_allocated_len", 0) or 0
    pool = getattr(tree_cache, "req_to_token_pool", None)
    if row is None or not n or pool is None:
        return []
    return pool.req_to_token[row, :n].tolist()


def _releases_as_request(original):
    @functools.wraps(original)
    def release_kv_cache(req, tree_cache, *args, **kwargs):
        rid = getattr(req, "rid", None)
        guard, allocator = _slot_guard(tree_cache)
        if rid is None or guard is None:
            return original(req, tree_cache, *args, **kwargs)
        held = _ledger_ids(allocator, _row_slots(req, tree_cache))
        with holding(rid):
            result = original(req, tree_cache, *args, **kwargs)
        if held:  # what the tree kept (a cached or locked prefix) is no longer the request's
            guard.drop_holder(held, rid)
        return result
    return release_kv_cache


FUNCTION_BOUNDARIES = {
    f"{ALLOCATION}.alloc_for_extend": _holds_what_it_was_given(_extend_lengths),
    f"{ALLOCATION}.alloc_for_decode": _holds_what_it_was_given(_decode_lengths),
    f"{COMMON}.release_kv_cache": _releases_as_request,
}
"""SGLang's module-level functions that act for requests (``kvguard.boundaries``)."""
