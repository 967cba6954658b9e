"""What numpy integer scalar ids cost the guard beside plain ints, counted in instructions.

    python benchmarks/bench_scalar_ids.py [--calls N]

The np.int64 row of bench_engines compares the time the guard adds on a pool handing out
np.int64 elements with its plain-int twin; the two differ by a few nanoseconds per call,
far below what timing resolves on a shared machine. This benchmark counts instructions
instead (valgrind's cachegrind, which gives the same count run after run): each variant runs
in a child process twice, with N and 3N calls, and the difference divided by 2N is the cost of
one call with the interpreter's start-up taken out. Two pools, each with np.int64 ids and with
plain ints: one id per call (allocate() / free(b), as bench_engines' pool), and four ids per
call in a list (allocate(4) / free(ids), ids taken out of an array one by one). Printed: the
instructions per call raw and guarded (stacks off), what the guard adds, and what np.int64
ids add over plain ints. Needs valgrind on PATH; says so and exits 2 without it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import gc
import sys
import numpy as np
import kvguard

shape, ids, mode, calls = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


class Pool:
    num_blocks = 1000

    def __init__(self):
        self.free_list = list(np.arange(1000)) if ids == "np" else list(range(1000))

    def allocate(self, n=None):
        if n is None:
            return self.free_list.pop()
        return [self.free_list.pop() for _ in range(n)]

    def free(self, b):
        if type(b) is list:
            self.free_list.extend(b)
        else:
            self.free_list.append(b)


pool = Pool()
if mode == "guarded":
    kvguard.guard(pool, kvguard.AllocatorSpec(size="num_blocks"), stacks="off")
allocate, free = pool.allocate, pool.free
gc.disable()  # a collection falls at a different call in the short and the long run
if shape == "one":
    for _ in range(calls // 4):
        x = allocate()
        y = allocate()
        free(x)
        free(y)
else:
    for _ in range(calls // 2):
        free(allocate(4))
"""


def instructions(shape: str, ids: str, mode: str, calls: int) -> int:
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         sys.executable, "-c", CHILD, shape, ids, mode, str(calls)],
        capture_output=True, text=True, check=True,
        # one OpenBLAS thread: numpy's idle threads spin, and valgrind counts what they run
        env={**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"})
    found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if found is None:
        raise SystemExit(f"bench_scalar_ids: no instruction count in valgrind's output:\n"
                         f"{out.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_call(shape: str, ids: str, mode: str, calls: int) -> float:
    return (instructions(shape, ids, mode, 3 * calls)
            - instructions(shape, ids, mode, calls)) / (2 * calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40_000, help="calls per short run")
    args = parser.parse_args()
    if args.calls < 4:
        parser.error("--calls must be at least 4")
    if shutil.which("valgrind") is None:
        print("bench_scalar_ids: valgrind is not on PATH (it counts the instructions)",
              file=sys.stderr)
        return 2
    from kvguard.guard import shadowing

    print("guard wrappers:", "compiled (kvguard._fastpath)" if shadowing.ACCEL is not None
          else "Python (kvguard._fastpath not built, or KVGUARD_PURE=1)")
    for shape, label in (("one", "one id per call"), ("list", "four ids per call, a list")):
        added = {}
        for ids in ("np", "int"):
            raw = per_call(shape, ids, "raw", args.calls)
            guarded = per_call(shape, ids, "guarded", args.calls)
            added[ids] = guarded - raw
            name = "np.int64 ids" if ids == "np" else "plain ints  "
            print(f"{label}, {name}: raw {raw:7.0f}, guarded {guarded:7.0f} instructions per "
                  f"call; the guard adds {added[ids]:6.0f}")
        print(f"  np.int64 ids add {added['np'] - added['int']:+.0f} instructions per call over "
              f"plain ints ({added['np'] / added['int']:.3f}x the guard's plain-int cost)")
    return 0


if __name__ == "__main__":
    import results  # --write-docs: what this prints becomes its section of docs/cost.md
    sys.exit(results.main(main))
