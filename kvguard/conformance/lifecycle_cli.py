"""``kvguard fuzz --lifecycle ENGINE``: the lifecycle fuzzer from the command line.

Engines: ``vllm`` (the installed vLLM's v1 scheduler, built from its ``tests/v1/core/utils.py``;
``--config`` picks the attention groups, async scheduling, prefix caching or a KV-consumer
connector, see ``kvguard.conformance.lifecycle_vllm.CONFIGS``), ``hf`` (the installed
transformers' continuous batching over a tiny random model; ``--config`` in
``kvguard.conformance.lifecycle_hf.CONFIGS``), ``sglang`` (the installed SGLang's ``Scheduler``
on CPU, a first cut: see ``kvguard.conformance.lifecycle_sglang``) and ``example`` (kvguard's
own small scheduler;
``--config`` names a planted bug, or ``fixed``). Exit status: 0 nothing found, 1 a
finding (the report shows it, with its regression test), 2 a command-line mistake (one line).
"""

from __future__ import annotations

import functools
import sys


def _example(config: str):
    from .lifecycle_example import BUGS, ExampleDriver, ExampleScheduler
    if config not in ("fixed", *BUGS):
        raise ValueError(f"unknown example configuration {config!r}: fixed, {', '.join(BUGS)}")
    bugs = () if config == "fixed" else (config,)
    return functools.partial(ExampleScheduler, 4, 2, bugs=bugs, async_scheduling=True,
                             defer_frees=config != "stale-free-after-abort"), ExampleDriver


def _vllm(config: str):
    from .lifecycle_vllm import VllmDriver, VllmFactory
    factory = VllmFactory(config)
    factory()  # builds the template: a missing vLLM or test tree fails here, in one line
    return factory, VllmDriver


def _hf(config: str):
    from .lifecycle_hf import HfDriver, HfFactory
    import torch
    torch.set_num_threads(1)  # the tiny engine's small tensor ops: several times faster
    factory = HfFactory(config)
    factory()  # builds the model and a manager: a missing transformers fails here, in one line
    return factory, HfDriver


def _sglang(config: str):
    from .lifecycle_sglang import SglangDriver, SglangFactory
    import torch
    torch.set_num_threads(1)
    factory = SglangFactory(config)
    factory()  # builds the Scheduler (30 to 100 s): a missing SGLang fails here, in one line
    return factory, SglangDriver


ENGINES = {"vllm": (_vllm, "full-async"), "hf": (_hf, "sync"), "sglang": (_sglang, "sync"),
           "example": (_example, "fixed")}


def _engine(args):
    """``(make_engine, driver class)``: a built-in engine by name, or the user's own
    (``--lifecycle pkg.mod:make_engine(k=v)`` with ``--driver pkg.mod:Driver``), in the spec
    language; a mistake is a ``ValueError`` (one line)."""
    from ..specgrammar import parse_call
    if args.lifecycle in ENGINES and args.driver is None:
        build, default = ENGINES[args.lifecycle]
        return build(args.config or default)
    called = parse_call(args.lifecycle)
    if called is None:
        raise ValueError(f"--lifecycle {args.lifecycle!r}: an engine ({', '.join(sorted(ENGINES))}"
                         ") or a factory pkg.mod:make_engine(k=v, ...)")
    if args.driver is None:
        raise ValueError(f"--lifecycle {args.lifecycle}: your own engine needs --driver "
                         "pkg.mod:Driver (a kvguard.testing.LifecycleDriver subclass)")
    ref, kw = called
    driver_ref = parse_call(args.driver)
    if driver_ref is None or driver_ref[1]:
        raise ValueError(f"--driver {args.driver!r}: name the class as pkg.mod:Driver")
    try:
        driver = driver_ref[0].resolve()
    except TypeError:
        raise ValueError(f"--driver {args.driver}: not a class") from None
    from .lifecycle import LifecycleDriver
    if not (isinstance(driver, type) and issubclass(driver, LifecycleDriver)):
        raise ValueError(f"--driver {args.driver}: not a kvguard.testing.LifecycleDriver "
                         "subclass")

    def make():
        return ref(**kw)
    from .contain import contained
    try:  # one that cannot build an engine fails here, in one line; one that exits, hangs or
        # forks is the engine's: check_lifecycle reports it
        contained(make, hang=args.hang, what="its factory", who="the engine")
    except (ImportError, AttributeError):
        raise
    except Exception as exc:
        raise ValueError(f"--lifecycle {args.lifecycle}: cannot build an engine: "
                         f"{exc!r}") from None
    return make, driver


