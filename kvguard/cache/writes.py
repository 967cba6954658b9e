"""Checked cache writes: every block an engine's cache-write kernel targets must be the writer's.

Poisoning (kvguard.cache) catches a stale write when the block is handed out again; checking the
write itself catches it as it happens, with the writer's stack. ``guard_writes`` wraps the
function that scatters new K/V into the cache, given the argument that says where the tokens go:

- a slot mapping (vLLM's ``reshape_and_cache[_flash](key, value, key_cache, value_cache,
  slot_mapping, ...)``, SGLang's ``set_kv_buffer(layer, loc, cache_k, cache_v)``): token slot
  ``s`` lies in block ``s // block_size``;
- a block table (2-D, one row per sequence, or 1-D): every entry is a block the call may write.

A target block must be live (a freed one is ``write-after-free``, one never handed out is
``stale-table``), not shared by several references (``shared-block``: copy it first; a block
table's shared prefix blocks are read, so the table form does not ask this), and, when the write
runs inside ``kvguard.owner(label)``, owned by that label (else ``stale-table``). Padding entries
(negative, or equal to ``pad``) are skipped.

In raise mode a bad write never reaches the cache; log mode records and writes; repair mode
redirects the bad slots to ``pad`` (the slot the engine's own padding writes to: vLLM skips -1,
SGLang sends padding to slot 0), so the stale write lands nowhere that matters. The slot mapping
is read once per distinct tensor while the ledger is unchanged: every layer of a step passes the
same one, and one host sync serves them all.
"""

from __future__ import annotations

import functools
import sys

from .. import kinds
from ..guard import Guard, guard_of
from ..guard.arguments import MISSING, Param
from ..ids import torch_tensor_type
from ..owners import OWNERS, current_owner


