"""Guard overhead on a continuous-batching trace: prints guarded/raw median ratios.

    python benchmarks/bench_guard.py [--rounds 7] [--steps 4000]

Raw and guarded runs alternate in one process, garbage collection off while timing, and the
ratio of medians is printed for: a bare pass-through wrapper (the floor any in-place wrapper
pays), the guard with stacks="off" and stacks="cheap" (targets 1.5x and 2.0x, limits 2.0x and
2.5x), and DeepSpeed 0.19.8's real BlockedAllocator when its sdist is in the engine cache (limit
1.3x). Where the compiled wrappers (kvguard._fastpath) are in use, the "[pure]" lines run the
same guard on the Python wrappers (what KVGUARD_PURE=1 or an install without a C compiler
gets) in the same rounds. Then the ledger's memory per block for a 1M-block pool.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# One OpenBLAS thread: numpy's BLAS threads (numpy comes with torch and the engines' code) spin
# after each call and take CPU from the timed thread on a small or shared machine; nothing
# timed here does linear algebra. Set before numpy loads, which reads it then.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import kvguard  # noqa: E402
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList  # noqa: E402
from kvguard.guard import shadowing  # noqa: E402
from kvguard.ledger import Ledger  # noqa: E402
from trace import ValidatingFreeList, make_trace, pool_size, replay  # noqa: E402


def passthrough(allocator):
    """The cheapest possible in-place wrapper: what any instrumentation pays at least."""
    alloc, free = allocator.allocate, allocator.free
    allocator.allocate = lambda *a, **k: alloc(*a, **k)
    allocator.free = lambda *a, **k: free(*a, **k)
    return allocator


def timed(make, ops, to_list=None):
    allocator = make()
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        replay(allocator, ops, to_list)
        return time.perf_counter() - t0
    finally:
        gc.enable()


def compare(variants, ops, rounds, to_list=None):
    """Median seconds per variant, the variants alternated round by round."""
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, make in variants.items():
            times[name].append(timed(make, ops, to_list))
    return {name: statistics.median(t) for name, t in times.items()}


def load_deepspeed_allocator():
    """DeepSpeed's own blocked_allocator.py from the sdist; CPU torch refuses pinned memory, so
    its module sees a torch whose arange ignores pin_memory (nothing else differs)."""
    import glob
    import tarfile
    import types

    cache = os.environ.get("KVGUARD_ENGINE_CACHE", os.path.expanduser("~/.cache/kvguard-engines"))
    sdists = glob.glob(os.path.join(cache, "deepspeed-0.19.8.tar.gz"))
    if not sdists:
        return None
    member = "deepspeed-0.19.8/deepspeed/inference/v2/ragged/blocked_allocator.py"
    with tarfile.open(sdists[0]) as tar:
        source = tar.extractfile(member).read().decode()
    import torch

    shim = types.ModuleType("torch")
    shim.__dict__.update(torch.__dict__)
    shim.arange = lambda *a, pin_memory=False, **k: torch.arange(*a, **k)
    module = types.ModuleType("ds_blocked_allocator")
    exec(compile(source, member, "exec"), module.__dict__)
    module.torch = shim
    return module.BlockedAllocator


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=4000)
    args = parser.parse_args()
    ops = make_trace(args.steps)
    n = pool_size()
    print(f"trace: {len(ops)} operations, 64 concurrent sequences, pool of {n} blocks")
    compiled = shadowing.ACCEL is not None
    print("guard wrappers: " + ("compiled (kvguard._fastpath); [pure]: the Python wrappers"
                                if compiled else "Python (kvguard._fastpath not built, or "
                                "KVGUARD_PURE=1)"))
    for label, cls in (("LinkedFreeList (DeepSpeed's logic on lists)", LinkedFreeList),
                       ("ValidatingFreeList (checks every id itself)", ValidatingFreeList)):
        variants = {
            "raw": lambda: cls(n),
            "pass-through": lambda: passthrough(cls(n)),
            "guard off": lambda: _guarded(cls(n), "off"),
            "guard cheap": lambda: _guarded(cls(n), "cheap"),
            "guard full": lambda: _guarded(cls(n), "full"),
            "cheap, no history": lambda: _guarded(cls(n), "cheap", history=0),
        }
        if compiled:
            variants.update({
                "guard off [pure]": lambda: _guarded(cls(n), "off", pure=True),
                "guard cheap [pure]": lambda: _guarded(cls(n), "cheap", pure=True),
            })
        med = compare(variants, ops, args.rounds)
        raw = med["raw"]
        print(f"{label}: raw {raw / len(ops) * 1e6:.2f} us/op")
        for name, t in med.items():
            if name != "raw":
                extra = (t - raw) / len(ops) * 1e6
                print(f"  {name:<18} {t / raw:5.2f}x   (+{extra:.2f} us/op; at 1.5 us/op raw "
                      f"that is {(1.5 + extra) / 1.5:.2f}x)")

    BlockedAllocator = load_deepspeed_allocator()
    if BlockedAllocator is None:
        print("DeepSpeed 0.19.8 sdist not in the engine cache: skipped its ratio")
    else:
        ds_ops = make_trace(max(args.steps // 4, 500))
        to_list = lambda t: t.tolist()  # noqa: E731  (the engine keeps ids as tensors too)
        variants = {
            "raw": lambda: BlockedAllocator(n),
            "guard cheap": lambda: _guarded(BlockedAllocator(n), "cheap"),
        }
        if compiled:
            variants["guard cheap [pure]"] = lambda: _guarded(BlockedAllocator(n), "cheap",
                                                              pure=True)
        med = compare(variants, ds_ops, max(3, args.rounds // 2), to_list)
        pure = (f" ([pure] {med['guard cheap [pure]'] / med['raw']:.2f}x)" if compiled else "")
        print(f"DeepSpeed BlockedAllocator: raw {med['raw'] / len(ds_ops) * 1e6:.1f} us/op, "
              f"guard cheap {med['guard cheap'] / med['raw']:.2f}x{pure}")

    ledger = Ledger(1 << 20)
    print(f"ledger memory: {ledger.nbytes() / (1 << 20):.1f} bytes/block for a 1M-block pool")
    return 0


SPECS = {
    "LinkedFreeList": LINKED_FREE_LIST_SPEC,
    "ValidatingFreeList": kvguard.AllocatorSpec(size="num_blocks", free_count="num_free"),
    "BlockedAllocator": kvguard.AllocatorSpec(free_arg="blocks", size="_num_blocks",
                                              free_count="free_blocks"),
}


@contextlib.contextmanager
def wrappers(pure: bool):
    """Guards made inside use the Python wrappers (``pure``: what ``KVGUARD_PURE=1`` or an
    install without a C compiler gets) or whatever this install uses (the compiled ones when
    built)."""
    saved = shadowing.ACCEL
    if pure:
        shadowing.ACCEL = None
    try:
        yield
    finally:
        shadowing.ACCEL = saved


def _guarded(allocator, stacks, pure=False, **options):
    with wrappers(pure):
        kvguard.guard(allocator, SPECS[type(allocator).__name__], stacks=stacks, **options)
    return allocator


if __name__ == "__main__":
    import results  # --write-docs: what this prints becomes its section of docs/cost.md
    sys.exit(results.main(main))
