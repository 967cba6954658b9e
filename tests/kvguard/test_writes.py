"""kvguard.cache.writes.guard_writes: checking an engine's cache-write call before it writes.

The engines' write kernels are compiled ops that cannot run here, so each is a small model with
the engine's signature and semantics:

- vLLM 0.33.0 ``vllm._custom_ops.reshape_and_cache_flash(key, value, key_cache, value_cache,
  slot_mapping, kv_cache_dtype, k_scale, v_scale)``: caches ``[num_blocks, block_size, heads,
  head_size]``; token ``i`` goes to slot ``slot_mapping[i]`` = block * block_size + offset;
  slots < 0 (``PAD_SLOT_ID = -1``) are skipped.
- SGLang 0.5.23 ``MHATokenToKVPool.set_kv_buffer(layer, loc, cache_k, cache_v)``: per-layer
  buffers ``[size + 1, heads, head_dim]`` indexed by token slot ``loc``; slot 0 takes padding.
- FlashInfer-style appends that receive the whole block table (2-D, -1 padded).
"""

import warnings

import pytest
import torch

import kvguard
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)
from kvguard.cache.writes import guard_writes

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
BS, HEADS, DIM = 4, 2, 8


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale):
    # Padded tokens (slot < 0) add nothing to slot 0: no boolean indexing, so no host sync.
    keep = (slot_mapping >= 0)[:, None, None]
    slots = slot_mapping.long().clamp(min=0)
    for new, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, HEADS, DIM)
        delta = torch.where(keep, new[: len(slot_mapping)] - flat[slots], 0)
        flat.index_put_((slots,), delta, accumulate=True)


class TokenPool:
    def __init__(self, size, layers=2, device="cpu"):
        self.k_buffer = [torch.zeros(size + 1, HEADS, DIM, device=device) for _ in range(layers)]
        self.v_buffer = [torch.zeros(size + 1, HEADS, DIM, device=device) for _ in range(layers)]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        self.k_buffer[layer][loc] = cache_k
        self.v_buffer[layer][loc] = cache_v


class Engine:
    """vLLM-style: a guarded pool, one cache per layer, a checked write."""

    def __init__(self, blocks=8, layers=3, mode="raise", device="cpu", **options):
        self.pool = LinkedFreeList(blocks)
        self.guard = kvguard.guard(self.pool, LINKED_FREE_LIST_SPEC, on_violation=mode)
        self.k = [torch.zeros(blocks, BS, HEADS, DIM, device=device) for _ in range(layers)]
        self.v = [torch.zeros(blocks, BS, HEADS, DIM, device=device) for _ in range(layers)]
        self.write = guard_writes(reshape_and_cache_flash, self.guard, slots="slot_mapping",
                                  block_size=BS, **options)
        self.device = device

    def step(self, slots, fill=1.0):
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        tokens = torch.full((len(slots), HEADS, DIM), fill, device=self.device)
        for k, v in zip(self.k, self.v):
            self.write(tokens, tokens, k, v, slot_mapping, "auto", None, None)

    def written(self, block):
        return bool(self.k[0][block].ne(0).any())


def test_writes_into_live_blocks_pass():
    e = Engine()
    x = e.pool.allocate(2)
    e.step([x[0] * BS, x[0] * BS + 1, x[1] * BS + 3, -1])
    assert e.written(x[0]) and e.written(x[1]) and e.guard.violations == []


def test_a_write_into_a_freed_block_never_lands_in_raise_mode():
    e = Engine()
    x = e.pool.allocate(2)
    e.pool.free([x[1]])
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        e.step([x[0] * BS, x[1] * BS + 2])
    v = info.value.violation
    assert v.block_ids == (x[1],) and v.method == "reshape_and_cache_flash"
    assert "freed by call #3" in v.message
    assert not e.written(x[0]) and not e.written(x[1]), "the whole write was refused"
    assert "kvguard/cache/writes.py" not in v.summary(), "the report starts at the engine's frame"
    assert "test_writes.py" in v.summary()


def test_log_mode_records_and_writes():
    e = Engine(mode="log")
    x = e.pool.allocate(2)
    e.pool.free([x[1]])
    e.step([x[0] * BS, x[1] * BS + 2])
    assert e.written(x[1])
    assert [v.kind for v in e.guard.violations] == ["write-after-free"], "one per distinct map"


