"""``kvguard fuzz DOTTED.NAME``: the conformance fuzzer from the command line.

The engines' allocators need more than a spec to be fuzzed: a constructor call that makes a
small pool, and, for some, a way to call them (Hugging Face's ``CachePool`` takes an ``index``
before the ids, LMCache allocates through ``batched_allocate(shape, dtype, n)``). ``TARGETS``
holds that for each engine allocator, keyed by dotted class name; any other class is fuzzed
with ``--factory`` (an expression building one, ``cls`` bound to the class) and its registered
spec, or ``--spec module.NAME``. Exit status: 0 every promised clause kept, 1 a clause broken,
2 a command-line mistake (one line, never a traceback).
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from ..registry import spec_for
from ..spec import AllocatorSpec, SpecSyntaxError, misfit
from .clauses import CLAUSES, Driver


@dataclass(frozen=True)
class Target:
    """How to make and call one engine's allocator for the fuzzer."""

    make: Callable[[type], Any]
    """A fresh, small pool from its class."""
    make_source: str
    """The same, as the regression tests write it (``{cls}`` is the class name)."""
    spec: AllocatorSpec | None = None
    """None: the class's registered (built-in) spec."""
    driver: Driver = field(default_factory=Driver)
    note: str = ""


def _torch():
    import torch
    return torch


def _hf_pool(cls):
    pool = cls(num_sectors=2, num_allocators=1)
    pool.set_blocks_per_sector(0, 4)
    pool.allocate_sector(0)
    pool.allocate_sector(0)
    return pool


_LMCACHE_PAGE = ((2, 1, 4, 8), "float16")  # one 128-byte page


def _lmcache_pool(cls):
    torch = _torch()
    shape, dtype = _LMCACHE_PAGE
    fmt = sys.modules[cls.__module__].MemoryFormat.KV_2LTD
    return cls(torch.zeros(8 * 128, dtype=torch.uint8), [torch.Size(shape)],
               [getattr(torch, dtype)], fmt)


def _lmcache_allocate(a, n):
    torch = _torch()
    shape, dtype = _LMCACHE_PAGE
    return a.batched_allocate(torch.Size(shape), getattr(torch, dtype), n)


def _page(a, i):
    return next((obj for obj in a.free_blocks if obj.meta.address == i), None)


def _numpy_ids(value):
    """A list of plain ints as the int64 array lmdeploy's callers pass; anything else as is."""
    if isinstance(value, list) and all(type(b) is int for b in value):
        import numpy
        return numpy.asarray(value, dtype=numpy.int64)
    return value


def _vllm_block(pool, i):
    """The pool's own block object for an in-range id (callers look blocks up in
    ``pool.blocks`` by id); never one made up for an id the pool could not have handed out."""
    return pool.blocks[i] if 0 <= i < len(pool.blocks) else None


_VLLM_DRIVER = Driver(
    block=_vllm_block, reserved=(0,), refcount=lambda a, b: a.blocks[b].ref_cnt,
    source={"block": "{a}.blocks[{id}]", "refcount": "{a}.blocks[{id}].ref_cnt"})

