"""kvguard.guard_cache: poisoning freed KV blocks, checking them at hand-out, quarantine.

Layouts are the engines' own, on CPU tensors (and CUDA ones where a GPU is present: the tests
whose id holds "cuda"):

- vLLM 0.33.0 flash-attention layers: one ``[2, num_blocks, block_size, heads, head_dim]`` tensor
  per layer (K and V halves), ``block_dim=1``; also its permuted physical layout, where the
  logical tensor is a non-contiguous view of ``[num_blocks, 2, ...]``.
- DeepSpeed 0.19.8 ``BlockedKVCache``: one ``(num_layers, num_blocks, block_size, 2, heads,
  head_size)`` tensor per cache group, ``block_dim=1``, with DeepSpeed's own ``BlockedAllocator``
  loaded from its sdist in the engine cache (skipped when absent).
- SGLang 0.5.23 ``MHATokenToKVPool``: per-layer K and V token-slot buffers
  ``[size + page_size, heads, head_dim]`` made as the halves ``buf[0, :rows]``/``buf[1, :rows]``
  of one fused tensor, ``block_dim=0``, slot 0 reserved for padding. The allocator is SGLang's
  ``TokenToKVPoolAllocator`` from its wheel when the engine cache holds it, else ``TokenSlots``
  below, a model of it: ``free_pages = arange(1, size + 1)`` (int64), ``alloc(n)`` returns the
  first n as a tensor (None when short), ``free(t)`` concatenates ``t`` back, unchecked.
"""

import glob
import json
import os
import sys
import types
import warnings
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvguard
from kvguard.cache import guard_cache as cache_module, poison
from kvguard.examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))]
DTYPES = [getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "int8", "uint8", "int16", "int32", "int64",
) if hasattr(torch, name)]
ENGINES = os.environ.get("KVGUARD_ENGINE_CACHE", os.path.expanduser("~/.cache/kvguard-engines"))