def guard_writes(fn, guard, *, slots=None, table=None, block_size: int = 1, pad: int = -1,
                 pool=None, shared_ok: bool = False):
    """Wrap the cache-write function ``fn``; returns the checked function (``__wrapped__`` is
    ``fn``). ``slots`` or ``table`` names the argument (by name, or position counted as ``fn``
    takes it) holding the slot mapping or the block table; ``block_size`` is tokens per block
    (slots only); ``pad`` the padding slot or block; ``pool`` the sub-pool of the blocks;
    ``shared_ok=True`` allows writes into blocks with several references."""
    if not callable(fn):
        raise TypeError(f"guard_writes() needs the cache-write function, not "
                        f"{type(fn).__name__}")
    g = guard if isinstance(guard, Guard) else guard_of(guard)
    if g is None:
        raise TypeError(f"guard_writes() needs a kvguard.Guard or a guarded allocator, not "
                        f"{type(guard).__name__}: guard the allocator first with "
                        "kvguard.guard(allocator)")
    if (slots is None) == (table is None):
        raise TypeError("guard_writes() takes exactly one of slots= (the slot-mapping "
                        "argument) or table= (the block-table argument)")
    where = slots if slots is not None else table
    if isinstance(where, bool) or not isinstance(where, (int, str)):
        raise TypeError(f"slots=/table= names an argument of {_name(fn)}() by name or "
                        f"position, not {where!r}")
    for label, value in (("block_size", block_size), ("pad", pad)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, not {value!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, not {block_size}")
    param = Param(fn, where)
    if not param.found:
        raise TypeError(f"{_name(fn)}() has no parameter {where!r}")
    checker = _WriteChecker(g, param, _name(fn), slots is not None, block_size, pad, pool,
                            shared_ok)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        value = param.get(args, kwargs)
        if value is not MISSING:
            fixed = checker.check(value)
            if fixed is not None:
                args, kwargs = param.put(args, kwargs, fixed)
        return fn(*args, **kwargs)

    checked.__kvguard__ = g
    checked.checker = checker
    return checked


class _WriteChecker:
    """The checks of one wrapped write function; remembers the last clean slot mapping."""

    def __init__(self, guard, param, method, is_slots, block_size, pad, pool, shared_ok):
        self.guard = guard
        self.param = param
        self.method = method
        self.is_slots = is_slots
        self.block_size = block_size
        self.pad = pad
        self.pool = pool
        self.shared_ok = shared_ok
        self.checks = 0
        """Slot mappings / tables actually read (the others were the last clean one again)."""
        self._last = None

    def _version(self) -> int:
        s = self.guard.stats
        return s.alloc_calls + s.free_calls + s.share_calls

    def check(self, value):
        """None if the write may go ahead as is; else the value to write with (repair mode).
        Raises in raise mode. A tensor seen last time, unchanged and with the ledger unchanged,
        gets the same answer without being read or reported again (every layer of a step)."""
        guard = self.guard
        version = self._version()
        last = self._last
        if last is not None and last[0] is value and last[1] == _tensor_version(value) \
                and last[2] == version:
            return last[3]
        entries = self._read(value)
        self.checks += 1
        bs, pad = self.block_size, self.pad
        if self.is_slots:
            blocks = {s // bs for s in entries if s >= 0 and s != pad}
        else:
            blocks = {b for b in entries if b >= 0 and b != pad}
        with guard.lock:
            bad, violations = self._judge(sorted(blocks))
            if violations:
                self._last = None
            verdict = guard.settle(violations)  # raises in raise mode
        fixed = self._redirect(value, bad) if verdict == "repair" else None
        if _tensor_version(value) is not None:  # a tensor: its version says if it changed
            self._last = (value, _tensor_version(value), version, fixed)
        return fixed

    def _read(self, value) -> list:
        Tensor = torch_tensor_type()
        if Tensor is not None and isinstance(value, Tensor):
            if value.dtype.is_floating_point or value.dtype.is_complex or \
                    value.dtype is sys.modules["torch"].bool:
                raise TypeError(f"{self.method}(): the slot mapping / block table is a "
                                f"{value.dtype} tensor; it must hold integers")
            return value.reshape(-1).tolist()
        if hasattr(value, "tolist"):
            value = value.tolist()
        out = []
        for item in value:
            if isinstance(item, (list, tuple)):
                out += item
            else:
                out.append(item)
        for item in out:
            if type(item) is bool or not isinstance(item, int):
                raise TypeError(f"{self.method}(): slot or block {item!r} is not an int")
        return out

    def _judge(self, blocks):
        guard = self.guard
        ledger = guard.ledger(self.pool)
        stamp = ledger.stamp
        size = len(stamp)
        writer = current_owner()
        from ..stacks import SITES

        freed, unknown, foreign, shared = [], [], [], []
        for b in blocks:
            s = stamp[b] if b < size else 0
            if s > 0:
                refs = ledger.refcount(b)
                if refs > 1:
                    if self.is_slots and not self.shared_ok:
                        shared.append(b)
                elif writer is not None:
                    label = OWNERS.labels[SITES.owner(ledger.origin[b])]
                    if label is not None and label != writer:
                        foreign.append((b, label))
            elif s < 0:
                freed.append(b)
            elif not ledger.learn or not ledger.in_range(b):
                unknown.append(b)
        violations = []
        what = "slot mapping" if self.is_slots else "block table"
        call = f"{self.method}()"
        if freed:
            violations.append(guard.violation(kinds.WRITE_AFTER_FREE, tuple(freed), (
                f"{call} writes into {_list(freed)}, freed by call "
                f"#{-stamp[freed[0]]}: a stale {what} still points into freed memory, and the "
                "block's next owner gets this write; rebuild the mapping after freeing"),
                self.method, self.pool))
        stale = unknown + [b for b, _ in foreign]
        if stale:
            why = []
            if unknown:
                why.append(f"{_list(unknown)} never handed out")
            if foreign:
                b, label = foreign[0]
                more = f" (+{len(foreign) - 1} more)" if len(foreign) > 1 else ""
                why.append(f"block {b} owned by {label!r}, not the writer {writer!r}{more}")
            violations.append(guard.violation(kinds.STALE_TABLE, tuple(stale), (
                f"{call} writes into blocks that are not the writer's ({'; '.join(why)}): "
                f"the {what} is stale or mixes up sequences"),
                self.method, self.pool))
        if shared:
            violations.append(guard.violation(kinds.SHARED_BLOCK, tuple(shared), (
                f"{call} writes into {_list(shared)}, held by {ledger.refcount(shared[0])} "
                "references: every sequence sharing it sees this write; copy the block before "
                "writing (copy-on-write), or pass shared_ok=True if sharing writers is meant"),
                self.method, self.pool))
        violations.sort(key=lambda v: kinds.PRECEDENCE[v.kind])
        return set(freed + stale + shared), violations

    def _redirect(self, value, bad):
        """The slot mapping / table with every entry into a bad block sent to ``pad``."""
        bs = self.block_size if self.is_slots else 1
        pad = self.pad
        Tensor = torch_tensor_type()
        if Tensor is not None and isinstance(value, Tensor):
            import torch

            bad_t = torch.tensor(sorted(bad), dtype=torch.long, device=value.device)
            hit = torch.isin(torch.div(value.long(), bs, rounding_mode="floor"), bad_t) & \
                (value >= 0) & (value != pad)
            return torch.where(hit, torch.full_like(value, pad), value)

        def fix(item):
            if isinstance(item, (list, tuple)):
                return type(item)(fix(x) for x in item)
            return pad if item >= 0 and item != pad and item // bs in bad else item
        if hasattr(value, "tolist"):
            import numpy

            return numpy.asarray(fix(value.tolist()), dtype=value.dtype)
        return fix(value)


def _tensor_version(value):
    return getattr(value, "_version", None)


def _list(ids) -> str:
    if len(ids) == 1:
        return f"block {ids[0]}"
    shown = ", ".join(map(str, ids[:8]))
    return f"blocks [{shown}{', ...' if len(ids) > 8 else ''}]"


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
