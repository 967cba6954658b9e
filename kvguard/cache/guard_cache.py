"""Guarding the KV cache itself: freed blocks are poisoned, and checked when handed out again.

The ledger knows who owns a block; the cache tensor is where a stale owner does the damage. A
sequence that keeps writing through a freed block's slot mapping corrupts whoever gets the block
next, and nothing the allocator sees changes. ``guard_cache`` ties cache tensors (K and V of every
layer, scales; any device) to a guard the way AddressSanitizer ties shadow memory to malloc:

- on free, the freed blocks are filled with poison on the tensor's own device: NaN for float
  dtypes (a stale reader then sees NaN, not plausible numbers), a sentinel byte for int8, uint8
  and fp8, the most negative value for wider integers;
- on hand-out, the blocks are checked in one batched reduction per device: one host sync per
  allocation call, whatever the number of layers and blocks. A block that no longer holds its
  poison was written after it was freed: ``write-after-free``, naming the block and the tensors.

A refcounted pool (vLLM's prefix cache) keeps a freed block's contents for a later cache hit to
revive, so nothing is written into a block while it may be revived: its checksum is taken when
its last reference drops, compared when the pool hands it out again (the moment the pool evicts
it) or when a share revives it (a prefix-cache hit hands its contents to a new request), and
only at eviction is it poisoned. ``poison=False`` uses checksums for every pool and never
writes into the cache. See docs/cache.md.
"""

from __future__ import annotations

import weakref

from .. import kinds
from ..guard import Guard, guard_of
from .poison import Entry, PoolState, Selection, tombstones

_WATCHERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Guard -> its CacheGuard: every ``guard_cache`` call for one guard feeds one watcher, so a
hand-out is verified in one batched reduction across all of the guard's tensors."""


def guard_cache(cache, guard, *, block_dim: int = 0, pool=None, quarantine: int | None = None,
                poison: bool = True, name: str | None = None) -> "CacheGuard":
    """Poison the blocks ``guard``'s allocator frees in ``cache``; verify them when handed out.

    ``cache``: a tensor, a list/tuple of tensors, or a mapping name -> tensor (K and V of every
    layer, scale tensors), on any device; each has the pool's blocks along ``block_dim`` (vLLM's
    ``[2, num_blocks, block_size, heads, dim]``: 1; SGLang's token-slot buffers: 0). ``guard``:
    a ``kvguard.Guard`` or a guarded allocator. ``pool``: the sub-pool the tensors belong to
    (``AllocatorSpec.pool_arg``: DeepSpeed's cache group). ``quarantine=N`` holds freed blocks
    back from the allocator until N more are freed (``Guard.set_quarantine``), widening the
    window in which a stale writer is caught. ``poison=False`` never writes into the cache and
    compares checksums instead (refcounted pools always start with checksums; see the module
    docstring). ``name`` labels the tensors in reports.

    Calls for one guard add to one ``CacheGuard``, which is returned. Bad input raises
    ``TypeError``/``ValueError`` and changes nothing.
    """
    import torch

    g = guard if isinstance(guard, Guard) else guard_of(guard)
    if g is None:
        raise TypeError(f"guard_cache() needs a kvguard.Guard or a guarded allocator, not "
                        f"{type(guard).__name__}: guard the allocator first with "
                        "kvguard.guard(allocator)")
    if not g.guarded:
        raise ValueError(f"{g.name} was unguarded: guard its allocator again first")
    if not isinstance(poison, bool):
        raise TypeError(f"poison must be True or False, not {poison!r}")
    if quarantine is not None and (isinstance(quarantine, bool) or not isinstance(quarantine, int)
                                   or quarantine < 0):
        raise ValueError(f"quarantine must be a block count >= 0, not {quarantine!r}")
    if quarantine and g.spec.refcounted:
        raise ValueError("quarantine needs a non-refcounted pool: a refcounted allocator must "
                         "see every reference drop (its freed blocks stay revivable)")
    named = _named_tensors(cache, name, torch)
    with g.lock:
        watcher = _WATCHERS.get(g)
        taken = watcher.names() if watcher is not None else set()
        size = g.ledger(pool).size
        entries = []
        for label, tensor in named:
            label = _unique(label, taken)
            taken.add(label)
            entries.append(Entry(label, tensor, block_dim, poison, size, torch))
        seen = {id(e.tensor) for e in watcher.entries()} if watcher is not None else set()
        for e in entries:
            if id(e.tensor) in seen:
                raise ValueError(f"tensor {e.name!r} is already guarded by this guard")
            seen.add(id(e.tensor))
        if quarantine is not None:
            g.set_quarantine(quarantine)
        if watcher is None:
            watcher = _WATCHERS[g] = CacheGuard(g)
            g.add_watcher(watcher)
        watcher._add(pool, entries, torch)
        return watcher