def random_cache(shape, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(max(info.min, -100), min(info.max, 100), shape, generator=g,
                          dtype=torch.int64).to(dtype)
    return t.to(device)


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


def poke(t, block, block_dim, at=0):
    """A stale write: one element of ``block`` set to bits 1 (no dtype's poison)."""
    index = [0] * t.dim()
    index[block_dim] = block
    if t.dim() > block_dim + 1:
        index[-1] = at
    bits(t)[tuple(index)] = 1


def block_bits(t, block, block_dim):
    return bits(t).select(block_dim, block).clone()


def poisoned(t, block, block_dim):
    sel = t.select(block_dim, block)
    if t.dtype.is_floating_point:
        return bool(sel.float().isnan().all())
    return bool((bits(sel) == poison.poison_bits(t.dtype, torch)).all())


def guarded_free_list(n=16, **options):
    a = LinkedFreeList(n)
    return a, kvguard.guard(a, LINKED_FREE_LIST_SPEC, **options)


def vllm_layers(layers, n, dtype=torch.bfloat16, device="cpu"):
    return [random_cache((2, n, 4, 2, 8), dtype, device, seed=i) for i in range(layers)]


# --- poisoning and verifying, every dtype ------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_free_poisons_exactly_the_freed_blocks(dtype, device):
    a, g = guarded_free_list()
    kv = random_cache((2, 16, 4, 2, 8), dtype, device)
    kvguard.guard_cache(kv, g, block_dim=1)
    ids = a.allocate(6)
    before = bits(kv).clone()
    a.free(ids[1:3])
    for b in range(16):
        if b in ids[1:3]:
            assert poisoned(kv, b, 1), b
        else:
            assert torch.equal(bits(kv).select(1, b), before.select(1, b)), b
    if dtype.is_floating_point:
        assert kv[:, ids[1]].float().isnan().all(), "a stale reader sees NaN"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_after_free_is_caught_at_hand_out(dtype, device):
    a, g = guarded_free_list()
    layers = [random_cache((2, 16, 4, 2, 8), dtype, device, seed=i) for i in range(3)]
    cg = kvguard.guard_cache(layers, g, block_dim=1, name="layer")
    ids = a.allocate(4)
    a.free(ids[:2])
    poke(layers[2][1], ids[1], 0)  # layer 2's V half of block ids[1]
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        a.allocate(2)
    v = info.value.violation
    assert v.kind == "write-after-free" and v.block_ids == (ids[1],)
    assert "layer[2]" in v.message and "layer[0]" not in v.message
    assert v.extra["tensors"] == f"{ids[1]}: layer[2]"
    assert g.ledger().is_live(ids[1]), "raised after the hand-out, which stands"
    assert cg.stats.violations == 1 and cg.pending() == []
    json.dumps(v.to_dict())


@pytest.mark.parametrize("device", DEVICES)
def test_clean_reuse_reports_nothing(device):
    a, g = guarded_free_list(32)
    cg = kvguard.guard_cache(vllm_layers(4, 32, device=device), g, block_dim=1)
    live = []
    for step in range(40):
        live = live + a.allocate(1 + step % 3)
        if len(live) > 12:
            done, live = live[:7], live[7:]
            a.free(done)  # noqa: KVG102 (fresh allocations never repeat)
    assert g.violations == [] and cg.stats.violations == 0
    assert cg.stats.verified_blocks > 0 and cg.stats.poisoned_blocks > 0


def test_one_batched_check_per_hand_out_whatever_the_tensors_and_blocks():
    a, g = guarded_free_list(64)
    cg = kvguard.guard_cache(vllm_layers(16, 64), g, block_dim=1)
    ids = a.allocate(40)
    a.free(ids[::3])  # scattered: gathered with index_select
    a.free(ids[1:3])  # one run: read through views
    calls = cg.stats.verify_calls
    a.allocate(20)
    assert cg.stats.verify_calls == calls + 1
    assert cg.stats.verified_blocks == 16
    a.allocate(1)  # never freed under the guard: nothing to verify, no check at all
    assert cg.stats.verify_calls == calls + 1


@pytest.mark.parametrize("pattern", ["one run", "two runs", "scattered"])
def test_every_selection_path_finds_the_written_block(pattern):
    a, g = guarded_free_list(32)
    layers = vllm_layers(2, 32)
    kvguard.guard_cache(layers, g, block_dim=1, name="L")
    ids = a.allocate(32)
    freed = {"one run": ids[4:9], "two runs": ids[4:7] + ids[10:12],
             "scattered": ids[1:20:3]}[pattern]
    a.free(freed)
    poke(layers[1][0], freed[-1], 0, at=5)
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        a.allocate(len(freed))
    assert info.value.block_ids == (freed[-1],)
    assert "L[1]" in info.value.violation.message


# --- layouts -------------------------------------------------------------------------------------

def test_vllm_permuted_physical_layout():
    """vLLM allocates some backends as [num_blocks, 2, ...] and hands the layer a permuted view:
    block runs are then not contiguous, and each block is read on its own."""
    a, g = guarded_free_list(16)
    physical = random_cache((16, 2, 4, 2, 8), torch.float16)
    kv = physical.permute(1, 0, 2, 3, 4)
    assert not kv.is_contiguous()
    kvguard.guard_cache(kv, g, block_dim=1)
    ids = a.allocate(8)
    a.free(ids[2:6])
    assert all(poisoned(kv, b, 1) for b in ids[2:6])
    assert not poisoned(kv, ids[0], 1)
    poke(kv[1], ids[3], 0)
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        a.allocate(4)
    assert info.value.block_ids == (ids[3],)


def test_layout_whose_blocks_cannot_be_viewed_flat():
    """Trailing dims transposed: no [rows, blocks, width] view exists, blocks are gathered."""
    a, g = guarded_free_list(16)
    base = random_cache((16, 8, 4), torch.float32)
    kv = base.transpose(1, 2)
    cg = kvguard.guard_cache(kv, g)
    assert cg.entries()[0].canon is None
    ids = a.allocate(6)
    a.free(ids[1:4])
    assert all(poisoned(kv, b, 0) for b in ids[1:4])
    kv[ids[2], 3, 7] = 0.5
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        a.allocate(3)
    assert info.value.block_ids == (ids[2],)


def test_deepspeed_blocked_kv_cache_layout():
    from tests.kvguard.adapters import engines

    with engines.loaded("deepspeed") as ds:  # its real blocked_allocator.py, from the sdist
        allocator = ds.BlockedAllocator(n := 12)
    g = kvguard.guard(allocator, kvguard.AllocatorSpec(free_arg="blocks", size="_num_blocks",
                                                       free_count="free_blocks"))
    cache = random_cache((3, n, 4, 2, 2, 8), torch.float16)  # (layers, blocks, bs, K/V, h, d)
    kvguard.guard_cache(cache, g, block_dim=1, name="ds_cache")
    ids = allocator.allocate(5).tolist()
    allocator.free(ids[:3])
    assert all(poisoned(cache, b, 1) for b in ids[:3])
    assert not poisoned(cache, ids[4], 1)
    cache[2, ids[0], 1, 1, 0, 0] = 1.0  # layer 2, token 1, V, head 0
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        allocator.allocate(3)
    assert info.value.block_ids == (ids[0],) and "ds_cache" in info.value.violation.message
    g.check()


class TokenSlots:
    """SGLang 0.5.23 TokenToKVPoolAllocator (page_size 1), as described in the module docstring."""

    def __init__(self, size, dtype=None, device="cpu", kvcache=None, need_sort=False):
        self.size = size
        self.device = device
        self.free_pages = torch.arange(1, size + 1, dtype=torch.int64, device=device)

    def available_size(self):
        return len(self.free_pages)

    def alloc(self, need_size):
        if need_size > len(self.free_pages):
            return None
        out = self.free_pages[:need_size]
        self.free_pages = self.free_pages[need_size:]
        return out

    def free(self, free_index):
        if free_index.numel() == 0:
            return
        self.free_pages = torch.cat((self.free_pages, free_index))


def sglang_token_allocator():
    wheels = glob.glob(os.path.join(ENGINES, "sglang-0.5.23-*.whl"))
    if not wheels:
        return TokenSlots
    with zipfile.ZipFile(wheels[0]) as zf:
        base = zf.read("sglang/srt/mem_cache/allocator/base.py").decode()
        token = zf.read("sglang/srt/mem_cache/allocator/token.py").decode()
    saved = {k: sys.modules.get(k) for k in ("sglang", "sglang.srt", "sglang.srt.mem_cache",
                                             "sglang.srt.mem_cache.allocator",
                                             "sglang.srt.mem_cache.allocator.base")}
    try:
        for name in list(saved)[:-1]:
            sys.modules[name] = types.ModuleType(name)
        base_module = types.ModuleType("sglang.srt.mem_cache.allocator.base")
        sys.modules[base_module.__name__] = base_module
        exec(compile(base, "sglang/srt/mem_cache/allocator/base.py", "exec"),
             base_module.__dict__)
        token_module = types.ModuleType("sglang.srt.mem_cache.allocator.token")
        exec(compile(token, "sglang/srt/mem_cache/allocator/token.py", "exec"),
             token_module.__dict__)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return token_module.TokenToKVPoolAllocator


SGLANG_SPEC = kvguard.AllocatorSpec(alloc="alloc", free="free", free_arg="free_index",
                                    tensor_ok=True, size=lambda a: a.size + 1,
                                    free_count="available_size")


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_token_slot_buffers(device):
    Allocator = sglang_token_allocator()
    size, layers = 24, 3
    allocator = Allocator(size, torch.bfloat16, device, None, False)
    g = kvguard.guard(allocator, SGLANG_SPEC)
    fused = [random_cache((2, size + 1, 2, 8), torch.bfloat16, device, seed=i)
             for i in range(layers)]
    k_buffer = [buf[0, :size + 1] for buf in fused]
    v_buffer = [buf[1, :size + 1] for buf in fused]
    cg = kvguard.guard_cache({f"k{i}": t for i, t in enumerate(k_buffer)}
                             | {f"v{i}": t for i, t in enumerate(v_buffer)}, g)
    slots = allocator.alloc(6)
    assert 0 not in slots.tolist()
    allocator.free(slots[:4])
    assert all(poisoned(v_buffer[1], s, 0) for s in slots[:4].tolist())
    assert not poisoned(k_buffer[0], 0, 0), "the padding slot is never touched"
    poke(v_buffer[1], int(slots[2]), 0)
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        allocator.alloc(size - 2)
    assert info.value.block_ids == (int(slots[2]),)
    assert "v1" in info.value.violation.message
    assert cg.stats.violations == 1
    g.check()


# --- refcounted pools: checksums while revivable, poison at eviction -----------------------------

def test_refcounted_free_blocks_keep_their_contents_until_evicted():
    p = RefcountedPool(8)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC)
    kv = random_cache((8, 4, 16), torch.float16)
    cg = kvguard.guard_cache(kv, g)
    ids = p.allocate(3)
    kv[ids] = 1.5  # the sequences' KV
    p.share(ids[:1])
    before = bits(kv).clone()
    p.free(ids)  # ids[0] still has a reference; ids[1:] drop to zero: cached, revivable
    assert torch.equal(bits(kv), before), "nothing is written while a block may be revived"
    assert cg.pending() == sorted(ids[1:])
    p.share(ids[1:2])  # a prefix-cache hit revives it: its contents are intact
    assert torch.equal(bits(kv)[ids[1]], before[ids[1]])
    p.free(ids[1:2])
    got = p.allocate(5)  # blocks never used before: evicted and poisoned, nothing to verify
    assert all(poisoned(kv, b, 0) for b in got)
    assert g.violations == []
    rest = p.allocate(2)  # now the cached blocks are evicted: verified, then poisoned
    assert sorted(rest) == sorted(ids[1:])
    assert all(poisoned(kv, b, 0) for b in rest)
    assert g.violations == [] and cg.stats.checksummed_blocks >= 2


