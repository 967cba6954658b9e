"""Block tables checked against the ledger: who may read and write which block.

A block table maps each sequence (owner) to the blocks its attention reads and writes. An entry
that is not live is ``stale-table``: the block was freed (maybe already handed to someone else),
never handed out, or, when the engine labels its allocations with ``kvguard.owner(key)`` using
the table's keys, it is another owner's unshared block. A live block in more owners' tables than
it has references is ``shared-block``: those owners overwrite each other's KV state. A block
listed twice in one owner's table counts once (vLLM's sliding window re-lists blocks). An engine
that shares blocks above its allocator (Hugging Face's ``BlockLedger``: the pool hands a forked
block out once) passes its own counts as ``refs``; they raise a live block's references, never
revive a free one.

Two forms, one meaning. A mapping owner -> ids (lists, tuples, numpy arrays, tensors on any
device, objects carrying ``id_attr``) is read in Python, with every tensor in it fetched in one
transfer per device. A padded 2-D integer tensor (one row per sequence, negative entries as
padding) is checked on its own device with a fixed handful of vectorized ops and one host sync
on the clean path; only a table that holds violations pays for locating them.
"""

from __future__ import annotations

import sys

from .. import kinds
from ..ids import result_ids, torch_tensor_type


def check_tables(guard, tables, pool=None, refs=None) -> list:
    """The violations ``tables`` holds against ``guard``'s ledger (recording and raising is the
    caller's: ``Guard.check_tables``). Bad input raises ``TypeError``/``ValueError``."""
    ledger = guard.ledger(pool)
    above = _references(refs)
    Tensor = torch_tensor_type()
    if Tensor is not None and isinstance(tables, Tensor):
        stale, shared = _tensor_form(ledger, tables, above)
    elif hasattr(tables, "items"):
        stale, shared = _mapping_form(guard, ledger, tables, above)
    else:
        raise TypeError("check_tables() takes a mapping owner -> ids or a 2-D integer tensor "
                        f"(one row per sequence), not {type(tables).__name__}")
    found = []
    if stale:
        ids = tuple(sorted(stale))
        where = "; ".join(f"block {b} in {_owners(stale[b])} ({_state(ledger, b)})"
                          for b in ids[:6])
        more = f"; and {len(ids) - 6} more" if len(ids) > 6 else ""
        found.append(guard.violation(kinds.STALE_TABLE, ids, (
            f"{len(ids)} block(s) in the block tables are not the table owner's to use "
            f"({where}{more}): a sequence still reads or writes blocks it freed, or that "
            "belong to someone else; drop them from its table when freeing"),
            "check_tables", pool))
    if shared:
        ids = tuple(sorted(shared))
        where = "; ".join(f"block {b} in {_owners(shared[b])}, {_held(ledger, above, b)} "
                          f"reference(s)" for b in ids[:6])
        more = f"; and {len(ids) - 6} more" if len(ids) > 6 else ""
        found.append(guard.violation(kinds.SHARED_BLOCK, ids, (
            f"{len(ids)} block(s) appear in more sequences' tables than they have references "
            f"({where}{more}): those sequences overwrite each other's KV state; share a block "
            "through the allocator (a reference each) or copy it"),
            "check_tables", pool))
    return found


def _references(refs) -> dict:
    """``refs`` checked: block id -> references held above the allocator (each >= 1)."""
    if refs is None:
        return {}
    if not hasattr(refs, "items"):
        raise TypeError(f"check_tables(refs=...) takes a mapping block id -> references held, "
                        f"not {type(refs).__name__}")
    out = {}
    for b, n in refs.items():
        if type(b) is not int or type(n) is not int:
            raise TypeError(f"check_tables(refs=...) maps int block ids to int reference counts, "
                            f"not {b!r}: {n!r}")
        if n < 1:
            raise ValueError(f"check_tables(refs=...): block {b} holds {n} references; a count "
                             "is at least 1")
        out[b] = n
    return out


def _held(ledger, above, b) -> int:
    """References block ``b`` has: the ledger's, or more where the engine counts them above
    the allocator (a block the ledger holds free has none, whatever ``above`` says)."""
    own = ledger.refcount(b)
    return max(own, above.get(b, 0)) if own else 0


def _owners(owners) -> str:
    shown = ", ".join(repr(o) for o in owners[:4])
    return shown + (f" (+{len(owners) - 4})" if len(owners) > 4 else "")


def _state(ledger, b) -> str:
    """Why block ``b`` is not the table owner's: free, never handed out, or someone else's."""
    from ..owners import OWNERS
    from ..stacks import SITES

    if not ledger.in_range(b):
        return f"outside the pool [0, {ledger.size})"
    if b >= len(ledger.stamp) or ledger.stamp[b] == 0:
        return "never handed out"
    if ledger.stamp[b] < 0:
        return f"free since call #{-ledger.stamp[b]}"
    label = OWNERS.labels[SITES.owner(ledger.origin[b])]
    return f"owned by {label!r}"


# --- the mapping form ------------------------------------------------------------------------

def _mapping_form(guard, ledger, tables, above):
    from ..owners import OWNERS
    from ..stacks import SITES

    spec = guard.spec
    rows = _read_mapping(tables, spec.id_attr, spec.skip)
    stamp, origin = ledger.stamp, ledger.origin
    size = len(stamp)
    labels, known = OWNERS.labels, OWNERS.index
    site_owner = SITES.owner
    holders: dict = {}
    stale: dict = {}
    for owner, ids in rows:
        try:
            labelled = owner in known
        except TypeError:  # an unhashable key cannot be an owner label
            labelled = False
        for b in dict.fromkeys(ids):
            if not (b < size and stamp[b] > 0):
                stale.setdefault(b, []).append(owner)
            elif labelled and ledger.refcount(b) == 1 and \
                    labels[site_owner(origin[b])] not in (None, owner):
                stale.setdefault(b, []).append(owner)
            else:
                holders.setdefault(b, []).append(owner)
    # A block adopted from a busy refcounted pool has an unknown number of references: any
    # number of tables may hold it until the pool hands it out again.
    uncertain = ledger.uncertain
    shared = {b: owners for b, owners in holders.items()
              if len(owners) > _held(ledger, above, b) and b not in uncertain}
    return stale, shared