TARGETS = {
    "deepspeed.inference.v2.ragged.blocked_allocator.BlockedAllocator": Target(
        lambda cls: cls(8), "{cls}(8)"),
    "vllm.v1.core.block_pool.BlockPool": Target(
        lambda cls: cls(num_gpu_blocks=8, enable_caching=False, hash_block_size=16),
        "{cls}(num_gpu_blocks=8, enable_caching=False, hash_block_size=16)",
        driver=_VLLM_DRIVER, note="block 0 is the null block, never handed out"),
    "aphrodite.v1.core.block_pool.BlockPool": Target(
        lambda cls: cls(num_gpu_blocks=8, enable_caching=False, hash_block_size=16),
        "{cls}(num_gpu_blocks=8, enable_caching=False, hash_block_size=16)",
        spec=AllocatorSpec(alloc="get_new_blocks", free="free_blocks", share="touch",
                           id_attr="block_id", refcounted=True, iterator_ok=True,
                           size="num_gpu_blocks", free_count="get_num_free_blocks"),
        driver=_VLLM_DRIVER, note="vLLM's BlockPool, forked"),
    "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator": Target(
        lambda cls: cls(size=8, dtype=_torch().float16, device="cpu", kvcache=None,
                        need_sort=False),
        "{cls}(size=8, dtype=torch.float16, device='cpu', kvcache=None, need_sort=False)",
        driver=Driver(reserved=(0,), source={"imports": ["import torch"],
                                             "free_count": "{a}.available_size()"}),
        note="slot 0 is the padding slot, never handed out"),
    "transformers.generation.continuous_batching.cache_allocators.cache_pool.CachePool": Target(
        _hf_pool, "{cls}(num_sectors=2, num_allocators=1)",
        driver=Driver(
            allocate=lambda a, n: a.get_free_blocks(0, n),
            free=lambda a, ids: a.free_blocks(0, ids),
            free_count=lambda a: a.count_free_blocks(0), reserved=tuple(range(8)),
            size=lambda a: (a.num_sectors + a.num_reserved_sectors) * a.blocks_per_sector[0],
            source={"allocate": "{a}.get_free_blocks(0, {n})", "free": "{a}.free_blocks(0, {ids})",
                    "free_count": "{a}.count_free_blocks(0)",
                    "setup": ["{a}.set_blocks_per_sector(0, 4)", "{a}.allocate_sector(0)",
                              "{a}.allocate_sector(0)"]}),
        note="index 0 of a pool with two sectors of 4 blocks"),
    "lmcache.v1.memory_allocators.paged_tensor_memory_allocator.PagedTensorMemoryAllocator":
        Target(
            _lmcache_pool, "{cls}(torch.zeros(8 * 128, dtype=torch.uint8), "
            "[torch.Size((2, 1, 4, 8))], [torch.float16], MemoryFormat.KV_2LTD)",
            driver=Driver(
                allocate=_lmcache_allocate, free=lambda a, objs: a.batched_free(objs),
                block=_page, release=lambda a, obj: obj.ref_count_down(),
                source={"allocate": "{a}.batched_allocate(torch.Size((2, 1, 4, 8)), "
                        "torch.float16, {n})", "free": "{a}.batched_free({ids})",
                        "block": "next(o for o in {a}.free_blocks if o.meta.address == {id})",
                        "free_count": "len({a}.free_blocks)",
                        "release": "{obj}.ref_count_down()",
                        "imports": ["import torch", "from lmcache.v1.memory_management import "
                                    "MemoryFormat"]}),
            note="8 pages; batched_allocate/batched_free"),
    "lmdeploy.pytorch.paging.block_manager.base_block_manager.LogicalAllocator": Target(
        lambda cls: cls(num_cpu_blocks=0, num_gpu_blocks=8),
        "{cls}(num_cpu_blocks=0, num_gpu_blocks=8)",
        spec=AllocatorSpec(alloc="allocate", free="free", share="add_ref_count",
                           refcounted=True, size="_num_blocks",
                           free_count="get_num_free_blocks"),
        driver=Driver(
            free=lambda a, ids: a.free(_numpy_ids(ids)),
            share=lambda a, ids: a.add_ref_count(_numpy_ids(ids), 1), typed=True,
            refcount=lambda a, b: a.get_ref_count(_numpy_ids([b]))[0],
            source={"share": "{a}.add_ref_count({ids}, 1)",
                    "refcount": "{a}.get_ref_count(numpy.asarray([{id}]))[0]",
                    "plain_ids": "numpy.asarray({ids})", "imports": ["import numpy"]}),
        note="ids as numpy arrays, as its block manager passes them; add_ref_count shares"),
}


def resolve(dotted: str) -> type:
    """The class at ``package.module.Class`` (nested classes too)."""
    module_name, _, rest = dotted.rpartition(".")
    parts = [rest]
    while module_name:
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name and module_name.startswith(exc.name) and "." in module_name:
                    module_name, _, outer = module_name.rpartition(".")
                    parts.insert(0, outer)
                    continue
                raise
        obj = module
        for part in parts:
            obj = getattr(obj, part)
        return obj
    raise ValueError(f"{dotted!r} is not a dotted name 'package.module.Class'")


def imported(dotted: str, command: str, what: str | None = None):
    """``resolve(dotted)``, or the one-line ``kvguard COMMAND`` error that names ``what``."""
    from ..cli import UsageError
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)  # the project's own modules, as ``python -m`` finds them
    try:
        return resolve(dotted)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UsageError(f"kvguard {command}: error: cannot import {what or dotted}: "
                         f"{exc}") from None


