"""Quarantine: freed blocks held back from the allocator for a while (AddressSanitizer's).

A stale reference then keeps pointing at poisoned, unused memory for longer, which is the window
in which ``kvguard.cache`` catches a write-after-free. Blocks leave first-in, first-out once more
than ``size`` are held, and all at once on ``release_all`` (unguard, a copy, ``size`` set to 0).
"""

from __future__ import annotations

import collections


class Quarantine:
    """The blocks one guard holds back, per sub-pool. The guard's lock covers every call."""

    __slots__ = ("size", "pools", "tensor_like")

    def __init__(self) -> None:
        self.size = 0
        self.pools: dict = {}
        self.tensor_like = None
        """The last tensor ids came in: held blocks go back in its dtype and device."""

    def enter(self, pool, ids, plan) -> list:
        """Hold ``ids`` (freed by ``plan``'s call); returns the ids that leave, oldest first.
        Their objects (``id_attr`` specs) go into ``plan.held_objects``."""
        fifo = self.pools.setdefault(pool, collections.OrderedDict())
        norm = plan.norm
        objects = dict(zip(norm.ids, norm.objects)) if norm.objects is not None else {}
        if norm.tensor is not None:
            self.tensor_like = norm.tensor
        for b in ids:
            fifo[b] = objects.get(b)
        released = []
        while len(fifo) > self.size:
            b, obj = fifo.popitem(last=False)
            released.append(b)
            plan.held_objects[b] = obj
        return released

    def holding(self) -> bool:
        return any(self.pools.values())

    def held(self, pool) -> list:
        return list(self.pools.get(pool, ()))

    def count(self, pool) -> int:
        return len(self.pools.get(pool, ()))

    def forget(self, pool) -> None:
        """The allocator took its blocks back by itself (a reset, a resize)."""
        self.pools.pop(pool, None)

    def release_all(self, spec, free_param, pool_param, free):
        """Give every held block back through ``free`` (the allocator's own, unguarded)."""
        for pool, fifo in list(self.pools.items()):
            if not fifo:
                continue
            ids = list(fifo)
            objects = list(fifo.values())
            fifo.clear()
            value = objects if spec.id_attr else ids
            like = self.tensor_like
            if like is not None and spec.tensor_ok:
                torch = __import__("torch")
                value = torch.tensor(ids, dtype=like.dtype, device=like.device)
            args, kwargs = free_param.put((), {}, value)
            if pool_param is not None and pool is not None:
                args, kwargs = pool_param.put(args, kwargs, pool)
            free(*args, **kwargs)
