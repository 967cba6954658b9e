"""What the class-level dispatcher costs: prints median ratios and microseconds per call.

    python benchmarks/bench_dispatch.py [--rounds 9] [--cycles 20000]

Every guard puts a dispatcher on its allocator's class for each method it shadows
(``kvguard.dispatch``), so that ``Class.free(allocator, ids)``, or a call after an engine
deleted the guard's wrapper, reaches the instance's guard. Instance calls of a guarded allocator
find the guard's wrapper on the instance and should not pay for it; instance calls of an
unguarded allocator of that class go through the dispatcher and do. Measured on the pure-Python
free list (about half a microsecond per call raw, the worst case for any added frame), one
allocate-and-free cycle per step, runs alternated round by round in one process with garbage
collection off while timing.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvguard  # noqa: E402
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList  # noqa: E402


def instance_calls(allocator, cycles):
    allocate, free = allocator.allocate, allocator.free
    for _ in range(cycles):
        free(allocate(4))


def class_calls(allocator, cycles):
    allocate, free = LinkedFreeList.allocate, LinkedFreeList.free
    for _ in range(cycles):
        free(allocator, allocate(allocator, 4))


def timed(run, allocator, cycles):
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        run(allocator, cycles)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--cycles", type=int, default=20000)
    args = parser.parse_args()
    unguarded = LinkedFreeList(64)
    guarded = LinkedFreeList(64)
    times: dict = {}
    for _ in range(args.rounds):
        for dispatched in (False, True):
            g = kvguard.guard(guarded, LINKED_FREE_LIST_SPEC, stacks="off")
            put_on = {name: vars(LinkedFreeList)[name] for name in ("allocate", "free")}
            if not dispatched:  # the engine's functions back on the class while timing
                for name, dispatcher in put_on.items():
                    setattr(LinkedFreeList, name, dispatcher.__kvguard_function__)
            for name, run, allocator in (
                    ("unguarded, instance calls", instance_calls, unguarded),
                    ("guarded, instance calls", instance_calls, guarded),
                    ("guarded, class-level calls", class_calls, guarded)):
                if name.endswith("class-level calls") and not dispatched:
                    continue  # without the dispatcher they pass the guard: nothing to compare
                key = (name, dispatched)
                times.setdefault(key, []).append(timed(run, allocator, args.cycles))
            for name, dispatcher in put_on.items():
                setattr(LinkedFreeList, name, dispatcher)
            g.unguard()
    med = {key: statistics.median(t) for key, t in times.items()}
    per_call = 2 * args.cycles  # an allocate and a free per cycle
    for name in ("unguarded, instance calls", "guarded, instance calls"):
        plain, dispatched = med[(name, False)], med[(name, True)]
        print(f"{name}: {plain / per_call * 1e6:.2f} us/call without the dispatcher, "
              f"{dispatched / plain:.2f}x with it "
              f"({(dispatched - plain) / per_call * 1e6:+.2f} us/call)")
    plain = med[("guarded, instance calls", False)]
    through = med[("guarded, class-level calls", True)]
    print(f"guarded, class-level calls through the dispatcher: {through / plain:.2f}x the "
          f"guarded instance calls ({(through - plain) / per_call * 1e6:+.2f} us/call)")
    return 0


if __name__ == "__main__":
    import results  # --write-docs: what this prints becomes its section of docs/cost.md
    sys.exit(results.main(main))
