"""Guard overhead on the allocators engines really run: prints guarded/raw ratios.

    python benchmarks/bench_engines.py [--rounds 7] [--steps 2000] [--pure] [--only vllm,...]

Raw and guarded runs alternate in one process, garbage collection off while timing (as
bench_guard.py does), timed in CPU time of the thread (``time.thread_time``: on a shared machine
wall-clock time also counts the time other processes hold the core), fastest round of each.
Each allocator replays a seeded continuous-batching trace: 64 sequences at once, prompt blocks
on arrival, a block every 16 tokens, frees at the end, and for refcounted pools prefix sharing
(a new sequence takes a reference to a running one's first blocks). Rows:

- vLLM 0.33.0 ``BlockPool`` (block objects, refcounted, ``touch`` on every prefix hit), its own
  code loaded from the wheel in KVGUARD_ENGINE_CACHE as tests/kvguard/adapters do; target <= 2.0x.
- DeepSpeed 0.19.8 ``BlockedAllocator`` (its own code, int32 tensors); target <= 1.1x.
- SGLang 0.5.23 ``TokenToKVPoolAllocator`` (its own code, int64 tensors in and out).
- a numpy refcounted pool written here (numpy arrays of ids, refcounts in numpy); <= 1.5x.
- a pool handing out one ``np.int64`` element per call, beside its plain-int twin (the two
  alternated in the same rounds): the guard's added time per operation should be no more for
  the first than for the second.
- the pure-Python free lists of bench_guard.py; stacks off <= 2.5x, cheap <= 3.0x.

Each guarded variant is shown with stacks="off", stacks="cheap" and staging's settings
(log mode, KVGUARD_SAMPLE=100), with the absolute time added per operation; ``--pure`` runs
each on the Python wrappers too (what ``KVGUARD_PURE=1`` or an install without a C compiler
gets), alternated in the same rounds, and prints that ratio beside. Then where the time of one
call goes, layer by layer, for both, and the ledger's memory per block for a refcounted pool.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads: see bench_guard.py

import numpy as np  # noqa: E402

import kvguard  # noqa: E402
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList  # noqa: E402
from kvguard.guard import shadowing  # noqa: E402
from kvguard.ledger import Ledger  # noqa: E402
from kvguard.owners import holding  # noqa: E402
from kvguard.staging import StagingConfig  # noqa: E402
from bench_guard import wrappers  # noqa: E402
from trace import ValidatingFreeList  # noqa: E402

ALLOC, SHARE, FREE = 0, 1, 2

GUARDS = {
    "stacks off": {"stacks": "off"},
    "stacks cheap": {"stacks": "cheap"},
    "staging (log, SAMPLE=100)": StagingConfig(sample=100, stacks="full").guard_options(),
}
"""The guarded variants of every row; the staging one is what ``KVGUARD=1 KVGUARD_SAMPLE=100``
builds."""


def make_trace(steps: int, concurrent: int = 64, share: float = 0.5, seed: int = 0) -> list:
    """``(ALLOC, seq, n)``, ``(SHARE, seq, parent, k)`` (the first ``k`` blocks of a running
    ``parent`` become the start of new ``seq``), ``(FREE, seq)``. ``share=0``: no sharing."""
    rng = random.Random(seed)
    ops, running, held = [], {}, {}
    next_seq = 0

    def admit():
        nonlocal next_seq
        seq, next_seq = next_seq, next_seq + 1
        running[seq] = 0
        parents = [p for p in running if p != seq and held.get(p, 0) >= 4]
        if parents and rng.random() < share:
            parent = rng.choice(parents)
            k = rng.randint(1, min(held[parent], 16))
            ops.append((SHARE, seq, parent, k))
            held[seq] = k
        else:
            held[seq] = 0
        n = rng.randint(2, 16)
        ops.append((ALLOC, seq, n))
        held[seq] += n

    for _ in range(concurrent):
        admit()
    for _ in range(steps):
        for seq in list(running):
            running[seq] += 1
            if running[seq] % 16 == 0:
                ops.append((ALLOC, seq, 1))
                held[seq] += 1
            if rng.random() < 1 / 256:
                ops.append((FREE, seq))
                del running[seq], held[seq]
                admit()
    for seq in list(running):
        ops.append((FREE, seq))
    return ops


class Driver:
    """How one allocator runs the trace: ``allocate(a, n)``, ``share(a, blocks)`` (None: no
    sharing), ``free(a, blocks)``, ``join(parts)`` makes one sequence's ids from its parts,
    ``prefix(ids, k)`` its first k."""

    def __init__(self, allocate, free, share=None, join=None, prefix=None) -> None:
        self.allocate, self.free, self.share = allocate, free, share
        self.join = join or (lambda parts: [b for part in parts for b in part])
        self.prefix = prefix or (lambda ids, k: ids[:k])


def replay(allocator, driver: Driver, ops, owners: bool = False) -> None:
    """Run the trace; with ``owners`` each operation runs as its sequence's holder
    (``kvguard.owners.holding``), as an engine adapter's request boundary runs it."""
    parts: dict = {}
    allocate, free, share, join, prefix = (driver.allocate, driver.free, driver.share,
                                           driver.join, driver.prefix)
    for op in ops:
        kind, seq = op[0], op[1]
        held = holding(seq) if owners else None
        if held is not None:
            held.__enter__()
        if kind == ALLOC:
            got = allocate(allocator, op[2])
            if seq in parts:
                parts[seq].append(got)
            else:
                parts[seq] = [got]
        elif kind == SHARE:
            head = prefix(join(parts[op[2]]), op[3])
            share(allocator, head)
            parts[seq] = [head]
        else:
            free(allocator, join(parts.pop(seq)))
        if held is not None:
            held.__exit__(None, None, None)


