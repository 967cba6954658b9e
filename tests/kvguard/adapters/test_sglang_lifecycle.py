"""SGLang 0.5.23: who holds a token slot. The real ``TokenToKVPoolAllocator``,
``ReqToTokenPool`` and ``release_kv_cache`` (with the helpers it calls, executed from
``sglang/srt/mem_cache/common.py`` in the wheel); the batch allocation and the prefix cache
around them are a faithful small model, said below, because ``allocation.py`` and SGLang's
caches import Triton and the scheduler's world: ``alloc_for_extend(batch)`` takes the batch's
slots in one ``alloc`` and writes each request's row in batch order (as SGLang's does), and the
cache is a chunk cache: no tree, ``free_kv_row`` as ``BasePrefixCache`` ships it (its body
calls the real ``free_kv_row_segments``)."""

from __future__ import annotations

import types

import pytest
import torch

import kvguard

from . import engines

ALLOCATION = "sglang.srt.mem_cache.allocation"
COMMON = "sglang.srt.mem_cache.common"


class KV:
    """The request's ``kv`` record as ``release_kv_cache`` and ``ReqToTokenPool`` read it."""

    def __init__(self):
        self.req_pool_idx = None
        self.kv_allocated_len = self.kv_committed_len = self.cache_protected_len = 0
        self.released = False

    @property
    def holds_kv(self):
        return self.req_pool_idx is not None

    @property
    def is_kv_released(self):
        return self.req_pool_idx is None

    def mark_kv_released(self):
        self.released = True

    def get_evicted_seqlen(self, component):
        return 0

    def swa_dead_lo(self, page_size):
        return 0


class Req:
    def __init__(self, rid, prompt_len):
        self.rid, self.prompt_len = rid, prompt_len
        self.kv = KV()
        self.lock = None
        self.skip_radix_cache_insert = True
        self.origin_input_ids = [0] * prompt_len
        self.finished_len = None

    def owned_kv_len(self):
        return self.kv.kv_committed_len

    def finished(self):
        return True


class ChunkCache:
    """A prefix cache with no tree: what ``release_kv_cache`` calls on it."""

    def __init__(self, allocator, rows):
        self.token_to_kv_pool_allocator, self.req_to_token_pool = allocator, rows

    def free_kv_row(self, kv, ranges):
        import sys
        common = sys.modules[COMMON]
        allocator = self.token_to_kv_pool_allocator
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        common.free_kv_row_segments(
            allocator, [(row[start:end], start) for start, end in common.coalesce_ranges(ranges)],
            swa_evicted_seqlen=kv.get_evicted_seqlen("swa"),
            swa_dead_lo=kv.swa_dead_lo(allocator.page_size))

    def supports_mamba(self):
        return False

    def claim_kv_row(self, req):
        return False

    def unlock(self, lock):
        pass

    def on_release(self, req, *, checkpointed):
        pass


def alloc_for_extend(batch):
    """The model of SGLang's: the batch's slots in one ``alloc``, rows written in batch order."""
    cache = batch.tree_cache
    cache.req_to_token_pool.alloc(batch.reqs)
    out = cache.token_to_kv_pool_allocator.alloc(sum(batch.extend_lens))
    start = 0
    for req, n in zip(batch.reqs, batch.extend_lens):
        row = req.kv.req_pool_idx
        cache.req_to_token_pool.req_to_token[row, :n] = out[start:start + n].to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = n
        start += n
    return out, None, None


@pytest.fixture
def sg():
    with engines.loaded("sglang") as ns:
        package = engines.archive("sglang")
        modules = engines.Modules()
        try:
            def ceil_align(x, n):
                return -(x // -n) * n

            serving = types.SimpleNamespace(strip_thinking_cache=False)
            ns.common = modules.load_functions(
                package, "sglang/srt/mem_cache/common.py", COMMON,
                {"release_kv_cache", "_release_overallocated_kv_indices", "coalesce_ranges",
                 "free_kv_row_segments"},
                get_spec=lambda: types.SimpleNamespace(speculative_algorithm=None),
                get_serving=lambda: serving, ceil_align=ceil_align,
                ComponentType=types.SimpleNamespace(SWA="swa"))
            ns.allocation = modules.stub(ALLOCATION, alloc_for_extend=alloc_for_extend)
            yield ns
        finally:
            modules.close()


def setting(sg, size=8, mode="raise"):
    kvguard.instrument(on_violation=mode)
    allocator = sg.TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
    rows = sg.ReqToTokenPool(size=4, max_context_len=16, device="cpu",
                             enable_memory_saver=False)
    cache = ChunkCache(allocator, rows)
    return allocator, rows, cache


def run_batch(sg, cache, reqs):
    batch = types.SimpleNamespace(reqs=reqs, extend_lens=[r.prompt_len for r in reqs],
                                  tree_cache=cache)
    return sys_allocation(sg).alloc_for_extend(batch)[0]


def sys_allocation(sg):
    import sys
    return sys.modules[ALLOCATION]


def release(sg, req, cache):
    import sys
    sys.modules[COMMON].release_kv_cache(req, cache, checkpoint=False)


def test_slots_are_held_by_their_request_and_releases_report_nothing(sg):
    allocator, rows, cache = setting(sg)
    g = kvguard.guard_of(allocator)
    r, q = Req("R", 3), Req("Q", 2)
    run_batch(sg, cache, [r, q])
    held = {b: rec.holder for b, rec in g.live.items()}
    assert sorted(held.values()) == ["Q", "Q", "R", "R", "R"]
    release(sg, r, cache)
    p = Req("P", 3)
    run_batch(sg, cache, [p])                   # P is handed R's slots again
    release(sg, q, cache)
    release(sg, p, cache)
    assert g.violations == [] and g.live == {} and allocator.available_size() == 8
    kvguard.uninstrument()


@pytest.mark.parametrize("mode", ["raise", "repair"])
def test_a_late_release_of_an_aborted_request_after_reuse_is_stale(sg, mode,
                                                                   quiet_kvguard_log):
    """The overlap loop's abort: R's slots are freed while its batch is in flight (the abort
    path frees its row's tokens and keeps the kv record), Q is handed them, then R's late
    result runs ``release_kv_cache(R)``, which frees R's row as the record still says."""
    allocator, rows, cache = setting(sg, mode=mode)
    g = kvguard.guard_of(allocator)
    r = Req("R", 8)
    run_batch(sg, cache, [r])
    row = r.kv.req_pool_idx
    stale = rows.req_to_token[row, :8].clone()
    allocator.free(stale)                       # the abort frees R's tokens, keeps the record
    q = Req("Q", 8)
    run_batch(sg, cache, [q])                   # Q is handed every one of them
    rows.req_to_token[row, :8] = stale          # (R's row as its in-flight batch wrote it)
    if mode == "raise":
        with pytest.raises(kvguard.StaleFreeError) as info:
            release(sg, r, cache)
        assert "'Q' holds it" in str(info.value)
    else:
        release(sg, r, cache)
    assert [v.kind for v in g.violations] == ["stale-free"]
    assert allocator.available_size() == 0      # Q keeps its slots
    assert {rec.holder for rec in g.live.values()} == {"Q"}
    kvguard.uninstrument()