def test_refcounted_write_while_cached_is_caught_at_eviction():
    p = RefcountedPool(6)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC, on_violation="log")
    kv = vllm_layers(2, 6, torch.float32)
    kvguard.guard_cache(kv, g, block_dim=1, name="L")
    with kvguard.owner("req-9"):
        ids = p.allocate(6)
    for layer in kv:
        layer[:, ids] = 0.5  # the sequence's KV overwrites the poison of the hand-out
    p.free(ids[:2])
    kv[0][1, ids[1], 0, 0, 0] = 1.0
    p.allocate(2)
    (v,) = g.violations
    assert v.kind == "write-after-free" and v.block_ids == (ids[1],)
    assert v.extra["check"] == "checksum" and "checksum" in v.message
    assert "'req-9'" in v.message, "the last owner is the likely stale writer"


@pytest.mark.parametrize("mode", ["log", "repair"])
def test_refcounted_write_while_cached_is_caught_at_revival_without_raising(mode):
    """A share that revives a scribbled cached block is recorded in log and repair mode; the
    share itself goes through and the contents are left as they are (a cache hit reads them)."""
    p = RefcountedPool(6)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC, on_violation=mode)
    kv = random_cache((6, 4, 8), torch.float32)
    cg = kvguard.guard_cache(kv, g)
    ids = p.allocate(2)
    kv[ids] = 0.5  # the sequence's KV
    p.free(ids)
    kv[ids[0], 0, 0] = 7.0
    p.share(ids)
    (v,) = g.violations
    assert v.kind == "write-after-free" and v.block_ids == (ids[0],) and v.method == "share"
    assert g.live[ids[0]].refcount == 1 and cg.pending() == []
    assert float(kv[ids[0], 0, 0]) == 7.0 and bool((kv[ids[1]] == 0.5).all())