def test_repair_mode_sends_stale_tokens_to_padding():
    e = Engine(mode="repair")
    x = e.pool.allocate(2)
    e.pool.free([x[1]])
    e.step([x[0] * BS, x[1] * BS + 2, x[1] * BS + 3])
    assert e.written(x[0]) and not e.written(x[1])
    assert [v.kind for v in e.guard.violations] == ["write-after-free"], "once per step"


def test_sglang_set_kv_buffer_with_its_padding_slot():
    allocator = LinkedFreeList(9)
    g = kvguard.guard(allocator, LINKED_FREE_LIST_SPEC, on_violation="repair")
    allocator.allocate(1)  # slot 0: SGLang's padding slot, never handed to a request
    pool = TokenPool(8)
    set_kv = guard_writes(pool.set_kv_buffer, g, slots="loc", pad=0)
    loc = torch.tensor(allocator.allocate(3))
    allocator.free(loc[2:].tolist())
    padded = torch.cat((loc, torch.zeros(1, dtype=torch.long)))  # one padded token -> slot 0
    cache = torch.arange(4.0).view(4, 1, 1).expand(4, HEADS, DIM)
    set_kv(0, padded, cache, cache)
    (v,) = g.violations
    assert v.kind == "write-after-free" and v.block_ids == (int(loc[2]),)
    assert pool.k_buffer[0][loc[2]].eq(0).all(), "the stale token went to the padding slot"
    assert pool.k_buffer[0][0, 0, 0] == 3.0, "padding slot got the last writer, as before"
    assert pool.k_buffer[0][loc[1], 0, 0] == 1.0


def test_a_block_never_handed_out_or_someone_elses_is_stale():
    e = Engine(mode="log")
    with kvguard.owner("req-1"):
        x = e.pool.allocate(1)
    with kvguard.owner("req-2"):
        y = e.pool.allocate(1)
    e.step([7 * BS])
    (v,) = e.guard.violations
    assert v.kind == "stale-table" and v.block_ids == (7,) and "never handed out" in v.message
    with kvguard.owner("req-1"):
        e.step([x[0] * BS, y[0] * BS + 1])
    w = e.guard.violations[-1]
    assert w.kind == "stale-table" and w.block_ids == (y[0],)
    assert "owned by 'req-2', not the writer 'req-1'" in w.message
    e.step([x[0] * BS, y[0] * BS + 1], fill=2.0)  # no writer named: nothing to compare
    assert len(e.guard.violations) == 2


def test_writing_into_a_shared_block_needs_a_copy_first():
    p = RefcountedPool(4)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC)
    k = torch.zeros(4, BS, HEADS, DIM)
    write = guard_writes(reshape_and_cache_flash, g, slots=4, block_size=BS)
    ids = p.allocate(2)
    p.share(ids[:1])  # a prefix-cache hit: two sequences read block ids[0]
    tokens = torch.ones(1, HEADS, DIM)
    write(tokens, tokens, k, k, torch.tensor([ids[1] * BS]), "auto", None, None)
    with pytest.raises(kvguard.SharedBlockError) as info:
        write(tokens, tokens, k, k, torch.tensor([ids[0] * BS]), "auto", None, None)
    assert "copy-on-write" in info.value.violation.message
    relaxed = guard_writes(reshape_and_cache_flash, g, slots="slot_mapping", block_size=BS,
                           shared_ok=True)
    relaxed(tokens, tokens, k, k, torch.tensor([ids[0] * BS]), "auto", None, None)


def test_block_table_form_reads_shared_prefixes_without_complaint():
    p = RefcountedPool(8)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC, on_violation="log")
    calls = []

    def append_paged_kv_cache(append_key, paged_kv_cache, kv_indices):
        calls.append(kv_indices)

    append = guard_writes(append_paged_kv_cache, g, table="kv_indices")
    a = p.allocate(3)
    p.share(a[:2])
    b = a[:2] + p.allocate(1)
    append(None, None, kv_indices=torch.tensor([a, b]))
    assert g.violations == [] and len(calls) == 1
    p.free([a[2]])
    append(None, None, torch.tensor([a, b]))
    (v,) = g.violations
    assert v.kind == "write-after-free" and v.block_ids == (a[2],)


