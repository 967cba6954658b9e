"""LMCache 0.5.6: a page is held by its cache key. The real ``PagedTensorMemoryAllocator`` and
``TensorMemoryObj`` (``ref_count_up`` / ``ref_count_down``, which frees at 0) and the real
``LocalCPUBackend`` methods ``submit_put_task``, ``get_blocking`` and ``remove``, executed from
the wheel's ``local_cpu_backend.py``. Its constructor needs LMCache's configuration, metrics and
allocator stack, so the backend object is built with the state those methods read (a dict as
``hot_cache``, its lock, a no-op cache policy, no message sender): a faithful small model of
the rest, said here."""

from __future__ import annotations

import threading
from contextlib import nullcontext

import pytest

import kvguard

from . import engines
from .test_lmcache import allocator


class Policy:
    """The cache policy's hooks these methods call (a no-op: eviction order is not tested)."""

    def update_on_put(self, key):
        pass

    def update_on_hit(self, key, cache):
        pass

    def update_on_force_evict(self, key):
        pass


@pytest.fixture
def lm():
    with engines.loaded("lmcache") as ns:
        modules = engines.Modules()
        try:
            from typing import Any, Callable, List, Optional, Sequence, Union
            cls = modules.load_class(
                engines.archive("lmcache"), "lmcache/v1/storage_backend/local_cpu_backend.py",
                "lmcache.v1.storage_backend.local_cpu_backend", "LocalCPUBackend",
                AllocatorBackendInterface=type("AllocatorBackendInterface", (), {}),
                nullcontext=nullcontext, threading=threading, Any=Any, Callable=Callable,
                List=List, Optional=Optional, Sequence=Sequence, Union=Union,
                _lmcache_nvtx_annotate=lambda f: f, torch_device_type="cpu", torch=lm_torch())
            ns.LocalCPUBackend = cls
            yield ns
        finally:
            modules.close()


def lm_torch():
    import torch
    return torch


def backend(lm):
    b = object.__new__(lm.LocalCPUBackend)
    b.hot_cache, b.cpu_lock, b.cache_policy = {}, threading.Lock(), Policy()
    b.batched_msg_sender, b.use_hot, b.keys_in_request = None, True, []
    return b


def put(b, a, key, shape_dtype):
    """LMCache's store path: allocate (one reference, the caller's), put under the key (one
    more, the key's), the caller lets go of its own."""
    obj = a.allocate(*shape_dtype)
    b.submit_put_task(key, obj)
    obj.ref_count_down()
    return obj


def test_pages_are_held_by_their_key_and_correct_use_reports_nothing(lm):
    kvguard.instrument()
    a, shape_dtype = allocator(lm, pages=2)
    g = kvguard.guard_of(a)
    b = backend(lm)
    one = put(b, a, "K1", shape_dtype)
    assert g.live[one.meta.address].holder == "K1"
    reader = b.get_blocking("K1")           # a retrieval holds it too
    b.remove("K1")                          # evicted while read: the reader keeps the page
    assert g.live[one.meta.address].holder is None
    reader.ref_count_down()                 # the reader done: the page goes back
    two = put(b, a, "K2", shape_dtype)
    three = put(b, a, "K3", shape_dtype)
    b.remove("K3")
    b.remove("K2")
    assert {two.meta.address, three.meta.address} == {0, 1}
    assert g.violations == [] and g.live == {} and len(a.free_blocks) == 2


@pytest.mark.parametrize("mode", ["raise", "repair"])
def test_removing_a_key_whose_page_went_to_another_key_is_stale(lm, mode, quiet_kvguard_log):
    """A reader releases once too often (LMCache#5005's clamp makes that silent): K1's page goes
    back while K1 still files it, K2 is handed the page, then K1's eviction frees it again."""
    kvguard.instrument(on_violation=mode)
    a, shape_dtype = allocator(lm, pages=1)
    g = kvguard.guard_of(a)
    b = backend(lm)
    obj = put(b, a, "K1", shape_dtype)
    reader = b.get_blocking("K1")
    reader.ref_count_down()
    reader.ref_count_down()                 # one too many: the page is free, K1 still files it
    assert put(b, a, "K2", shape_dtype) is obj
    if mode == "raise":
        with pytest.raises(kvguard.StaleFreeError) as info:
            b.remove("K1")
        assert "'K2' holds it" in str(info.value)
    else:
        b.remove("K1")
    assert [v.kind for v in g.violations] == ["stale-free"]
    assert len(a.free_blocks) == 0 and g.live[obj.meta.address].holder == "K2"
