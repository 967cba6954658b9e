"""The conformance fuzzer on the seven engines' allocators over many seeds: no emitted test
may pass on the class as it ships, none may import kvguard, and no two findings of one report
may end on the same harm. Prints a row per engine (findings and tests per seed) and exits 1 on
any breach.

    python benchmarks/fuzz_seeds.py [--seeds 0-9] [--examples 100] [--robustness] [--only vllm,...]

The engines' code is read out of the downloaded packages as tests/kvguard/adapters does
(KVGUARD_ENGINE_CACHE, default ~/.cache/kvguard-engines). A check, not a timing: it takes
about a second per engine and seed on a quiet machine.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvguard.conformance.fuzz import target_for  # noqa: E402
from kvguard.testing import check_allocator  # noqa: E402
from tests.kvguard.adapters import engines  # noqa: E402

CLASSES = {"deepspeed": "BlockedAllocator", "vllm": "BlockPool",
           "sglang": "TokenToKVPoolAllocator", "transformers": "CachePool",
           "lmcache": "PagedTensorMemoryAllocator", "lmdeploy": "LogicalAllocator",
           "aphrodite": "BlockPool"}


def _imports(code: str) -> set:
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
    return found


def _fails(code: str) -> bool:
    namespace: dict = {}
    exec(compile(code, "<emitted>", "exec"), namespace)
    (test,) = [f for name, f in namespace.items() if name.startswith("test_")]
    try:
        test()
    except BaseException:  # noqa: B036 - pytest's failure is a BaseException
        return True
    return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--robustness", action="store_true")
    parser.add_argument("--only", default="")
    args = parser.parse_args(argv)
    low, _, high = args.seeds.partition("-")
    seeds = range(int(low), int(high or low) + 1)
    chosen = [e for e in CLASSES if not args.only or e in args.only.split(",")]
    breaches = []
    for engine in chosen:
        started, counts = time.monotonic(), []
        with engines.loaded(engine) as ns:
            make, spec, driver, source = target_for(getattr(ns, CLASSES[engine]))
            for seed in seeds:
                report = check_allocator(make, spec, examples=args.examples, seed=seed,
                                         budget=600, driver=driver, make=source,
                                         robustness=args.robustness or None,
                                         raise_on_broken=False)
                shown = report.findings + report.robustness
                keys = [f.harm for f in report.findings]
                if len(set(keys)) != len(keys):
                    breaches.append(f"{engine} seed {seed}: two findings, one harm")
                tests = 0
                for f in shown:
                    if not f.test:
                        continue
                    tests += 1
                    if "kvguard" in _imports(f.test):
                        breaches.append(f"{engine} seed {seed} {f.clause}: imports kvguard")
                    if not _fails(f.test):
                        breaches.append(f"{engine} seed {seed} {f.clause}: the test passes")
                counts.append(f"{len(report.findings)}/{tests}")
        print(f"{engine:<13} findings/tests per seed: {' '.join(counts)}   "
              f"({time.monotonic() - started:.1f} s)")
    for b in breaches:
        print("BREACH:", b)
    print(f"{len(breaches)} breach(es) over {len(chosen)} engine(s) x {len(seeds)} seed(s)")
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main())