def test_quarantine_refused_for_refcounted_pools():
    p = RefcountedPool(4)
    g = kvguard.guard(p, REFCOUNTED_POOL_SPEC)
    with pytest.raises(ValueError, match="refcounted"):
        kvguard.guard_cache(torch.zeros(4, 2), g, quarantine=2)
    assert g._watchers == [] and g.quarantine_size == 0
    with pytest.raises(ValueError, match="refcounted"):
        g.set_quarantine(1)


# --- poison=False: checksums only, nothing written -----------------------------------------------

def test_poison_false_never_writes_and_still_catches():
    a, g = guarded_free_list(8)
    kv = random_cache((2, 8, 4, 8), torch.bfloat16)
    kvguard.guard_cache(kv, g, block_dim=1, poison=False)
    ids = a.allocate(8)
    before = bits(kv).clone()
    a.free(ids[2:5])
    a.free(ids[6:7])
    assert torch.equal(bits(kv), before)
    a.allocate(1)
    kv[1, ids[3], 2, 1] = 7.0
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        a.allocate(3)
    assert info.value.block_ids == (ids[3],)
    assert info.value.violation.extra["check"] == "checksum"


# --- quarantine ----------------------------------------------------------------------------------

def test_quarantine_holds_blocks_first_in_first_out():
    a, g = guarded_free_list(8)
    kvguard.guard_cache(torch.zeros(8, 4), g, quarantine=3)
    ids = a.allocate(8)
    a.free(ids[0:2])
    assert g.held() == ids[0:2] and a.free_blocks == 0
    a.free(ids[2:4])
    assert g.held() == ids[1:4] and a.free_blocks == 1
    assert a.allocate(1) == [ids[0]]
    assert g.check() == {None: (-8, -8)}, "check() counts held blocks as not free"
    a.free(ids[4:8])
    assert g.held() == ids[5:8]
    assert a.free_blocks == 4 and g.check() == {None: (-4, -4)}


