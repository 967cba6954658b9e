"""The guard's cost in engine terms: vLLM's own KV-cache manager code, raw against guarded.

    python benchmarks/bench_vllm_manager.py [--requests 3000] [--rounds 5] [--blocks 4096]

vLLM 0.33.0's ``FullAttentionManager`` (with its base ``SingleTypeKVCacheManager``, from
``vllm/v1/core/single_type_kv_cache_manager.py``) over its real ``BlockPool`` and
``KVCacheBlock`` (``block_pool.py``, ``kv_cache_utils.py``), all executed from the wheel in
KVGUARD_ENGINE_CACHE the way tests/kvguard/adapters load engine code. The rest of that file (sliding
window, Mamba, hybrid managers) and the coordinator / ``KVCacheManager`` above it import vLLM's
config system, attention backends, request and metrics types, which cannot load without
installing vLLM and its dependencies: the schedule below plays the coordinator's part, calling
the manager's methods in the order ``KVCacheManager.allocate_slots`` and the scheduler do.

The schedule is continuous batching: thousands of requests arrive (prompts 32-1024 tokens,
outputs 16-512), up to 128 run at once; half of the arrivals hit a running request's prefix
(``add_local_computed_blocks``: the pool's ``touch``); every step each running request decodes
one token (``get_num_blocks_to_allocate`` / ``allocate_new_blocks``); when the pool is short,
the newest running request is preempted (``free``) and re-queued to recompute, as vLLM's
scheduler does; finished requests are freed (``free_blocks(reversed(blocks))``).

Raw and guarded runs (the built-in vLLM spec, as ``pytest -p kvguard`` or ``KVGUARD=1`` would
install it; where the compiled wrappers are in use, also on the Python wrappers, "[pure]")
alternate in one process with garbage collection off, timed in CPU time of the
thread; the figures are the fastest round of each: the manager's own time per scheduler step,
the time the guard adds per step, and their ratio. Only the KV-cache manager runs here: in a
serving process each step also runs the model forward pass (milliseconds on a GPU), so the added
microseconds per step, not the ratio, are what a deployment pays.
"""

from __future__ import annotations

import abc
import argparse
import collections
import contextlib
import gc
import itertools
import os
import random
import sys
import time
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvguard  # noqa: E402
from bench_guard import wrappers  # noqa: E402  (one OpenBLAS thread from here: see there)
from kvguard.guard import shadowing  # noqa: E402
from kvguard import boundaries  # noqa: E402
from kvguard.staging import StagingConfig  # noqa: E402

BLOCK_SIZE = 16
MANAGER = "vllm/v1/core/single_type_kv_cache_manager.py"


