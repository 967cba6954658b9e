"""One command's instruction count under valgrind's cachegrind: the same count run after run on
a shared machine, which the benchmarks' ``--instructions`` modes compare instead of time."""

from __future__ import annotations

import os
import re
import subprocess


def instructions(argv: list, who: str) -> tuple:
    """``(instructions, stdout)`` of ``argv`` run under cachegrind (hash seed fixed, one
    OpenBLAS thread: numpy's idle threads spin, and valgrind counts what they run)."""
    out = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         *argv], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"})
    found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if found is None:
        raise SystemExit(f"{who}: no instruction count in valgrind's output:\n"
                         f"{out.stderr[-2000:]}")
    return int(found.group(1).replace(",", "")), out.stdout