def test_quarantine_widens_the_window_a_stale_write_is_caught_in():
    def run(quarantine):
        a, g = guarded_free_list(16, on_violation="log")
        kv = random_cache((16, 4), torch.float32)
        kvguard.guard_cache(kv, g, quarantine=quarantine)
        mine = a.allocate(2)
        a.free(mine)
        other = a.allocate(2)  # the next sequence gets blocks...
        kv[mine[0], 1] = 3.0  # ...while the old owner still writes through its stale table
        a.free(other)
        a.allocate(2)
        return mine, [v.block_ids for v in g.violations]

    mine, found = run(0)
    assert found == [], "LIFO reuse: the block went straight to the next owner, unseen"
    mine, found = run(2)
    assert found == [(mine[0],)], "held back, still poisoned when written, caught on reuse"


def test_quarantine_catch_names_the_block_and_keeps_the_ledger_straight():
    a, g = guarded_free_list(16, on_violation="log")
    kv = random_cache((16, 4), torch.float32)
    kvguard.guard_cache(kv, g, quarantine=4)
    mine = a.allocate(2)
    a.free(mine)
    other = a.allocate(2)
    assert set(other).isdisjoint(mine), "held blocks are not handed out again"
    kv[mine[0], 1] = 3.0
    a.free(other)
    a.free(a.allocate(2))  # six freed, four held: the first two go back to the allocator
    assert g.held() == other + [4, 5] and a.free_blocks == 12
    g.check()
    a.allocate(12)
    (v,) = g.violations
    assert v.block_ids == (mine[0],)
    g.check()


def test_unguard_releases_held_blocks():
    a, g = guarded_free_list(8)
    kvguard.guard_cache(torch.zeros(8, 4), g, quarantine=4)
    a.free(a.allocate(6))
    assert len(g.held()) == 4 and a.free_blocks == 4
    g.unguard()
    assert a.free_blocks == 8 and g.held() == []
    assert sorted(a.allocate(8)) == list(range(8))


def test_quarantine_zero_releases_everything_at_once():
    a, g = guarded_free_list(8)
    kvguard.guard_cache(torch.zeros(8, 4), g, quarantine=5)
    a.free(a.allocate(4))
    assert len(g.held()) == 4
    g.set_quarantine(0)
    assert g.held() == [] and a.free_blocks == 8
    g.check()