def load_manager(modules, package, vllm):
    """vLLM's ``FullAttentionManager`` class from the wheel, its base class with it. Annotations
    stay unevaluated; the names the two class bodies use at run time are vLLM's own
    (``BlockPool``, ``KVCacheBlock``, ``trim_null_head``, ``cdiv``) or, for two ``isinstance``
    checks never reached here (``AttentionSpec`` zeroing, ``FullAttentionSpec`` hash lookup),
    placeholders."""
    utils = sys.modules["vllm.v1.core.kv_cache_utils"]
    names = {name: type(name, (), {}) for name in (
        "AttentionSpec", "CircularBufferSpec", "FullAttentionSpec", "ChunkedLocalAttentionSpec",
        "KVCacheSpec", "KVCacheSpecRegistry", "SharedEventQueueBlockPool", "Request",
        "KVCacheMetricsCollector")}
    namespace = dict(
        names, ABC=abc.ABC, abstractmethod=abc.abstractmethod, ClassVar=typing.ClassVar,
        TYPE_CHECKING=False, Sequence=collections.abc.Sequence,
        defaultdict=collections.defaultdict, itertools=itertools,
        cdiv=lambda a, b: -(a // -b), BlockPool=vllm.BlockPool, KVCacheBlock=vllm.KVCacheBlock,
        trim_null_head=utils.trim_null_head, null_head_len=utils.null_head_len,
        MEDIUM_CPU="CPU")
    dotted = "vllm.v1.core.single_type_kv_cache_manager"
    modules.load_class(package, MANAGER, dotted, "SingleTypeKVCacheManager", **namespace)
    return modules.load_class(package, MANAGER, dotted, "FullAttentionManager")


class Spec:
    """The attributes of a ``FullAttentionSpec`` the manager reads."""

    block_size = BLOCK_SIZE
    dcp_sharded = False


def make_workload(requests: int, seed: int = 0) -> list:
    """Arrivals: ``(prompt_tokens, output_tokens, shares_prefix)``."""
    rng = random.Random(seed)
    return [(rng.randint(32, 1024), rng.randint(16, 512), rng.random() < 0.5)
            for _ in range(requests)]


def schedule(manager, pool, workload, max_running: int = 128) -> int:
    """Run the workload to completion; returns the number of scheduler steps."""
    waiting = collections.deque(enumerate(workload))
    running = {}  # request id -> [tokens so far, tokens left to generate, prompt tokens]
    order = []    # running request ids, oldest first (the newest is preempted first)
    steps = 0
    get_num, allocate = manager.get_num_blocks_to_allocate, manager.allocate_new_blocks
    while waiting or running:
        steps += 1
        manager.new_step_starts()
        # Decode: one more token for every running request; preempt the newest when short.
        for rid in list(order):
            if rid not in running:
                continue
            state = running[rid]
            tokens = state[0] + 1
            need = get_num(rid, tokens, [], tokens, 0, tokens)
            while need > pool.get_num_free_blocks() and order:
                victim = order.pop()  # recomputed later: prompt and output so far re-prefilled
                manager.free(victim)
                done, left, _ = running.pop(victim)
                waiting.appendleft((victim, (done, left, False)))
                if victim == rid:
                    break
            if rid not in running:
                continue
            allocate(rid, tokens, tokens)
            state[0] = tokens
            state[1] -= 1
            if state[1] <= 0:
                manager.free(rid)
                del running[rid]
                order.remove(rid)
        # Admit: a prefix hit takes a reference to a running request's full blocks (touch).
        while waiting and len(running) < max_running:
            rid, (prompt, output, shares) = waiting[0]
            hit = []
            if shares and order:
                parent = order[len(order) // 2]
                full = manager.req_to_blocks[parent][: min(prompt, running[parent][2])
                                                     // BLOCK_SIZE]
                hit = full[: max(1, len(full) // 2)] if full else []
            computed = len(hit) * BLOCK_SIZE
            need = get_num(rid, prompt, hit, computed, computed, prompt)
            if need > pool.get_num_free_blocks():
                break
            waiting.popleft()
            manager.add_local_computed_blocks(rid, hit, computed, 0)
            allocate(rid, prompt, prompt)
            running[rid] = [prompt, output, prompt]
            order.append(rid)
    return steps


REQUEST_BOUNDARIES = ("allocate_new_blocks", "add_local_computed_blocks", "free")
"""The manager's methods that act for the request named by their first argument: with owners
each is a request boundary (``kvguard.boundaries``), installed as the vLLM adapter installs
``KVCacheManager.allocate_slots`` and ``free``, so a call runs as its request's holder."""


@contextlib.contextmanager
def request_boundaries(manager_class, owners: bool):
    if not owners:
        yield
        return
    for name in REQUEST_BOUNDARIES:  # on the class that defines it (the base, for some)
        owner = next(cls for cls in manager_class.__mro__ if name in vars(cls))
        boundaries.declare(owner, **{name: boundaries.request_id_arg(0)})
    boundaries.instrument()
    try:
        yield
    finally:
        boundaries.uninstrument()


def timed(make, workload, guard_options, pure=False, owners=False):
    pool, manager = make()
    with wrappers(pure):
        guard = kvguard.guard(pool, **guard_options) if guard_options is not None else None
    gc.collect()
    with request_boundaries(type(manager), owners):
        gc.disable()
        try:
            t0 = time.thread_time()
            steps = schedule(manager, pool, workload)
            elapsed = time.thread_time() - t0
        finally:
            gc.enable()
    if guard is not None:
        assert guard.violations == [], guard.violations[:1]
        assert guard.live == {}, "every request was freed"
    return elapsed, steps, guard


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under valgrind instead of timing (steadier "
                             "than time on a shared machine; slow: use --requests 300)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one variant, under valgrind
    parser.add_argument("--runs", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instructions:
        return count_instructions(args)
    import pytest

    from tests.kvguard.adapters import engines
    try:
        package = engines.archive("vllm")
    except pytest.skip.Exception as skip:
        print(f"vllm: skipped ({skip.msg})")
        return 0
    modules = engines.Modules()
    try:
        vllm = engines.LOADERS["vllm"](package, modules)
        Manager = load_manager(modules, package, vllm)

        def make():
            pool = vllm.BlockPool(num_gpu_blocks=args.blocks, enable_caching=True,
                                  hash_block_size=BLOCK_SIZE)
            return pool, Manager(Spec(), pool, enable_caching=True, kv_cache_group_id=0,
                                 scheduler_block_size=BLOCK_SIZE)

        workload = make_workload(args.requests)
        variants = {"raw": None, "stacks off": {"stacks": "off"},
                    "stacks cheap": {"stacks": "cheap"},
                    "staging (log, SAMPLE=100)":
                        StagingConfig(sample=100, stacks="full").guard_options()}
        if shadowing.ACCEL is not None:  # the Python wrappers beside the compiled ones
            variants.update({f"{name} [pure]": variants[name]
                             for name in ("stacks off", "stacks cheap")})
        # Owners active: every call for a request runs as its holder (the stale-free check).
        # "raw +owners" is the engine with the holder set and no guard: the boundary's own
        # cost, and the baseline the guard's cost with owners active is measured against.
        variants.update({f"{name} +owners": variants[name] for name in list(variants)})
        if args.child is not None:  # under valgrind: one manager, the workload run N times
            pool, manager = make()
            options = variants[args.child]
            with wrappers("[pure]" in args.child):
                guard = kvguard.guard(pool, **options) if options is not None else None
            gc.collect()
            with request_boundaries(type(manager), args.child.endswith("+owners")):
                gc.disable()
                for _ in range(args.runs):  # every request ends freed: it runs again as new
                    steps = schedule(manager, pool, workload)
            assert guard is None or guard.violations == [], guard.violations[:1]
            print(f"steps {steps}")
            return 0
        best = {name: None for name in variants}
        for _ in range(args.rounds):
            for name, options in variants.items():
                elapsed, steps, guard = timed(make, workload, options, "[pure]" in name,
                                              name.endswith("+owners"))
                # Only the counts are kept: a guard kept alive keeps its class-level
                # dispatchers on BlockPool, which every unguarded pool then calls through.
                counts = guard and (guard.stats.alloc_calls, guard.stats.share_calls,
                                    guard.stats.free_calls)
                del guard
                if best[name] is None or elapsed < best[name][0]:
                    best[name] = (elapsed, steps, counts)
        raw, steps, _ = best["raw"]
        alloc_calls, share_calls, free_calls = best["stacks off"][2]
        print(f"vLLM 0.33.0 FullAttentionManager + BlockPool: {args.requests} requests, "
              f"{args.blocks} blocks of {BLOCK_SIZE} tokens, {steps} scheduler steps; "
              f"{alloc_calls} get_new_blocks, {share_calls} touch, "
              f"{free_calls} free_blocks calls per run; fastest of {args.rounds} rounds")
        print(f"  raw: the manager's own time {raw / steps * 1e6:.1f} us per scheduler step")
        print("  guard wrappers: " + ("compiled (kvguard._fastpath); [pure]: the Python wrappers"
                                      if shadowing.ACCEL is not None else "Python"))
        raw_owners = best["raw +owners"][0]
        print(f"  holders set at the request boundary (no guard): "
              f"+{(raw_owners - raw) / steps * 1e6:.1f} us per step, {raw_owners / raw:.2f}x")
        for name, (elapsed, _, _) in best.items():
            if name.startswith("raw"):
                continue
            base = raw_owners if name.endswith("+owners") else raw
            added = (elapsed - base) / steps * 1e6
            print(f"  {name:<34} +{added:.1f} us per step, {elapsed / base:.2f}x the manager's "
                  f"own time" + (" (with its holders set)" if base is raw_owners else ""))
        print("  with owners active against today (the boundaries and the guard together):")
        for name, (elapsed, _, _) in best.items():
            if name.endswith(" +owners") and not name.startswith("raw"):
                today = best[name[:-len(" +owners")]][0]
                print(f"  {name:<34} {elapsed / today:.2f}x today's "
                      f"({(elapsed - today) / steps * 1e6:+.1f} us per step)")
    finally:
        modules.close()
    return 0


COUNTED = ("raw", "raw +owners", "stacks off", "stacks off +owners", "stacks cheap",
           "stacks cheap +owners", "staging (log, SAMPLE=100)", "staging (log, SAMPLE=100) +owners")


def count_instructions(args) -> int:
    """Each variant in a child process under valgrind's cachegrind, running the workload once
    and twice on one manager: the difference is one run's instructions, start-up and the
    pool's building taken out. The same count
    run after run, whatever else the machine does; instructions are not time (a cache miss
    costs more than an add), so this is beside the timed figures, not instead of them."""
    import re
    import shutil

    from cachegrind import instructions
    if shutil.which("valgrind") is None:
        print("bench_vllm_manager: valgrind is not on PATH (it counts the instructions)",
              file=sys.stderr)
        return 2

    def count(name: str, runs: int):
        total, out = instructions(
            [sys.executable, os.path.abspath(__file__), "--child", name, "--runs", str(runs),
             "--requests", str(args.requests), "--blocks", str(args.blocks)],
            "bench_vllm_manager")
        return total, int(re.search(r"steps (\d+)", out).group(1))

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # each child one process
        counts = {(name, runs): pool.submit(count, name, runs)
                  for name in COUNTED for runs in (1, 2)}
        per_step = {}
        for name in COUNTED:
            (once, steps), (twice, _) = counts[name, 1].result(), counts[name, 2].result()
            per_step[name] = (twice - once) / steps
    print(f"vLLM 0.33.0 FullAttentionManager + BlockPool: {args.requests} requests, {steps} "
          f"scheduler steps; instructions per step (valgrind cachegrind, one run's count)")
    raw, raw_owners = per_step["raw"], per_step["raw +owners"]
    print(f"  raw: {raw:,.0f}; holders set at the request boundary (no guard): "
          f"{raw_owners:,.0f} ({raw_owners / raw:.3f}x)")
    for name in COUNTED[2::2]:
        today, owners = per_step[name], per_step[name + " +owners"]
        print(f"  {name:<26} {today / raw:.3f}x raw; +owners {owners / raw_owners:.3f}x raw "
              f"with holders set, {owners / today:.3f}x today's")
    return 0


if __name__ == "__main__":
    import results  # --write-docs: what this prints becomes its section of docs/cost.md
    sys.exit(results.main(main, modes=("--instructions",)))