class CacheStats:
    """What a CacheGuard did; ``host_syncs`` counts waits on a non-CPU device."""

    __slots__ = ("tensors", "poisoned_blocks", "checksummed_blocks", "verified_blocks",
                 "verify_calls", "host_syncs", "violations")

    def __init__(self) -> None:
        self.tensors = self.poisoned_blocks = self.checksummed_blocks = 0
        self.verified_blocks = self.verify_calls = self.host_syncs = self.violations = 0

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        return f"CacheStats({self.to_dict()})"


class CacheGuard:
    """The watcher ``guard_cache`` attaches to a guard: one per guard, holding all its tensors.

    ``on_free``/``on_alloc``/``on_share`` are called by the guard under its lock (kvguard.guard's
    watcher protocol). ``verify()`` checks the free blocks now, without waiting for a hand-out.
    """

    def __init__(self, guard: Guard) -> None:
        self._guard = weakref.ref(guard)
        self._pools: dict = {}
        self.stats = CacheStats()

    @property
    def guard(self):
        return self._guard()

    @property
    def tensors(self) -> dict:
        """Name -> tensor, every tensor this guard watches."""
        return {e.name: e.tensor for e in self.entries()}

    def entries(self) -> list:
        return [e for state in self._pools.values() for e in state.entries]

    def names(self) -> set:
        return {e.name for e in self.entries()}

    def pending(self, pool=None) -> list:
        """Free blocks poisoned (or checksummed) and not yet verified, ascending."""
        state = self._pools.get(pool)
        if state is None:
            return []
        marks = state.marks
        return [b for b in range(state.extent) if marks[b]]

    # --- the watcher protocol ----------------------------------------------------------------

    def on_free(self, guard, pool, ids) -> None:
        state = self._pools.get(pool)
        if state is None or not ids:
            return
        extent = state.extent
        ids = sorted({b for b in ids if b < extent})
        if ids:
            self._mark(state, ids)

    def on_alloc(self, guard, pool, ids):
        state = self._pools.get(pool)
        if state is None or not ids:
            return ()
        marks, extent = state.marks, state.extent
        fresh = sorted({b for b in ids if b < extent})
        todo = [b for b in fresh if marks[b]]
        changed = {}
        if todo:
            changed = self._verify(state, todo)
            for b in todo:
                marks[b] = 0
        if state.evict_poison and fresh:
            self._evict(state, Selection(fresh))
        if not changed:
            return ()
        return [self._finding(state, changed)]

    def on_share(self, guard, pool, ids):
        """A share revived free blocks (a prefix-cache hit on a block still cached): a new owner
        reads their contents as they are, so they are verified now, and nothing is poisoned."""
        state = self._pools.get(pool)
        if state is None or not ids:
            return ()
        marks, extent = state.marks, state.extent
        todo = sorted({b for b in ids if b < extent and marks[b]})
        if not todo:
            return ()
        changed = self._verify(state, todo)
        for b in todo:
            marks[b] = 0
        return [self._finding(state, changed)] if changed else ()

    def detach(self) -> None:
        """Called by ``Guard.unguard()``: forget the tensors (the cache memory is the engine's)."""
        guard = self._guard()
        if guard is not None and _WATCHERS.get(guard) is self:
            del _WATCHERS[guard]
        self._pools.clear()

    def remove(self) -> None:
        """Stop watching: the guard keeps guarding the allocator, the cache is left as it is."""
        guard = self._guard()
        if guard is not None:
            guard.remove_watcher(self)
        self.detach()

    def verify(self, pool=None) -> list:
        """Check every pending free block now (a checkpoint, the end of a test): changed blocks
        are reported as ``write-after-free`` (raised in raise mode) and poisoned afresh, so one
        write is reported once. Returns the violations."""
        guard = self._guard()
        if guard is None:
            return []
        found = []
        with guard.lock:
            for key, state in list(self._pools.items()):
                if pool is not None and key != pool:
                    continue
                todo = [b for b in range(state.extent) if state.marks[b]]
                if not todo:
                    continue
                changed = self._verify(state, todo)
                if changed:
                    self._mark(state, sorted(changed))
                    kind, ids, message, extra = self._finding(state, changed)
                    v = guard.violation(kind, ids, message, "verify", key)
                    v.extra.update(extra)
                    found.append(v)
            guard.settle(found)  # raises in raise mode
        return found

    # --- internals ---------------------------------------------------------------------------

    def _add(self, pool, entries, torch) -> None:
        guard = self._guard()
        state = self._pools.get(pool)
        if state is None:
            state = self._pools[pool] = PoolState(pool, guard.spec.refcounted)
        state.add(entries)
        self.stats.tensors += len(entries)
        # Blocks the guard saw freed are free now: cover them too, from here on.
        freed = tombstones(guard.ledger(pool), state.extent, torch)
        if freed:
            self._mark(state, freed)

    def _mark(self, state, ids) -> None:
        """At free: poison (or checksum) ``ids`` (sorted, unique, in range) in every tensor."""
        sel = Selection(ids)
        for group in state.groups:
            if group.checksum:
                group.store(sel)
                self.stats.checksummed_blocks += len(ids)
            else:
                for entry in group.entries:
                    entry.fill(sel)
                self.stats.poisoned_blocks += len(ids)
        marks = state.marks
        for b in ids:
            marks[b] = 1
        guard = self._guard()
        if guard is not None:
            ledger = guard.ledger(state.pool)
            if len(ledger.stamp) >= state.extent:
                origin, freed_at = ledger.origin, ledger.freed_at
                for b in ids:
                    state.sites[b] = (origin[b], freed_at[b])

    def _evict(self, state, sel) -> None:
        """A refcounted pool hands out a free block: its cached contents die now, poison it."""
        for entry in state.entries:
            if entry.poison:
                entry.fill(sel)
        self.stats.poisoned_blocks += sel.n

    def _verify(self, state, ids) -> dict:
        """Block -> names of the tensors in which it changed while free. One reduction and one
        host sync per device on the clean path; the search for the culprits runs only after a
        failed check."""
        import torch

        sel = Selection(ids)
        self.stats.verify_calls += 1
        self.stats.verified_blocks += len(ids)
        by_device = {}
        for group in state.groups:
            by_device.setdefault(group.device, []).append((group, group.check(sel)))
        changed = {}
        for device, checks in by_device.items():
            oks = [ok for _, (ok, _) in checks]
            ok = oks[0] if len(oks) == 1 else torch.stack(oks).all()
            if device.type != "cpu":
                self.stats.host_syncs += 1
            if ok.item():
                continue
            for group, (_, detail) in checks:
                for b, entry in group.culprits(sel, detail):
                    changed.setdefault(b, []).append(entry.name)
        return changed

    def _finding(self, state, changed):
        self.stats.violations += 1
        ids = tuple(sorted(changed))
        checksum = state.refcounted or not any(e.poison for e in state.entries)
        how = "differ from their checksum taken at free" if checksum else \
            "no longer hold their poison"
        parts, culprits = [], []
        for b in ids[:6]:
            names = changed[b]
            shown = ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")
            origin, freed = state.sites.pop(b, (0, 0))
            whose = _last_owner(origin, freed)
            parts.append(f"block {b} in {shown}{whose}")
            if whose:
                culprits.append(f"{b}{whose}")
        for b in ids[6:]:
            state.sites.pop(b, None)
        more = f"; and {len(ids) - 6} more blocks" if len(ids) > 6 else ""
        message = (
            f"{len(ids)} block(s) changed while they were free ({how}; "
            f"{len(state.entries)} tensor(s) watched): {'; '.join(parts)}{more}. Something "
            "wrote to them after they were freed, most likely their last owner through a stale "
            "block table or slot mapping; the new owner's KV state is now garbage")
        extra = {"tensors": "; ".join(f"{b}: {', '.join(changed[b])}" for b in ids),
                 "check": "checksum" if checksum else "poison"}
        if culprits:
            extra["last_owners"] = ";".join(culprits)
        return kinds.WRITE_AFTER_FREE, ids, message, extra

    def __repr__(self) -> str:
        guard = self._guard()
        name = guard.name if guard is not None else "<gone>"
        return f"<kvguard.CacheGuard of {name}: {len(self.entries())} tensor(s)>"