@pytest.mark.parametrize("mode", ["raise", "log", "repair"])
def test_quarantine_in_every_mode_against_a_double_free(mode):
    a, g = guarded_free_list(8, on_violation=mode)
    kv = random_cache((8, 4), torch.float32)
    kvguard.guard_cache(kv, g, quarantine=3)
    ids = a.allocate(4)
    a.free(ids[:2])
    if mode == "raise":
        with pytest.raises(kvguard.DoubleFreeError):
            a.free([ids[0], ids[2]])
        assert g.held() == ids[:2]
    else:
        a.free([ids[0], ids[2]])
        assert [v.kind for v in g.violations] == ["double-free"]
        # Quarantine takes only the valid id in both modes: the allocator never sees ids[0]
        # twice, whatever the mode forwards otherwise.
        assert g.held() == ids[:3]
    assert a.free_blocks == 4
    g.check()


def test_quarantine_with_a_tensor_allocator_releases_a_tensor():
    allocator = TokenSlots(8)
    g = kvguard.guard(allocator, SGLANG_SPEC)
    kvguard.guard_cache(torch.zeros(9, 4), g, quarantine=2)
    slots = allocator.alloc(5)
    allocator.free(slots)
    assert len(g.held()) == 2 and allocator.available_size() == 6
    assert allocator.free_pages.dtype == torch.int64
    g.unguard()
    assert allocator.available_size() == 8


# --- attaching, detaching, checkpoints, sub-pools ------------------------------------------------