def timed(make, driver, ops) -> float:
    allocator = make()
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        replay(allocator, driver, ops, getattr(make, "owners", False))
        return time.thread_time() - t0
    finally:
        gc.enable()


class Counting:
    """``--instructions``: ``compare`` counts each variant's instructions in a child process
    under valgrind's cachegrind (the trace replayed once and twice on one allocator: the
    difference is one replay, start-up and the allocator's building taken out) instead of
    timing it. The same count run after run on a shared
    machine, where timed rows move by 10-30%; instructions are not time (a cache miss costs more
    than an add), so the figures say what the code does more, not what it costs in seconds."""

    on = False
    row = ""           # the row being measured (its --only name), for the child to rebuild
    argv: list = []    # the parent's --steps / --owners, passed on
    child = None       # in a child: the variant to replay, and how many times
    runs = 1
    nth = 0            # which compare() of the row (the python row measures two allocators)
    seen = 0
    VARIANTS = ("raw", "stacks off")  # and their +owners twins: the issue's comparison


def count_variants(variants: dict) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from cachegrind import instructions

    def count(name: str, runs: int) -> int:
        return instructions([sys.executable, os.path.abspath(__file__), "--only", Counting.row,
                             "--child", name, "--runs", str(runs), "--nth",
                             str(Counting.seen - 1), *Counting.argv], "bench_engines")[0]

    names = [n for n in variants if n.removesuffix(OWNERS) in Counting.VARIANTS]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        counts = {(n, k): pool.submit(count, n, k) for n in names for k in (1, 2)}
        return {n: counts[n, 2].result() - counts[n, 1].result() for n in names}


def compare(variants: dict, driver, ops, rounds: int) -> dict:
    """Fastest seconds per variant, the variants alternated round by round (on a shared machine
    noise only ever adds time, so the minimum is the steadiest figure). With ``--instructions``:
    instructions per variant instead (``Counting``)."""
    Counting.seen += 1
    if Counting.child is not None:  # a child under valgrind: replay the one variant, then stop
        if Counting.seen - 1 != Counting.nth:  # another allocator of the row: not this one
            return dict.fromkeys(variants, 1.0)
        make = variants[Counting.child]
        allocator = make()  # built once: a replay ends with every block freed, so it repeats
        gc.collect()
        gc.disable()
        for _ in range(Counting.runs):
            replay(allocator, driver, ops, getattr(make, "owners", False))
        raise SystemExit(0)
    if Counting.on:
        return count_variants(variants)
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, make in variants.items():
            times[name].append(timed(make, driver, ops))
    return {name: min(t) for name, t in times.items()}