def spec_option(dotted: str | None, command: str, cls_name: str | None = None):
    """The ``--spec`` option of ``kvguard fuzz`` and ``kvguard replay``: an AllocatorSpec object
    (``pkg.mod.SPEC`` or ``pkg.mod:SPEC``), or a spec in the spec language (keywords
    ``alloc=get, free=put``, or an entry ``pkg.mod.Class(alloc=get, ...)``). Without it, the
    project's configuration (``[tool.kvguard]``, the pytest ini option) for ``cls_name``."""
    from ..cli import UsageError
    from ..projectconfig import find
    from ..specgrammar import SpecSyntaxError, parse_entries, parse_spec
    try:
        if not dotted:
            project = find() if cls_name else None
            return project.spec_for(cls_name) if project is not None else None
        if "=" in dotted and "(" not in dotted.split("=", 1)[0]:
            return parse_spec(dotted)
        if "(" in dotted:
            (_, spec), = parse_entries(dotted)
            return spec
    except (SpecSyntaxError, ValueError) as exc:
        raise UsageError(f"kvguard {command}: error: --spec: {exc}") from None
    spec = imported(dotted.replace(":", "."), command)
    if not isinstance(spec, AllocatorSpec):
        from ..cli import UsageError
        raise UsageError(f"kvguard {command}: error: {dotted} is not a kvguard.AllocatorSpec")
    return spec


