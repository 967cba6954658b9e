"""The lifecycle fuzzer on the installed transformers' continuous batching, every configuration
of ``kvguard.conformance.lifecycle_hf.CONFIGS`` in turn, each with the same fixed budget.

    python benchmarks/lifecycle/hf.py [--budget 60] [--seed 0] [--config NAME ...]
        [--with-cancel-fix]

Prints one row per configuration: what was found, the search time to the first violation
(before shrinking), the whole run's time, the event sequences that ran, the shrunk events.
``--with-cancel-fix`` runs the engine with the fix docs/findings.md proposes for the async
cancellation crash (a cancelled request leaves the scheduler FINISHED), to show that the
finding goes away with it and nothing else turns up in the same budget.

Needs transformers (5.24.0 was the release checked) and torch in the running interpreter, and
kvguard on its path. Runs on CPU, on one torch thread.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def apply_cancel_fix() -> None:
    from transformers.generation.continuous_batching import scheduler
    from transformers.generation.continuous_batching.requests import RequestStatus

    clear = scheduler.Scheduler.clear_cancelled_requests

    def clear_cancelled_requests(self):
        cancelled = clear(self)
        for state in cancelled:
            state.status = RequestStatus.FINISHED
        return cancelled

    scheduler.Scheduler.clear_cancelled_requests = clear_cancelled_requests


def run(config: str, budget: float, seed: int) -> dict:
    from kvguard.conformance import lifecycle_search
    from kvguard.conformance.lifecycle_hf import HfDriver, HfFactory
    from kvguard.testing import check_lifecycle

    started = time.monotonic()
    first, runs = [], [0]
    violation_init = lifecycle_search.LifecycleViolation.__init__
    run_init = lifecycle_search.Run.__post_init__

    def record(self, *args, **kwargs):  # the first violation, before any shrinking
        if not first:
            first.append(time.monotonic() - started)
        violation_init(self, *args, **kwargs)

    def count(self):
        runs[0] += 1
        run_init(self)

    lifecycle_search.LifecycleViolation.__init__ = record
    lifecycle_search.Run.__post_init__ = count
    try:
        report = check_lifecycle(HfFactory(config), HfDriver, examples=100_000, budget=budget,
                                 seed=seed, raise_on_finding=False)
    finally:
        lifecycle_search.LifecycleViolation.__init__ = violation_init
        lifecycle_search.Run.__post_init__ = run_init
    finding = report.findings[0] if report.findings else None
    return {"config": config, "found": f"{finding.kind}: {finding.message}" if finding else "-",
            "first": first[0] if finding else None, "seconds": report.seconds, "runs": runs[0],
            "events": finding.event_lines() if finding else []}


def main(argv=None) -> int:
    from kvguard.conformance.lifecycle_hf import CONFIGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--with-cancel-fix", action="store_true")
    args = parser.parse_args(argv)
    import torch
    import transformers
    torch.set_num_threads(1)
    if args.with_cancel_fix:
        apply_cancel_fix()
    print(f"transformers {transformers.__version__}, budget {args.budget:g} s per "
          f"configuration, seed {args.seed}{', cancel fix applied' if args.with_cancel_fix else ''}")
    for config in args.config:
        row = run(config, args.budget, args.seed)
        first = "-" if row["first"] is None else f"{row['first']:.1f} s"
        print(f"{row['config']:18} found: {row['found'][:90]:90} first violation: {first:>8} "
              f"run: {row['seconds']:.0f} s, {row['runs']} engines built", flush=True)
        for line in row["events"]:
            print(f"{'':20}{line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