def test_bad_input_changes_nothing():
    a, g = guarded_free_list(8)
    good = torch.zeros(8, 4)
    cases = [
        (TypeError, lambda: kvguard.guard_cache([1, 2], g)),
        (TypeError, lambda: kvguard.guard_cache(good.bool(), g)),
        (TypeError, lambda: kvguard.guard_cache(torch.zeros(8, dtype=torch.complex64), g)),
        (ValueError, lambda: kvguard.guard_cache(good, g, block_dim=2)),
        (TypeError, lambda: kvguard.guard_cache(good, g, block_dim=True)),
        (ValueError, lambda: kvguard.guard_cache(torch.zeros(4, 8), g)),
        (ValueError, lambda: kvguard.guard_cache(torch.zeros(8, 0), g)),
        (TypeError, lambda: kvguard.guard_cache(good, LinkedFreeList(8))),
        (TypeError, lambda: kvguard.guard_cache(good, object())),
        (ValueError, lambda: kvguard.guard_cache(good, g, quarantine=-1)),
        (ValueError, lambda: kvguard.guard_cache(good, g, quarantine=True)),
        (TypeError, lambda: kvguard.guard_cache(good, g, poison=0)),
        (ValueError, lambda: kvguard.guard_cache([], g)),
        (ValueError, lambda: kvguard.guard_cache([good, good], g)),
        (TypeError, lambda: kvguard.guard_cache("cache", g)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()
        assert g._watchers == [] and g not in cache_module._WATCHERS
        assert g.quarantine_size == 0
    cg = kvguard.guard_cache(good, g)
    with pytest.raises(ValueError, match="already guarded"):
        kvguard.guard_cache({"again": good, "new": torch.zeros(8, 2)}, g)
    assert list(cg.tensors) == ["cache"]


def test_one_watcher_per_guard_and_unique_names():
    a, g = guarded_free_list(8)
    first = kvguard.guard_cache(torch.zeros(8, 2), g)
    second = kvguard.guard_cache(torch.zeros(8, 3), g)
    assert first is second and g._watchers == [first]
    assert list(first.tensors) == ["cache", "cache#2"]
    assert kvguard.guard_cache(torch.zeros(8, 1), a) is first, "a guarded allocator works too"


def test_unguard_detaches_and_stops_poisoning():
    a, g = guarded_free_list(8)
    kv = random_cache((8, 4), torch.float32)
    cg = kvguard.guard_cache(kv, g)
    ids = a.allocate(2)
    g.unguard()
    assert cg.tensors == {} and g._watchers == [] and g not in cache_module._WATCHERS
    a.free(ids)
    assert not kv[ids].isnan().any()


def test_remove_stops_watching_but_keeps_guarding():
    a, g = guarded_free_list(8)
    kv = random_cache((8, 4), torch.float32)
    cg = kvguard.guard_cache(kv, g)
    cg.remove()
    ids = a.allocate(2)
    a.free(ids)
    assert not kv[ids].isnan().any()
    with pytest.raises(kvguard.DoubleFreeError):
        a.free(ids)  # noqa: KVG104 (the guard still guards)
    assert kvguard.guard_cache(kv, g) is not cg, "a fresh watcher after remove()"


def test_attaching_late_covers_blocks_already_free():
    a, g = guarded_free_list(8)
    ids = a.allocate(4)
    a.free(ids[:2])
    kv = random_cache((8, 4), torch.float32)
    cg = kvguard.guard_cache(kv, g)
    assert cg.pending() == sorted(ids[:2]) and all(poisoned(kv, b, 0) for b in ids[:2])
    assert not poisoned(kv, ids[2], 0), "live blocks are never touched"
    assert not poisoned(kv, 7, 0), "never handed out: maybe live from before the guard"


def test_verify_reports_a_write_once_at_a_checkpoint():
    a, g = guarded_free_list(8, on_violation="log")
    kv = random_cache((8, 4), torch.float32)
    cg = kvguard.guard_cache(kv, g)
    ids = a.allocate(4)
    a.free(ids)
    assert cg.verify() == []
    kv[ids[2], 0] = 1.0
    (v,) = cg.verify()
    assert v.block_ids == (ids[2],) and v.method == "verify"
    assert g.violations == [v]
    assert cg.verify() == [], "poisoned afresh: one write, one report"
    kv[ids[1], 0] = 1.0
    g.mode = "raise"
    with pytest.raises(kvguard.WriteAfterFreeError):
        cg.verify()


def test_log_mode_hands_out_and_records():
    a, g = guarded_free_list(8, on_violation="log")
    kv = random_cache((8, 4), torch.float32)
    kvguard.guard_cache(kv, g)
    ids = a.allocate(2)
    a.free(ids)
    kv[ids[0], 0] = 2.0
    got = a.allocate(2)
    assert sorted(got) == sorted(ids)
    assert [v.kind for v in g.violations] == ["write-after-free"]


class CacheGroups:
    """DeepSpeed's BlockedKVCache shape of API: one free list per cache group."""

    def __init__(self, n, groups=2):
        self.lists = [LinkedFreeList(n) for _ in range(groups)]

    def allocate(self, n, cache_group=0):
        return self.lists[cache_group].allocate(n)

    def free(self, blocks, cache_group=0):
        self.lists[cache_group].free(blocks)


def test_sub_pools_poison_only_their_own_tensors():
    c = CacheGroups(8)
    g = kvguard.guard(c, kvguard.AllocatorSpec(pool_arg="cache_group", size=lambda c: 8))
    g0, g1 = random_cache((8, 4), torch.float32), random_cache((8, 4), torch.float32, seed=1)
    kvguard.guard_cache(g0, g, pool=0, name="group0")
    kvguard.guard_cache(g1, g, pool=1, name="group1")
    a = c.allocate(2, cache_group=0)
    b = c.allocate(2, cache_group=1)
    c.free(a, cache_group=0)
    assert g0[a].isnan().all() and not g1.isnan().any()
    c.free(b, cache_group=1)
    g1[b[1], 0] = 1.0
    c.allocate(2, cache_group=0)
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        c.allocate(2, cache_group=1)
    assert info.value.violation.pool == 1 and "group1" in info.value.violation.message


def test_mixed_dtypes_and_devices_in_one_guard():
    a, g = guarded_free_list(8)
    tensors = {"k": random_cache((8, 4), torch.bfloat16), "k_scale": torch.ones(8, 2),
               "v": random_cache((8, 4), torch.float8_e4m3fn),
               "q": torch.zeros(8, 4, dtype=torch.int8)}
    cg = kvguard.guard_cache(tensors, g)
    assert len({(grp.device, grp.pattern) for grp in cg._pools[None].groups}) == 4
    ids = a.allocate(3)
    a.free(ids)
    bits(tensors["q"])[ids[1], 2] = 5
    tensors["k_scale"][ids[2], 1] = 0.5
    with pytest.raises(kvguard.WriteAfterFreeError) as info:
        a.allocate(3)
    assert info.value.block_ids == tuple(sorted(ids[1:]))
    assert info.value.violation.extra["tensors"] == f"{min(ids[1:])}: " + (
        "q" if ids[1] < ids[2] else "k_scale") + f"; {max(ids[1:])}: " + (
        "k_scale" if ids[1] < ids[2] else "q")


# --- the model: a write to a free, poisoned block is reported exactly when it is handed out -----

class CacheMachine(RuleBasedStateMachine):
    """LinkedFreeList + two cache tensors in log mode, with or without quarantine and poison: a
    block that changed between its free and its next hand-out is reported exactly then, with
    exactly those blocks; writes into live blocks never are. In poison mode every freed block
    holds the poison until it is written."""

    @initialize(quarantine=st.sampled_from([0, 0, 2, 5]), poison=st.booleans())
    def setup(self, quarantine, poison):
        self.n = 12
        self.poison = poison
        self.allocator = LinkedFreeList(self.n)
        self.guard = kvguard.guard(self.allocator, LINKED_FREE_LIST_SPEC, on_violation="log")
        self.k = random_cache((self.n, 3), torch.float16)
        self.v = random_cache((2, self.n, 2), torch.int8)
        kvguard.guard_cache(self.k, self.guard, quarantine=quarantine, poison=poison)
        kvguard.guard_cache(self.v, self.guard, block_dim=1, poison=poison)
        self.live = []
        self.at_free = {}  # block freed under the guard, not handed out since -> its bits then
        self.writes = 0

    def contents(self, b):
        return bits(self.k[b]).tolist(), bits(self.v[:, b]).tolist()

    @precondition(lambda self: self.allocator.free_blocks > 0)
    @rule(data=st.data())
    def allocate(self, data):
        n = data.draw(st.integers(1, self.allocator.free_blocks))
        before = len(self.guard.violations)
        got = self.allocator.allocate(n)
        expected = sorted(b for b in got
                          if b in self.at_free and self.contents(b) != self.at_free[b])
        found = [v.block_ids for v in self.guard.violations[before:]]
        assert found == ([tuple(expected)] if expected else [])
        for b in got:
            self.at_free.pop(b, None)
        self.live += got

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.live), min_size=1, unique=True))
        self.allocator.free(ids)
        self.live = [b for b in self.live if b not in ids]
        for b in ids:
            self.at_free[b] = self.contents(b)
            if self.poison:
                assert poisoned(self.k, b, 0) and poisoned(self.v, b, 1)

    @rule(block=st.integers(0, 11), which=st.booleans())
    def write(self, block, which):
        self.writes += 1
        if which:
            self.k[block, 1] = self.writes % 1000 + 0.5
        else:
            bits(self.v)[1, block, 0] = self.writes % 97 + 1

    @invariant()
    def ledger_agrees(self):
        if hasattr(self, "guard"):
            self.guard.check()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# --- CUDA: host syncs -----------------------------------------------------------------------

@pytest.mark.skipif(not CUDA, reason="no GPU")
def test_cuda_one_host_sync_per_hand_out_and_none_per_free():
    a, g = guarded_free_list(64)
    cg = kvguard.guard_cache(vllm_layers(8, 64, device="cuda"), g, block_dim=1)

    def syncs(call):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)]

    for steady in (False, True):  # the first pass allocates pinned staging memory
        ids = a.allocate(40)
        torch.cuda.synchronize()
        scattered, run = syncs(lambda: a.free(ids[::3])), syncs(lambda: a.free(ids[1:3]))
        before = cg.stats.host_syncs
        handout = syncs(lambda: a.allocate(20))
        a.free(list(g.ledger().live_ids()))
    assert scattered == [], "scattered free: pinned upload, no sync"
    assert run == [], "a run of blocks: views, no upload"
    assert len(handout) == 1 and cg.stats.host_syncs == before + 1