def target_for(cls: type, factory: str | None = None, spec: AllocatorSpec | None = None):
    """(factory, spec, driver, make source) for ``cls``: its built-in target, overridden by an
    explicit ``factory`` expression or ``spec``."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    target = TARGETS.get(name)
    from ..specgrammar import call_source, parse_call
    called = parse_call(factory) if factory is not None else None
    if called is not None:  # pkg.mod:function or pkg.mod:function(k=v, ...): function(cls, k=v)
        ref, kw = called

        def make():
            return ref(cls, **kw)
        source = call_source(ref, kw, cls.__name__)
        driver = target.driver if target else None
    elif factory is not None:
        code = compile(factory, "--factory", "eval")

        def make():
            return eval(code, {"cls": cls, cls.__name__: cls})
        source = factory.replace("cls(", f"{cls.__name__}(")
        driver = target.driver if target else None
    elif target is not None:
        def make():
            return target.make(cls)
        source = target.make_source.format(cls=cls.__name__)
        driver = target.driver
    else:
        raise ValueError(f"no built-in factory for {name}: give --factory 'cls(...)'")
    if spec is None and target is not None:
        spec = target.spec
    return make, spec, driver, source


def fuzz_command(argv) -> int:
    """``kvguard fuzz DOTTED.NAME``, or ``kvguard fuzz --lifecycle ENGINE``."""
    if any(a == "--lifecycle" or a.startswith("--lifecycle=") for a in argv):
        from .lifecycle_cli import lifecycle_command
        return lifecycle_command(argv)
    from ..cli import UsageError
    args = _parser().parse_args(argv)
    if args.examples is not None and args.examples < 1:
        raise UsageError("kvguard fuzz: error: --examples must be at least 1")
    if args.budget is not None and not args.budget > 0:
        raise UsageError("kvguard fuzz: error: --budget must be a number of seconds above 0")
    if not args.hang > 0:
        raise UsageError("kvguard fuzz: error: --hang must be a number of seconds above 0")
    cls = imported(args.name, "fuzz")
    if not isinstance(cls, type):
        raise UsageError(f"kvguard fuzz: error: {args.name} is not a class")
    spec = spec_option(args.spec, "fuzz", f"{cls.__module__}.{cls.__qualname__}")
    try:
        make, spec, driver, source = target_for(cls, args.factory, spec)
    except SpecSyntaxError as exc:
        raise UsageError(f"kvguard fuzz: error: --factory: {exc}") from None
    except SyntaxError as exc:
        raise UsageError(f"kvguard fuzz: error: --factory: {exc.msg}") from None
    except ValueError as exc:
        raise UsageError(f"kvguard fuzz: error: {exc}") from None
    problem = misfit(cls, spec or spec_for(cls) or AllocatorSpec())
    if problem is not None:  # a spec that fits nothing: a configuration error, one line
        raise UsageError(f"kvguard fuzz: error: {problem}")
    from .contain import contained
    try:  # a factory that exits, hangs or forks is the allocator's: check_allocator reports it
        contained(make, hang=args.hang, what="its factory")
    except SyntaxError as exc:
        raise UsageError(f"kvguard fuzz: error: --factory: {exc.msg}") from None
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"kvguard fuzz: error: --factory {args.factory}: {exc}") from None
    except Exception as exc:
        raise UsageError(f"kvguard fuzz: error: cannot build a {cls.__name__}: {exc!r}") \
            from None
    from .search import DEFAULT_BUDGET, DEFAULT_EXAMPLES, MissingDependency, check_allocator
    try:
        report = check_allocator(make, spec, examples=args.examples or DEFAULT_EXAMPLES,
                                 seed=args.seed, budget=args.budget or DEFAULT_BUDGET,
                                 driver=driver, clauses=args.clause, make=source,
                                 robustness=args.robustness or None, progress=_Progress(),
                                 hang=args.hang, raise_on_broken=False)
    except KeyboardInterrupt as stop:  # the user's: the allocator's is an escape by now
        from .contain import interrupted
        return interrupted(getattr(stop, "report", None), "fuzz")
    except MissingDependency as exc:
        raise UsageError(f"kvguard fuzz: error: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"kvguard fuzz: error: {exc}") from None
    if report.seconds >= _Progress.AFTER:
        sys.stderr.write(f"kvguard fuzz: done in {report.seconds:.1f} s\n")
    if args.junit:
        try:
            with open(args.junit, "w", encoding="utf-8") as out:
                out.write(report.to_junit())
        except OSError as exc:
            raise UsageError(f"kvguard fuzz: error: --junit: {exc}") from None
    if args.format == "json":
        import json
        sys.stdout.write(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(report.render() + "\n")
    return 1 if report.findings or report.escapes else 0


class _Progress:
    """Clause by clause on stderr, once a run has taken more than a few seconds."""

    AFTER = 2.0

    def __call__(self, clause, index, total, seconds) -> None:
        if seconds >= self.AFTER:
            sys.stderr.write(f"kvguard fuzz: {seconds:.0f} s, clause {index + 1} of {total}: "
                             f"{clause}\n")
            sys.stderr.flush()


def _parser():
    from ..cli import Parser
    parser = Parser(prog="kvguard fuzz", description=(
        "Fuzz an allocator class against the allocator contract (driven unguarded, judged by "
        "kvguard's ledger) and report every bug it finds, one finding per bug, with a shrunk "
        "call sequence, the harm it does and a regression test that fails on the class as it "
        "is.\n\nBuilt-in factories (the engines' allocator classes): "
        f"{', '.join(TARGETS)}."))
    parser.add_argument("name", metavar="DOTTED.NAME", help="the allocator class, "
                        "package.module.Class")
    parser.add_argument("--factory", metavar="EXPR", help="pkg.mod:function or "
                        "pkg.mod:function(k=v, ...), called with the class and those keywords "
                        "(the spec language's values), or a Python expression that builds a "
                        "small pool, with the class bound to `cls` (e.g. 'cls(16)'); default: "
                        "the built-in factory for the engines' allocators")
    parser.add_argument("--spec", metavar="SPEC", help="how to read it: a kvguard."
                        "AllocatorSpec (pkg.mod.SPEC or pkg.mod:SPEC) or the spec language "
                        "('alloc=get, free=put'); default: the project's configuration "
                        "([tool.kvguard], ini kvguard_allocators), else the registered spec")
    parser.add_argument("--examples", type=int, default=None, metavar="N",
                        help="call sequences per clause (default 100)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="the same seed gives the same report (default 0)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="bound on the whole run, shared out among the clauses; what "
                        "finished is kept (default 30)")
    parser.add_argument("--hang", type=float, default=10.0, metavar="SECONDS",
                        help="a call sequence running longer than this is a hang, stopped "
                        "and reported (default 10)")
    parser.add_argument("--clause", action="append", choices=list(CLAUSES), default=None,
                        metavar="NAME", help="check only this clause (repeatable): "
                        f"{', '.join(CLAUSES)}")
    parser.add_argument("--robustness", action="store_true", help="also feed a typed API "
                        "values outside its declared input (bools, tensors, masks, "
                        "generators), reported apart from broken promises")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="the report as text (default) or JSON")
    parser.add_argument("--junit", metavar="FILE", help="also write the report as JUnit XML "
                        "(a test case per clause)")
    return parser
