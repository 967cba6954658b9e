"""What ``pytest -p kvguard`` costs a test suite: prints plugin-on/plugin-off ratios.

    python benchmarks/bench_plugin.py [--tests 500] [--rounds 7] [--steps 10]

A synthetic suite of ``--tests`` tests, each running ``--steps`` allocate/free pairs on its own
allocator (kvguard's LinkedFreeList, DeepSpeed's logic), is run in this process with
``pytest.main()``, the variants alternated round by round, ``gc.collect()`` before each run.
Two comparisons, each timed twice: the whole session and the test loop alone (collection and
start-up excluded):

- plugin: every test guards its allocator itself (``kvguard.guard``), plugin on vs dormant. The
  difference is the plugin's own work (owner labels, attribution hooks, leak scans). Target
  1.10x.
- suite: the allocator class is registered (ini ``kvguard_allocators``) and guarded from
  construction by the plugin, vs the same suite unguarded with the plugin dormant: what a user
  pays for switching kvguard on (the guard's own cost is bench_guard.py's business).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

CONFTEST = '''
import os

import pytest

import kvguard
from kvguard.examples import LINKED_FREE_LIST_SPEC, LinkedFreeList


@pytest.fixture
def pool():
    pool = LinkedFreeList(64)
    if os.environ.get("KVG_BENCH_GUARD") == "1":
        kvguard.guard(pool, LINKED_FREE_LIST_SPEC)
    return pool
'''

SUITE = '''
import pytest

STEPS = {steps}


@pytest.mark.parametrize("n", range({tests}))
def test_sequence(pool, n):
    held = []
    for step in range(STEPS):
        held.append(pool.allocate(1 + (n + step) % 4))
        if len(held) > 2:
            pool.free(held.pop(0))
    for ids in held:
        pool.free(ids)
    assert pool.free_blocks == 64
'''

REGISTERED = ("kvguard_allocators=kvguard.examples:LinkedFreeList size=_num_blocks "
              "free_count=free_blocks")


class LoopTimer:
    """Times pytest_runtestloop: the tests themselves, without start-up and collection."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(self, session):
        t0 = time.perf_counter()
        try:
            return (yield)
        finally:
            self.seconds = time.perf_counter() - t0


def run(folder: str, args: list, guard_in_test: bool) -> tuple[float, float]:
    os.environ["KVG_BENCH_GUARD"] = "1" if guard_in_test else "0"
    timer = LoopTimer()
    gc.collect()
    sink = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        code = pytest.main([folder, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                            "-p", "no:xdist", "-p", "no:benchmark", *args], plugins=[timer])
    total = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"the synthetic suite failed ({args}):\n{sink.getvalue()[-3000:]}")
    return total, timer.seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    variants = {
        "plugin off, test guards": ([], True),
        "plugin on,  test guards": (["-p", "kvguard"], True),
        "plugin off, unguarded  ": ([], False),
        "plugin on,  registered ": (["-p", "kvguard", "-o", REGISTERED], False),
    }
    with tempfile.TemporaryDirectory(prefix="kvg_bench_plugin_") as folder:
        with open(os.path.join(folder, "conftest.py"), "w") as f:
            f.write(CONFTEST)
        with open(os.path.join(folder, "test_synthetic.py"), "w") as f:
            f.write(SUITE.format(tests=args.tests, steps=args.steps))
        for name, (extra, guard_in_test) in variants.items():  # warm-up: imports, caches
            run(folder, extra, guard_in_test)
        totals = {name: [] for name in variants}
        loops = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (extra, guard_in_test) in variants.items():
                total, loop = run(folder, extra, guard_in_test)
                totals[name].append(total)
                loops[name].append(loop)

    med_total = {name: statistics.median(t) for name, t in totals.items()}
    med_loop = {name: statistics.median(t) for name, t in loops.items()}
    print(f"{args.tests} tests x {args.steps} allocate/free steps, median of {args.rounds} "
          "alternated rounds")
    for name in variants:
        print(f"  {name}  session {med_total[name] * 1e3:8.1f} ms   test loop "
              f"{med_loop[name] * 1e3:8.1f} ms   ({med_loop[name] / args.tests * 1e6:6.1f} "
              "us/test)")

    def ratio(on, off):
        return med_total[on] / med_total[off], med_loop[on] / med_loop[off]

    plugin_total, plugin_loop = ratio("plugin on,  test guards", "plugin off, test guards")
    suite_total, suite_loop = ratio("plugin on,  registered ", "plugin off, unguarded  ")
    per_test = (med_loop["plugin on,  test guards"] - med_loop["plugin off, test guards"]) \
        / args.tests * 1e6
    print(f"plugin on / off (same guarded allocator): session {plugin_total:.3f}x, "
          f"test loop {plugin_loop:.3f}x (target 1.10x); {per_test:+.1f} us per test")
    print(f"suite with -p kvguard / plain (guard + plugin): session {suite_total:.3f}x, "
          f"test loop {suite_loop:.3f}x")
    return 0


if __name__ == "__main__":
    import results  # --write-docs: what this prints becomes its section of docs/cost.md
    sys.exit(results.main(main))