PURE = " [pure]"
"""Suffix of a variant run on the Python wrappers (``--pure``)."""
OWNERS = " +owners"
"""Suffix of a variant whose every call runs as its sequence's holder (``--owners``)."""


def variants_of(make, spec, pure=False, prefix="", owners=False) -> dict:
    """``make``'s raw and guarded variants (and on the Python wrappers, ``pure``; with each
    call run as its sequence's holder, ``owners``), by name."""
    def guarded(options, on_python=False):
        def build():
            allocator = make()
            with wrappers(on_python):
                kvguard.guard(allocator, spec, **options)
            return allocator
        return build

    variants = {prefix + "raw": make}
    variants.update({prefix + name: guarded(options) for name, options in GUARDS.items()})
    if pure:
        variants.update({prefix + name + PURE: guarded(options, True)
                         for name, options in GUARDS.items()})
    if owners:
        for name in list(variants):
            def as_owners(build=variants[name]):
                return build()
            as_owners.owners = True
            variants[name + OWNERS] = as_owners
    return variants


def row(label, make, spec, driver, ops, rounds, target=None, pure=False, timings=None,
        owners=False) -> dict:
    """Print one allocator's ratios; returns the added microseconds per operation by variant.
    ``pure``: each guarded variant also on the Python wrappers, alternated in the same rounds,
    its ratio printed beside. ``timings``: the fastest times by variant, measured already (the
    np.int64 pool and its twin are measured together)."""
    med = timings or compare(variants_of(make, spec, pure, owners=owners), driver, ops, rounds)
    raw = med["raw"]
    scale, unit = (1, "instructions/op") if Counting.on else (1e6, "us/op")
    print(f"{label}: raw {raw / len(ops) * scale:.2f} {unit} ({len(ops)} ops)")
    added = {}
    for name, t in med.items():
        if name == "raw":
            continue
        added[name] = (t - raw) / len(ops) * scale
    for name in GUARDS:
        if name not in med:  # --instructions counts some variants only
            continue
        t = med[name]
        goal = f"   target {target[name]}" if target and name in target else ""
        beside = ""
        if pure:
            beside = (f"   pure {med[name + PURE] / raw:5.2f}x "
                      f"(+{added[name + PURE]:.2f} us/op)")
        print(f"  {name:<27} {t / raw:5.2f}x  (+{added[name]:.2f} {unit}){beside}{goal}")
    if owners and "raw" + OWNERS in med:
        held = med["raw" + OWNERS]
        print(f"  holders set (no guard): +{(held - raw) / len(ops) * scale:.2f} {unit}; with "
              "owners active, the guard against that and the whole against today's guarded run:")
        for name in GUARDS:
            if name + OWNERS not in med:
                continue
            t = med[name + OWNERS]
            print(f"  {name + OWNERS:<27} {t / held:5.2f}x  (+{(t - held) / len(ops) * scale:.2f}"
                  f" {unit})   {t / med[name]:5.3f}x today's {name}")
    return added


# --- allocators written here ---------------------------------------------------------------


