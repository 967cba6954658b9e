"""The shrinker: the shortest, simplest operations that still break a clause.

hypothesis's own shrinker is off for the fuzzer's search (this pass is cheaper), and a staging
log's calls (``kvguard replay --emit-test``) are shrunk the same way.
"""

from __future__ import annotations


def _simpler(op: tuple) -> list:
    if op[0] == "exact":
        return []  # a recorded call is kept as it was
    if op[0] == "allocate":
        return [("allocate", n) for n in range(1, op[1])]
    out = []
    if op[1] != (0,):
        out.append((op[0], (0,)) + op[2:])
    if len(op[1]) > 1:
        out.append((op[0], op[1][:1]) + op[2:])
    return out


def shrink(ops, fails, *, rounds: int = 8) -> list:
    """The shortest, simplest ``ops`` that still ``fails``: drop one operation at a time, then
    simplify each (fewer blocks, the first live block), until nothing changes. hypothesis
    shrinks first; this pass also serves sequences it never saw (a staging log's)."""
    ops = list(ops)
    for _ in range(rounds):
        before = list(ops)
        i = 0
        while i < len(ops):
            candidate = ops[:i] + ops[i + 1:]
            if fails(candidate):
                ops = candidate
            else:
                i += 1
        for i in range(len(ops)):
            for simpler in _simpler(ops[i]):
                candidate = ops[:i] + [simpler] + ops[i + 1:]
                if fails(candidate):
                    ops = candidate
                    break
        if ops == before:
            break
    return ops
