"""The model allocator of ``kvguard replay``: the state a correct allocator must be in, built
from the recorded operations alone, and what it finds wrong with each."""

from __future__ import annotations

from ..violation import EMPTY


class ModelAllocator:
    """The state a correct allocator must be in, built from the operations alone.

    A block is live (with a reference count, when known), free, or unknown: ids first seen
    inside the window, or after a gap in the record, are given the benefit of the doubt. A
    pool whose record shows ``share`` calls is treated as refcounted.
    """

    def __init__(self, refcounted_pools=()) -> None:
        self.refcounted = set(refcounted_pools)
        self.state: dict = {}
        """``(pool, id)`` -> ``(refs, call)``: refs > 0 live (None: live, count unknown), 0 free."""

    def forget(self) -> None:
        self.state.clear()

    def apply(self, step) -> list:
        """The problems of one recorded ``Step`` (``(kind, message)`` pairs)."""
        if step.op == EMPTY:  # calls with no ids change no block
            return []
        pool, ids, call = step.pool, step.ids, step.call
        problems = []
        seen, dups = set(), []
        for b in ids:
            if b in seen and b not in dups:
                dups.append(b)
            seen.add(b)
        bad = [b for b in dict.fromkeys(ids) if not isinstance(b, int) or b < 0]
        if bad:
            verb = "handed out" if step.op == "allocate" else "got"
            problems.append(("invalid-id", f"{step.op}() {verb} invalid id(s) {bad}"))
        if dups:
            if step.op == "allocate":
                problems.append(("shared-block", f"allocate() handed out {describe_ids(dups)} "
                                 "twice in one call: two owners now share each"))
            else:
                problems.append(("duplicate-id", f"{step.op}() got {describe_ids(dups)} twice in "
                                 "one call: a free list now holds each twice"))
        refcounted = pool in self.refcounted
        for b in dict.fromkeys(ids):
            if not isinstance(b, int) or b < 0:
                continue
            key = (pool, b)
            refs, since = self.state.get(key, (None, None))
            known = key in self.state
            if step.op == "allocate":
                if known and refs != 0:
                    problems.append(("shared-block", f"block {b} handed out while live (handed "
                                     f"out or shared by call #{since}, not freed since)"))
                self.state[key] = (1, call)
            elif step.op == "share":
                if known and refs == 0:
                    self.state[key] = (1, call)  # a cached free block revived
                elif known and refs is not None:
                    self.state[key] = (refs + 1, call)
            else:  # free
                if known and refs == 0:
                    problems.append(("double-free", f"block {b} freed again: already free since "
                                     f"call #{since}"))
                elif known and refs is not None and refs > 1:
                    self.state[key] = (refs - 1, since)
                elif refcounted and not known:
                    pass  # its reference count is unknown: it may still be live
                else:
                    self.state[key] = (0, call)
        return problems


def describe_ids(ids) -> str:
    return f"block {ids[0]}" if len(ids) == 1 else f"blocks {list(ids)}"