def lifecycle_command(argv) -> int:
    from ..cli import Parser, UsageError
    parser = Parser(prog="kvguard fuzz --lifecycle", description=(
        "Fuzz an engine's request lifecycle (add, schedule, process a fake output, abort, "
        "reset the prefix cache) on its real scheduler, with kvguard's invariants checked "
        "after every event; report the shortest event sequence that breaks one, with a "
        "standalone regression test."))
    parser.add_argument("--lifecycle", required=True, metavar="ENGINE",
                        help=f"the engine: {', '.join(sorted(ENGINES))}, or your own: "
                        "pkg.mod:make_engine or pkg.mod:make_engine(k=v, ...), called with "
                        "those keywords for a fresh engine (with --driver)")
    parser.add_argument("--driver", default=None, metavar="pkg.mod:Driver",
                        help="your engine's kvguard.testing.LifecycleDriver subclass")
    parser.add_argument("--config", default=None, metavar="NAME",
                        help="the engine's configuration (vllm: full, full-async, prefix, "
                        "prefix-async, swa-async, chunked-local-async, hybrid-async, "
                        "pd-consumer-async, pd-async-load; hf: sync, sync-no-sharing, "
                        "sync-hybrid, async, async-no-sharing, async-hybrid; sglang: sync; "
                        "example: fixed or a planted bug)")
    parser.add_argument("--examples", type=int, default=500, metavar="N",
                        help="event sequences to try (default 500)")
    parser.add_argument("--steps", type=int, default=24, metavar="N",
                        help="events per sequence at most (default 24)")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    parser.add_argument("--budget", type=float, default=600.0, metavar="SECONDS",
                        help="stop searching after this long (default 600)")
    parser.add_argument("--hang", type=float, default=10.0, metavar="SECONDS",
                        help="an event sequence running longer than this is a hang, stopped "
                        "and reported (default 10)")
    parser.add_argument("--emit", metavar="FILE", help="write the regression test here")
    args = parser.parse_args(argv)
    if args.examples < 1 or args.steps < 1:
        raise UsageError("kvguard fuzz: error: --examples and --steps must be at least 1")
    if not args.budget > 0 or not args.hang > 0:
        raise UsageError("kvguard fuzz: error: --budget and --hang must be seconds above 0")
    try:
        make, driver = _engine(args)
    except ValueError as exc:
        raise UsageError(f"kvguard fuzz: error: {exc}") from None
    except (ImportError, FileNotFoundError, AttributeError) as exc:
        raise UsageError(f"kvguard fuzz: error: cannot build the {args.lifecycle} engine: "
                         f"{exc}") from None
    from .contain import interrupted
    from .lifecycle_check import check_lifecycle
    try:
        report = check_lifecycle(make, driver, examples=args.examples, steps=args.steps,
                                 seed=args.seed, budget=args.budget, hang=args.hang,
                                 raise_on_finding=False)
    except KeyboardInterrupt as stop:  # the user's: the engine's is an escape by now
        return interrupted(getattr(stop, "report", None), "fuzz")
    sys.stdout.write(report.render() + "\n")
    if args.emit and report.findings:
        with open(args.emit, "w") as out:
            out.write(report.findings[0].test)
    return 1 if report.findings or report.escapes else 0
