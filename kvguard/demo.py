"""``kvguard demo``: the bug that started the project, replayed without and with the guard.

Runs on the embedded example allocators (no torch, no engine), in well under a second.
"""

from __future__ import annotations

import io

from .guard import guard, guard_of
from .errors import KVGuardError
from .examples import (
    LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, LinkedFreeList, RefcountedPool,
)


def _flush_sequence(allocator, block_ids) -> None:
    """Stands for an engine's "sequence finished" path, which frees its blocks in one call."""
    allocator.free(block_ids)


def run(out: io.TextIOBase, *, full_reports: bool = True) -> int:
    """Print the demo; return the number of misuses the guard stopped."""
    say = lambda text="": print(text, file=out)  # noqa: E731
    say("kvguard demo: DeepSpeed 0.19.8's BlockedAllocator logic (a linked free list), embedded")
    say()
    say("1. Unguarded. Two sequences' blocks are concatenated and freed in one call:")
    raw = LinkedFreeList(4)
    first = raw.allocate(3)
    say(f"   allocate(3)      -> {first}")
    _flush_sequence(raw, [0, 0, 1])
    say("   free([0, 0, 1])  -> no error")
    say(f"   free_blocks      -> {raw.free_blocks}   (only 3 blocks are free; block 3 is lost)")
    a, b = raw.allocate(2), raw.allocate(2)
    say(f"   allocate(2)      -> {a}")
    say(f"   allocate(2)      -> {b}   block 0 is handed out twice, and -1 as an id")
    say("   Two requests now write one KV block: no error, only wrong tokens.")
    say()
    say("2. Guarded: kvguard.guard(allocator). The same calls:")
    allocator = LinkedFreeList(4)
    g = guard(allocator, LINKED_FREE_LIST_SPEC, name="kv-cache")
    say(f"   allocate(3)      -> {allocator.allocate(3)}")
    try:
        _flush_sequence(allocator, [0, 0, 1])
    except KVGuardError as exc:
        say(f"   free([0, 0, 1])  -> {type(exc).__name__} (a ValueError); nothing was freed:")
        say()
        say(_indent(str(exc)) if full_reports else "   " + exc.violation.summary())
        say()
    say(f"   free_blocks      -> {allocator.free_blocks}, live blocks {sorted(g.live)}: "
        "allocator and ledger exactly as before the call")
    say()
    say("3. The seed's other misuses, each stopped at the faulty call:")
    cases = [
        ("free(True)", lambda: allocator.free(True)),
        ("free(b for b in ids)", lambda: allocator.free(b for b in [0, 1])),
        ("free([2]); free([2])", lambda: (allocator.free([2]), allocator.free([2]))),
        ("free([7])", lambda: allocator.free([7])),
        ("free([3])", lambda: allocator.free([3])),
    ]
    for text, call in cases:
        try:
            call()
            say(f"   {text:<22} -> passed (unexpected)")
        except KVGuardError as exc:
            say(f"   {text:<22} -> {exc.kind}: {exc.violation.message.split(':')[0]}")
    say()
    say("4. A refcounted prefix-caching pool (vLLM-style share/free):")
    pool = RefcountedPool(4)
    guard(pool, REFCOUNTED_POOL_SPEC, name="prefix-pool")
    ids = pool.allocate(2)
    pool.share(ids)
    pool.free(ids)
    pool.free(ids)
    say(f"   allocate(2) -> {ids}; share; free; free   (two references, two drops: fine)")
    try:
        pool.free(ids)
    except KVGuardError as exc:
        say(f"   free({ids}) a third time -> {exc.kind}: {exc.violation.summary()}")
    stopped = sum(len(x.violations) for x in (g, guard_of(pool)))
    say()
    say(f"kvguard stopped {stopped} misuses; every allocator is still consistent.")
    say()
    for line in NEXT_STEPS:
        say(line)
    return stopped


NEXT_STEPS = (
    "What to try next:",
    "  pytest -p kvguard                 your test suite, every registered allocator guarded",
    "  kvguard lint src/                 your code: tensors, bools, duplicates passed to free()",
    "  kvguard run -- python serve.py    a service, no code change: misuses logged as JSON lines",
    "  kvguard.guard(your_allocator)     your own allocator: docs/reference.md has every keyword",
)
"""What to try after the demo: one line per face, each a command to paste."""


def _indent(text: str) -> str:
    return "\n".join("   " + line for line in text.splitlines())
