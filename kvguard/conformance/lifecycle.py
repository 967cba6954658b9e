"""Lifecycle fuzzing: an engine's scheduler driven through request events, judged on whose each
block is and which in-flight step still reads it.

The allocator fuzzer (``check_allocator``) finds an allocator's own bugs. The bugs engines ship
sit one layer up, in the request lifecycle around the allocator: an abort racing a step still in
flight, a preemption, a deferred free, a block freed again by a late path after it was handed to
another request. ``kvguard.testing.check_lifecycle`` finds those on the engine's real scheduler:
a ``LifecycleDriver`` says how to send the engine request events and how to read its block
tables; the fuzzer sends event sequences that hypothesis draws and shrinks, and after every event
checks the invariants below, with kvguard's guard attached to the engine's allocator.

The invariants (``check_invariants``) are written to run without kvguard: the regression test a
finding emits pastes their source, so the test checks exactly what the fuzzer checked, using only
the engine.
"""

from __future__ import annotations

__all__ = ["LifecycleDriver", "Lease", "check_invariants"]


class LifecycleDriver:
    """How the lifecycle fuzzer talks to one engine: a small class per engine (or configuration).

    A driver wraps one fresh engine (``self.engine``); the fuzzer makes one per event sequence.
    Request ids are the fuzzer's own (``"r0"``, ``"r1"``, ...). Prompts are drawn from a few
    ``documents`` so that requests share prefixes: a prompt is the first ``length`` tokens of
    document ``doc``.

    Events, each one call on the engine:

    - ``add(rid, doc, length, max_tokens)``: a new request;
    - ``schedule()``: schedule one step; returns ``(handle, reads)`` where ``reads`` maps each
      request scheduled in the step to the block ids the step reads or writes for it (the lease),
      or None when nothing was scheduled;
    - ``process(handle, eos)``: hand the engine a fake model output for that step; requests in
      ``eos`` sample their end-of-sequence token;
    - ``abort(rid)``, ``reset_prefix_cache()``.

    Reading the engine:

    - ``tables()``: request id -> the block ids it holds now (only requests holding blocks);
    - ``refcount(block)``: references the engine's pool counts on a block (0: back in the pool);
    - ``generation(rid)``: None once the request has ended (finished, aborted), else a value that
      changes whenever it loses its blocks (a preemption count);
    - ``held()``: blocks still referenced, for the leak check once every request ended;
    - ``allocator()``: the pool to attach kvguard's guard to (None: no guard).

    Its contract, as class attributes:

    - ``async_scheduling``: ``schedule()`` may run while earlier steps are in flight (up to
      ``max_in_flight``); otherwise each step is processed before the next is scheduled;
    - ``leases_outlive_requests``: the engine keeps the blocks an in-flight step reads out of the
      pool until that step is processed, even when their request ends or is preempted meanwhile
      (deferred frees). False: only while the request lives does it promise that; once it ends,
      its blocks may be reused at once (ordering on the device makes that safe).

    ``source`` and ``emit_*`` say how the regression test writes the same calls with the engine's
    own API; see ``kvguard.conformance.lifecycle_emit``.
    """

    name = "engine"
    async_scheduling = False
    max_in_flight = 1
    leases_outlive_requests = False
    documents = 3
    max_prompt = 24
    max_tokens = 6

    def __init__(self, engine) -> None:
        self.engine = engine

    # --- events ------------------------------------------------------------------------------

    def add(self, rid: str, doc: int, length: int, max_tokens: int) -> None:
        raise NotImplementedError

    def schedule(self):
        raise NotImplementedError

    def process(self, handle, eos) -> None:
        raise NotImplementedError

    def abort(self, rid: str) -> None:
        raise NotImplementedError

    def reset_prefix_cache(self) -> None:
        """Optional: engines without a prefix cache leave it a no-op."""

    # --- reading ---------------------------------------------------------------------------

    def tables(self) -> dict:
        raise NotImplementedError

    def refcount(self, block: int) -> int:
        raise NotImplementedError

    def generation(self, rid: str):
        raise NotImplementedError

    def held(self) -> list:
        raise NotImplementedError

    def allocator(self):
        return None

    def prompt_length(self, length: int) -> int:
        """The prompt length the engine is given for a drawn ``length`` (an engine whose test
        double needs longer prompts clamps it here; the events show what was sent)."""
        return length

    def transfers(self) -> dict:
        """Request id -> blocks an asynchronous KV transfer still writes (none by default)."""
        return {}

    def owner(self, rid: str):
        """The owner label kvguard's guard sees while an event acts for ``rid``."""
        import kvguard
        return kvguard.owner(rid)

    def close(self) -> None:
        """Release what the engine holds outside Python (threads, files)."""


class Lease:
    """An in-flight step's hold on blocks: request id -> (generation when scheduled, block ids)."""

    __slots__ = ("step", "reads")

    def __init__(self, step: int, reads: dict) -> None:
        self.step = step
        self.reads = reads


def check_invariants(tables, refcount, leases, generation, outlive, held=(), transfers=None):
    """The first lifecycle invariant broken now, as ``(kind, block, message)``, or None.

    ``tables``: request id -> block ids it holds; ``refcount(block)``: the pool's count;
    ``leases``: step -> {request id: (generation, block ids)} for every step in flight;
    ``generation(rid)``: None once the request ended, else its preemption count; ``outlive``:
    whether the engine promises to keep in-flight blocks out of the pool after their request
    ends; ``held``: the blocks whose refcount is not 0; ``transfers``: request id -> blocks an
    asynchronous KV load still writes (they stay out of the pool until the load reports done,
    whoever ends the request). Self-contained (it is pasted into emitted regression tests).
    """
    for block in held:
        if refcount(block) < 0:
            return ("double-free", block, f"block {block} was released more often than it was "
                    f"handed out (refcount {refcount(block)})")
    holders = {}
    for rid in sorted(tables):
        for block in set(tables[rid]):
            holders.setdefault(block, []).append(rid)
    for block in sorted(holders):
        count = refcount(block)
        who = holders[block]
        if count < 1:
            return ("stale-table", block, f"block {block} is in the table of {', '.join(who)} "
                    f"but back in the pool (refcount {count})")
        if count < len(who):
            return ("shared-block", block, f"block {block} is in the tables of {', '.join(who)} "
                    f"with refcount {count}: one release frees it under the other")
    for step in sorted(leases):
        for rid in sorted(leases[step]):
            gen, blocks = leases[step][rid]
            if not outlive and generation(rid) != gen:
                continue  # the request ended or lost its blocks: its lease ended with it
            for block in sorted(blocks):
                if refcount(block) < 1:
                    state = "ended" if generation(rid) is None else (
                        "was preempted" if generation(rid) != gen else "is running")
                    return ("free-in-flight", block, f"block {block} is back in the pool while "
                            f"step {step}, still in flight, reads it for {rid} (which {state})")
    for rid in sorted(transfers or {}):
        for block in sorted(transfers[rid]):
            if refcount(block) < 1:
                return ("free-in-flight", block, f"block {block} is back in the pool while an "
                        f"asynchronous KV load for {rid} still writes it")
    return None