def test_one_read_of_the_slot_mapping_per_step_while_nothing_changes():
    e = Engine(layers=32)
    x = e.pool.allocate(2)
    e.step([x[0] * BS, x[1] * BS])
    assert e.write.checker.checks == 1, "32 layers, one slot mapping: read once"
    e.step([x[0] * BS + 1, x[1] * BS + 1])
    assert e.write.checker.checks == 2, "a new slot mapping is read again"
    slots = torch.tensor([x[0] * BS + 2])
    tokens = torch.ones(1, HEADS, DIM)
    e.write(tokens, tokens, e.k[0], e.v[0], slots, "auto", None, None)
    e.pool.free([x[0]])
    with pytest.raises(kvguard.WriteAfterFreeError):
        e.write(tokens, tokens, e.k[0], e.v[0], slots, "auto", None, None)
    x2 = e.pool.allocate(1)
    slots.fill_(x2[0] * BS + 3)  # changed in place: its version moves, it is read again
    e.write(tokens, tokens, e.k[0], e.v[0], slots, "auto", None, None)
    assert e.write.checker.checks == 5


def test_lists_and_nested_lists():
    a = LinkedFreeList(8)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="repair")
    seen = []
    write = guard_writes(lambda slots: seen.append(slots), g, slots=0, block_size=2)
    x = a.allocate(2)
    a.free([x[1]])
    write([x[0] * 2, x[1] * 2 + 1, -1])
    write([[x[0] * 2], [x[1] * 2, -1]])
    assert seen == [[x[0] * 2, -1, -1], [[x[0] * 2], [-1, -1]]]
    assert len(g.violations) == 2


BAD = [
    (TypeError, lambda g: guard_writes(None, g, slots=0)),
    (TypeError, lambda g: guard_writes(reshape_and_cache_flash, g)),
    (TypeError, lambda g: guard_writes(reshape_and_cache_flash, g, slots=4, table=4)),
    (TypeError, lambda g: guard_writes(reshape_and_cache_flash, g, slots="nope")),
    (TypeError, lambda g: guard_writes(reshape_and_cache_flash, g, slots=True)),
    (TypeError, lambda g: guard_writes(reshape_and_cache_flash, g, slots=4, block_size=1.5)),
    (ValueError, lambda g: guard_writes(reshape_and_cache_flash, g, slots=4, block_size=0)),
    (TypeError, lambda g: guard_writes(reshape_and_cache_flash, LinkedFreeList(2), slots=4)),
]


@pytest.mark.parametrize("error, make", BAD)
def test_bad_arguments(error, make):
    g = kvguard.guard(LinkedFreeList(4), LINKED_FREE_LIST_SPEC)
    with pytest.raises(error):
        make(g)


@pytest.mark.parametrize("slots", [[True], [0.5], torch.tensor([0.0]),
                                   torch.tensor([True])], ids=repr)
def test_a_slot_mapping_that_is_not_integers_is_refused_before_writing(slots):
    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    seen = []
    write = guard_writes(lambda s: seen.append(s), g, slots=0)
    with pytest.raises(TypeError):
        write(slots)
    assert seen == [] and g.violations == []


@pytest.mark.parametrize("device", DEVICES)
def test_on_device(device):
    e = Engine(device=device, mode="repair")
    x = e.pool.allocate(2)
    e.pool.free([x[1]])
    e.step([x[0] * BS, x[1] * BS])
    assert e.written(x[0]) and not e.written(x[1])


@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_one_sync_for_all_layers_of_a_step():
    e = Engine(layers=16, device="cuda")
    x = e.pool.allocate(2)
    e.step([x[0] * BS, x[1] * BS])
    torch.cuda.synchronize()
    slot_mapping = torch.tensor([x[0] * BS + 1, x[1] * BS + 1], device="cuda")
    tokens = torch.ones(2, HEADS, DIM, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for k, v in zip(e.k, e.v):
                e.write(tokens, tokens, k, v, slot_mapping, "auto", None, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(w.message) for w in caught) == 1