class NumpyRefcountedPool:
    """A prefix-sharing pool in the common numpy design: ids travel as int64 arrays, refcounts
    live in an int32 array, a block returns to the free stack when its count reaches 0."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self._stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)
        self._top = num_blocks

    def allocate(self, n: int) -> np.ndarray:
        if n > self._top:
            raise ValueError(f"not enough free blocks for {n}")
        top = self._top - n
        out = self._stack[top:self._top].copy()
        self._top = top
        self.ref[out] = 1
        return out

    def add_ref(self, ids: np.ndarray) -> None:
        self.ref[ids] += 1

    def free(self, ids: np.ndarray) -> None:
        ref = self.ref
        ref[ids] -= 1
        zero = ids[ref[ids] == 0]
        top = self._top
        self._stack[top:top + len(zero)] = zero
        self._top = top + len(zero)

    def num_free(self) -> int:
        return self._top


NUMPY_REFCOUNTED_SPEC = kvguard.AllocatorSpec(share="add_ref", refcounted=True,
                                              size="num_blocks", free_count="num_free")


class ElementPool:
    """A small pool handing out one id per call from a Python free list whose entries are
    ``np.int64`` elements (taken from ``np.arange``, as pools built on numpy arrays hand them
    out) or, for the twin, plain ints. No checks of its own: about as cheap as an allocator gets."""

    def __init__(self, num_blocks: int, numpy_ids: bool = True) -> None:
        self.num_blocks = num_blocks
        ids = np.arange(num_blocks - 1, -1, -1, dtype=np.int64)
        self._free = list(ids) if numpy_ids else ids.tolist()

    def allocate(self):
        return self._free.pop()

    def free(self, block) -> None:
        self._free.append(block)  # noqa: KVG202 (no checks of its own: the guard's job)

    def num_free(self) -> int:
        return len(self._free)


def _each(allocator, n):
    allocate = allocator.allocate
    return [allocate() for _ in range(n)]


def _free_each(allocator, ids):
    free = allocator.free
    for b in ids:
        free(b)


ELEMENT_DRIVER = Driver(_each, _free_each)
ELEMENT_SPEC = kvguard.AllocatorSpec(size="num_blocks", free_count="num_free")
VALIDATING_SPEC = kvguard.AllocatorSpec(size="num_blocks", free_count="num_free")

LIST_DRIVER = Driver(lambda a, n: a.allocate(n), lambda a, ids: a.free(ids))


def numpy_driver() -> Driver:
    return Driver(lambda a, n: a.allocate(n), lambda a, ids: a.free(ids),
                  share=lambda a, ids: a.add_ref(ids), join=np.concatenate)


# --- where the time goes ---------------------------------------------------------------


def _locked(allocator, guard_lock):
    """A pass-through wrapper that also does what every guarded call does before any checking:
    the re-entrancy test and the lock (the guard's own kind: an RLock)."""
    owned, acquire, release = guard_lock._is_owned, guard_lock.acquire, guard_lock.release
    for name in ("allocate", "free"):
        original = getattr(allocator, name)

        def wrapper(*args, original=original, **kwargs):
            if owned():
                return original(*args, **kwargs)
            acquire()
            try:
                return original(*args, **kwargs)
            finally:
                release()
        setattr(allocator, name, wrapper)
    return allocator


def floor(rounds: int, calls: int = 20000) -> None:
    """The per-call cost, built up layer by layer on the cheapest allocator there is (one plain
    int per call from a Python list): each line adds one thing the guard does, and the
    difference from the line above is that thing's price. The compiled wrappers (when built) do
    the wrapper call, the lock and the checking in one C call, so their first line is measured
    against the bare allocator; the Python wrappers' lines follow, then the careful path."""
    import threading

    from bench_guard import passthrough

    def guarded(pure=False, **options):
        def build():
            allocator = ElementPool(1 << 16, numpy_ids=False)
            with wrappers(pure):
                kvguard.guard(allocator, ELEMENT_SPEC, **options)
            return allocator
        return build

    raw = "raw allocate() + free()"
    layers = {raw: (lambda: ElementPool(1 << 16, numpy_ids=False), None)}
    if shadowing.ACCEL is not None:
        first = "compiled: call, lock, ids, ledger, counters"
        layers.update({
            first: (guarded(stacks="off", history=0), raw),
            "compiled: + flight recorder (history=32)": (guarded(stacks="off"), first),
            "compiled: + call sites (stacks='cheap')": (
                guarded(stacks="cheap"), "compiled: + flight recorder (history=32)"),
        })
    wrapper = "Python: + a pass-through wrapper (call, *args)"
    lock = "Python: + re-entrancy test and lock"
    ledger = "Python: + ids read, ledger checked and written, counters"
    history = "Python: + flight recorder (history=32)"
    layers.update({
        wrapper: (lambda: passthrough(ElementPool(1 << 16, numpy_ids=False)), raw),
        lock: (lambda: _locked(ElementPool(1 << 16, numpy_ids=False), threading.RLock()),
               wrapper),
        ledger: (guarded(True, stacks="off", history=0), lock),
        history: (guarded(True, stacks="off"), ledger),
        "Python: + call sites (stacks='cheap')": (guarded(True, stacks="cheap"), history),
        "careful path instead (fast_path=False), cheap": (
            guarded(stacks="cheap", fast_path=False), None),
    })
    best = {name: float("inf") for name in layers}
    for _ in range(rounds):
        for name, (make, _) in layers.items():
            allocator = make()
            allocate, free = allocator.allocate, allocator.free
            gc.collect()
            gc.disable()
            try:
                t0 = time.thread_time()
                for _ in range(calls):
                    free(allocate())
                best[name] = min(best[name], time.thread_time() - t0)
            finally:
                gc.enable()
    print(f"where the time goes: one allocate() and one free() of a plain int, {calls} pairs, "
          "ns per pair (fastest round)")
    for name, (_, base) in layers.items():
        ns = best[name] / calls * 1e9
        step = "" if base is None else f"  ({ns - best[base] / calls * 1e9:+.0f})"
        print(f"  {name:<58} {ns:7.0f}{step}")


# --- engines' own allocators ---------------------------------------------------------------


@contextlib.contextmanager
def engine(name: str):
    """The engine's allocator modules as tests/kvguard/adapters load them, or None (not
    downloaded)."""
    import pytest

    from tests.kvguard.adapters import engines
    try:
        with engines.loaded(name) as ns:
            yield ns
    except pytest.skip.Exception as skip:
        print(f"{name}: skipped ({skip.msg})")
        yield None


def vllm_driver() -> Driver:
    """As vLLM's KV-cache manager calls its pool: ``get_new_blocks`` for new blocks, ``touch``
    on a prefix hit, ``free_blocks(reversed(blocks))`` when a request finishes."""
    return Driver(lambda p, n: p.get_new_blocks(n), lambda p, blocks: p.free_blocks(
        reversed(blocks)), share=lambda p, blocks: p.touch(blocks))


def deepspeed_driver():
    """As bench_guard.py drives it: the int32 tensor handed out is kept as a list (a tensor
    given back to ``free()`` is the ``tensor-id`` bug itself)."""
    return Driver(lambda a, n: a.allocate(n).tolist(), lambda a, ids: a.free(ids))


def sglang_driver():
    import torch
    return Driver(lambda a, n: a.alloc(n), lambda a, ids: a.free(ids), join=torch.cat)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--pure", action="store_true", help="also run every guarded variant on "
                        "the Python wrappers (as KVGUARD_PURE=1 does), alternated in one run")
    parser.add_argument("--owners", action="store_true", help="also run every variant with each "
                        "call as its sequence's holder (kvguard.owners.holding), as the engines' "
                        "request boundaries do")
    parser.add_argument("--only", default="", help="comma-separated rows: vllm, deepspeed, "
                        "sglang, numpy, int64, python, floor, memory")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind instead of timing, for the raw "
                             "and 'stacks off' variants (with --owners, their twins too) of the "
                             "rows vllm, deepspeed, sglang, numpy, python; slow (minutes a row)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--nth", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    if args.instructions or args.child:
        import shutil
        if args.instructions and shutil.which("valgrind") is None:
            print("bench_engines: valgrind is not on PATH (it counts the instructions)",
                  file=sys.stderr)
            return 2
        Counting.on, Counting.child, Counting.runs = args.instructions, args.child, args.runs
        Counting.nth, args.pure = args.nth, False
        Counting.argv = ["--steps", str(args.steps)] + (["--owners"] if args.owners else [])
        only = (only or {"vllm", "deepspeed", "sglang", "numpy", "python"}) - {
            "int64", "floor", "memory"}

    def want(name: str) -> bool:
        if only and name not in only:
            return False
        Counting.row, Counting.seen = name, 0
        return True
    n = 64 * 160
    shared = make_trace(args.steps)
    plain = make_trace(args.steps, share=0)
    print(f"pool of {n} blocks, 64 concurrent sequences; {args.rounds} alternated rounds, "
          f"fastest of each; python {sys.version.split()[0]}, numpy {np.__version__}")
    compiled = shadowing.ACCEL is not None
    print("guard wrappers: " + ("compiled (kvguard._fastpath)" if compiled else
                                "Python (kvguard._fastpath not built, or KVGUARD_PURE=1)")
          + ("; 'pure': the same variant on the Python wrappers" if args.pure and compiled
             else ""))
    pure = args.pure and compiled

    if want("vllm"):
        with engine("vllm") as vllm:
            if vllm is not None:
                from kvguard.adapters.vllm import BLOCK_POOL, SPECS
                row("vLLM 0.33.0 BlockPool (get_new_blocks / touch / free_blocks)",
                    lambda: vllm.BlockPool(num_gpu_blocks=n, enable_caching=False,
                                           hash_block_size=16),
                    SPECS[BLOCK_POOL], vllm_driver(), shared, args.rounds,
                    {"stacks off": "<= 2.0x (aim 1.5x)", "stacks cheap": "<= 2.0x"}, pure,
                    owners=args.owners)
    if want("deepspeed"):
        with engine("deepspeed") as ds:
            if ds is not None:
                from kvguard.adapters.deepspeed import BLOCKED_ALLOCATOR, SPECS
                row("DeepSpeed 0.19.8 BlockedAllocator (allocate -> int32 tensor, free(list))",
                    lambda: ds.BlockedAllocator(n), SPECS[BLOCKED_ALLOCATOR], deepspeed_driver(),
                    plain, max(3, args.rounds // 2),
                    {name: "<= 1.1x" for name in GUARDS}, pure, owners=args.owners)
    if want("sglang"):
        with engine("sglang") as sg:
            if sg is not None:
                import torch

                from kvguard.adapters.sglang import SPECS, TOKEN_ALLOCATOR
                row("SGLang 0.5.23 TokenToKVPoolAllocator (alloc / free, int64 tensors)",
                    lambda: sg.TokenToKVPoolAllocator(n, torch.float16, "cpu", None,
                                                      False),
                    SPECS[TOKEN_ALLOCATOR], sglang_driver(), plain, args.rounds, pure=pure,
                    owners=args.owners)
    if want("numpy"):
        row("numpy refcounted pool (allocate / add_ref / free, int64 arrays)",
            lambda: NumpyRefcountedPool(n), NUMPY_REFCOUNTED_SPEC, numpy_driver(), shared,
            args.rounds, {name: "<= 1.5x" for name in GUARDS}, pure, owners=args.owners)
    if want("int64"):
        # the two pools alternated in the same rounds: their added times are compared
        twin = "plain-int twin: "
        both = compare({**variants_of(lambda: ElementPool(n), ELEMENT_SPEC, pure),
                        **variants_of(lambda: ElementPool(n, numpy_ids=False), ELEMENT_SPEC,
                                      pure, twin)}, ELEMENT_DRIVER, plain, args.rounds)
        as_np = row("one-id-per-call pool of np.int64 elements", None, None, None, plain, 0,
                    pure=pure, timings={k: v for k, v in both.items() if not k.startswith(twin)})
        as_int = row("  its twin with plain-int ids (alternated with it)", None, None, None,
                     plain, 0, pure=pure, timings={k[len(twin):]: v for k, v in both.items()
                                                    if k.startswith(twin)})
        for name in GUARDS:
            beside = (f"; pure {as_np[name + PURE]:.2f} and {as_int[name + PURE]:.2f}"
                      if pure else "")
            print(f"  np.int64 ids add {as_np[name]:.2f} us/op, plain ints "
                  f"{as_int[name]:.2f} us/op with {name} (target: no more){beside}")
    if want("python"):
        for label, make, spec in (
                ("pure-Python ValidatingFreeList (bench_guard.py)", lambda: ValidatingFreeList(n),
                 VALIDATING_SPEC),
                ("pure-Python LinkedFreeList (bench_guard.py)", lambda: LinkedFreeList(n),
                 LINKED_FREE_LIST_SPEC)):
            row(label, make, spec, LIST_DRIVER, plain, args.rounds,
                {"stacks off": "<= 2.5x (aim 2.0x)", "stacks cheap": "<= 3.0x"}, pure,
                owners=args.owners)
    if want("floor"):
        floor(args.rounds)
    if want("memory"):
        ledger = Ledger(1 << 20, refcounted=True)
        print(f"ledger memory: {ledger.nbytes() / (1 << 20):.1f} bytes/block for a 1M-block "
              "refcounted pool (target <= 24)")
    return 0


if __name__ == "__main__":
    import results  # --write-docs: what this prints becomes its section of docs/cost.md
    sys.exit(results.main(main, modes=("--instructions",)))