def _read_mapping(tables, id_attr, skip) -> list:
    """``[(owner, [ids])]`` with padding (negative ids) dropped. Tensors are fetched together,
    one transfer per device, not one per owner."""
    Tensor = torch_tensor_type()
    numpy = sys.modules.get("numpy")
    rows, tensors = [], []
    for owner, value in tables.items():
        if Tensor is not None and isinstance(value, Tensor):
            dtype = value.dtype
            if dtype.is_floating_point or dtype.is_complex or dtype is sys.modules["torch"].bool \
                    or value.dim() > 1:
                raise ValueError(f"check_tables(): the table of {owner!r} is a {value.dim()}-D "
                                 f"{dtype} tensor; block ids are a 1-D integer tensor")
            rows.append((owner, None))
            tensors.append((len(rows) - 1, value))
            continue
        if type(value) in (list, tuple):
            value = [b for b in value if not (type(b) is int and b < 0)]
        elif numpy is not None and isinstance(value, numpy.ndarray) and value.dtype.kind == "i":
            value = value[value >= 0]
        norm = result_ids(value, id_attr, skip)
        if norm.faults:
            raise ValueError(f"check_tables(): the table of {owner!r}: {norm.faults[0].message}")
        rows.append((owner, norm.ids))
    if tensors:
        _fetch(rows, tensors)
    return rows


def _fetch(rows, tensors) -> None:
    import torch

    by_device: dict = {}
    for at, t in tensors:
        by_device.setdefault(t.device, []).append((at, t))
    for group in by_device.values():
        flat = torch.cat([t.reshape(-1).long() for _, t in group]).tolist()
        start = 0
        for at, t in group:
            n = t.numel()
            rows[at] = (rows[at][0], [b for b in flat[start:start + n] if b >= 0])
            start += n


# --- the tensor form -------------------------------------------------------------------------

def _tensor_form(ledger, tables, above):
    import torch

    if tables.dim() != 2 or tables.dtype.is_floating_point or tables.dtype.is_complex \
            or tables.dtype == torch.bool:
        raise TypeError(f"a block-table tensor must be 2-D integer (one row per sequence, "
                        f"negative entries as padding), not {tables.dim()}-D {tables.dtype}")
    if tables.numel() == 0:
        return {}, {}
    device = tables.device
    refs = _upload(_refcounts(ledger, torch, above), device, torch)
    n = refs.numel()
    table = tables.long()
    valid = table >= 0
    in_pool = valid & (table < n)
    safe = torch.where(in_pool, table, torch.zeros((), dtype=torch.long, device=device))
    if n:
        live = in_pool & (refs[safe] > 0)
    else:
        live = torch.zeros_like(valid)
    stale = valid & ~live
    # Owners per block: sort each row, count each live block once per row, add up over rows.
    keys = torch.where(live, table, torch.full((), n, dtype=torch.long, device=device))
    keys = keys.sort(dim=1).values
    first = torch.ones_like(valid)
    first[:, 1:] = keys[:, 1:] != keys[:, :-1]
    counts = torch.zeros(n + 1, dtype=torch.long, device=device)
    counts.index_add_(0, keys.reshape(-1), first.reshape(-1).long())
    over = counts[:n] > refs
    shared_entries = live & over[safe] if n else live
    any_stale, any_shared = torch.stack((stale.any(), shared_entries.any())).tolist()
    found_stale, found_shared = {}, {}
    if any_stale:
        _collect(found_stale, table, stale)
    if any_shared:
        _collect(found_shared, table, shared_entries)
    return found_stale, found_shared


def _collect(found, table, mask) -> None:
    """Block -> rows holding it, for the entries ``mask`` selects (the violation path only)."""
    where = mask.nonzero()
    ids = table[mask].tolist()
    for (row, _), b in zip(where.tolist(), ids):
        rows = found.setdefault(b, [])
        if row not in rows:
            rows.append(row)


def _upload(values, device, torch):
    """A CPU tensor onto ``device`` without making the host wait for the device."""
    if device.type == "cpu":
        return values
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def _refcounts(ledger, torch, above=None):
    """References per block as an int32 CPU tensor, built from the ledger's columns in bulk."""
    n = len(ledger.stamp)
    if not n:
        return torch.zeros(0, dtype=torch.int32)
    live = torch.frombuffer(ledger.stamp, dtype=torch.int64) > 0
    if ledger.ref is None:
        refs = live.int()
    else:
        refs = torch.frombuffer(ledger.ref, dtype=torch.int32) * live
    if above:  # references counted above the allocator, for live blocks only
        ids = [b for b in above if 0 <= b < n]
        if ids:
            at = torch.tensor(ids, dtype=torch.long)
            counts = torch.tensor([above[b] for b in ids], dtype=torch.int32)
            refs[at] = torch.where(refs[at] > 0, torch.maximum(refs[at], counts), refs[at])
    if ledger.uncertain:  # unknown reference counts (adopted from a busy pool): never "shared"
        refs[list(ledger.uncertain)] = torch.iinfo(torch.int32).max
    return refs