def _last_owner(origin, freed) -> str:
    """" (last owner 'req-7', allocated at f.py:10, freed at g.py:20)", or "" if unknown."""
    from ..owners import OWNERS
    from ..stacks import SITES
    from ..violation import user_frames

    said = []
    label = OWNERS.labels[SITES.owner(origin)] if origin else None
    if label is not None:
        said.append(f"last owner {label!r}")
    for what, site in (("allocated", origin), ("freed", freed)):
        frames = user_frames(SITES.pairs(site)) if site else []
        if frames:
            said.append(f"{what} at {frames[0].filename}:{frames[0].lineno}")
    return f" ({', '.join(said)})" if said else ""


def _named_tensors(cache, name, torch) -> list:
    if isinstance(cache, torch.Tensor):
        return [(name or "cache", cache)]
    if isinstance(cache, dict):
        if not cache:
            raise ValueError("guard_cache() got an empty mapping of cache tensors")
        prefix = f"{name}." if name else ""
        return [(f"{prefix}{key}", t) for key, t in cache.items()]
    if isinstance(cache, (list, tuple)):
        if not cache:
            raise ValueError("guard_cache() got an empty list of cache tensors")
        return [(f"{name or 'cache'}[{i}]", t) for i, t in enumerate(cache)]
    raise TypeError(f"guard_cache() takes a tensor, a list of tensors or a mapping name -> "
                    f"tensor, not {type(cache).__name__}")


def _unique(label, taken) -> str:
    if label not in taken:
        return label
    n = 2
    while f"{label}#{n}" in taken:
        n += 1
    return f"{label}#{n}"
