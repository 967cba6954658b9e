"""Block tables checked against the ledger: who may read and write which block.

A block table maps each sequence (owner) to the blocks its attention reads. An entry that is not
live is ``stale-table`` (the block was freed, maybe already handed to someone else); a live block
in more owners' tables than it has references is ``shared-block``. The 2-D tensor form is checked
on the tensor's own device with a handful of vectorized ops and no per-row Python loop.
"""

from __future__ import annotations

from collections import defaultdict

from . import kinds
from .ids import result_ids, torch_tensor_type


def check_tables(guard, tables, pool=None) -> list:
    ledger = guard.ledger(pool)
    Tensor = torch_tensor_type()
    if Tensor is not None and isinstance(tables, Tensor):
        stale, shared = _tensor_form(ledger, tables)
    elif hasattr(tables, "items"):
        stale, shared = _mapping_form(guard, ledger, tables)
    else:
        raise TypeError("check_tables() takes a mapping owner -> ids or a 2-D integer tensor, "
                        f"not {type(tables).__name__}")
    found = []
    if stale:
        ids = tuple(sorted(stale))
        where = "; ".join(f"block {b} in {_owners(stale[b])}" for b in ids[:6])
        found.append(guard._violation(kinds.STALE_TABLE, ids, (
            f"{len(ids)} block(s) in the block tables are not live ({where}): a sequence "
            "still reads blocks it freed, or that were handed to someone else; drop them from "
            "its table when freeing"), "check_tables", pool, ledger, ids))
    if shared:
        ids = tuple(sorted(shared))
        where = "; ".join(f"block {b} in {_owners(shared[b])}" for b in ids[:6])
        found.append(guard._violation(kinds.SHARED_BLOCK, ids, (
            f"{len(ids)} block(s) appear in more sequences' tables than they have references "
            f"({where}): those sequences overwrite each other's KV state"),
            "check_tables", pool, ledger, ids))
    return found


def _owners(owners) -> str:
    shown = ", ".join(repr(o) for o in owners[:4])
    return shown + (f" (+{len(owners) - 4})" if len(owners) > 4 else "")


def _mapping_form(guard, ledger, tables):
    holders = defaultdict(list)
    stale = defaultdict(list)
    for owner, ids in tables.items():
        norm = result_ids(ids, guard.spec.id_attr, guard.spec.skip)
        for b in dict.fromkeys(norm.ids):
            (holders if ledger.is_live(b) else stale)[b].append(owner)
    shared = {b: owners for b, owners in holders.items() if len(owners) > ledger.refcount(b)}
    return stale, shared


def _tensor_form(ledger, tables):
    import torch

    if tables.dim() != 2 or tables.dtype.is_floating_point or tables.dtype == torch.bool:
        raise TypeError(f"a block-table tensor must be 2-D integer, not {tables.dim()}-D "
                        f"{tables.dtype}")
    device = tables.device
    refs = _refcounts(ledger, torch).to(device, non_blocking=True)
    n = refs.numel()
    table = tables.long()
    rows = torch.arange(table.shape[0], device=device).unsqueeze(1).expand_as(table)
    valid = table >= 0
    ids = table[valid]
    owners = rows[valid]
    if ids.numel() == 0:
        return {}, {}
    live = ids < n
    live[live.clone()] = refs[ids[live]] > 0
    stale_ids, stale_rows = ids[~live], owners[~live]
    width = int(n) + 1
    pairs = torch.unique(owners[live] * width + ids[live])
    pair_ids = pairs % width
    counts = torch.bincount(pair_ids, minlength=width)[:n]
    over = counts > refs
    shared_ids = torch.nonzero(over).flatten()
    shared_pairs = pairs[over[pair_ids.clamp(max=max(n - 1, 0))]] if n else pairs[:0]
    stale, shared = defaultdict(list), defaultdict(list)
    for b, r in zip(stale_ids.tolist(), stale_rows.tolist()):
        if r not in stale[b]:
            stale[b].append(r)
    if shared_ids.numel():
        for pair in shared_pairs.tolist():
            shared[pair % width].append(pair // width)
    return stale, shared


def _refcounts(ledger, torch):
    """References per block as an int64 CPU tensor, built from the ledger's columns in bulk."""
    n = len(ledger.stamp)
    if not n:
        return torch.zeros(0, dtype=torch.long)
    stamp = torch.frombuffer(ledger.stamp, dtype=torch.int64)
    live = stamp > 0
    if ledger.ref is None:
        return live.long()
    return torch.frombuffer(ledger.ref, dtype=torch.int32).long() * live
