"""Real engine code for the adapter tests, read straight out of the downloaded packages.

``.ci/run`` downloads each engine into ``KVGUARD_ENGINE_CACHE`` (``pip download --no-deps`` of an
exact version, never installed). A loader extracts just the allocator files from the wheel or
sdist and executes them under their real dotted names, so kvguard's built-in specs (registered
by dotted name) match them, with small stand-ins for the imports those files make and that
cannot load here (GPU kernels, loggers, metrics, config classes). Each stand-in is listed in the
loader that installs it. ``loaded(name)`` is a context manager: the modules it creates leave
``sys.modules`` again when it exits. Without the download the tests skip and say what to run.
"""

from __future__ import annotations

import __future__
import ast
import contextlib
import enum
import importlib.util
import logging
import os
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest

ENGINE_CACHE = Path(os.environ.get("KVGUARD_ENGINE_CACHE")
                    or "~/.cache/kvguard-engines").expanduser()

PACKAGES = {
    "deepspeed": ("deepspeed==0.19.8", "deepspeed-0.19.8.tar.gz"),
    "vllm": ("vllm==0.33.0", "vllm-0.33.0-*.whl"),
    "sglang": ("sglang==0.5.23", "sglang-0.5.23-*.whl"),
    "transformers": ("transformers==5.24.0", "transformers-5.24.0-*.whl"),
    "lmcache": ("lmcache==0.5.6", "lmcache-0.5.6-*.whl"),
    "lmdeploy": ("lmdeploy==0.18.0", "lmdeploy-0.18.0-*.whl"),
    "aphrodite": ("aphrodite-engine==0.24.1", "aphrodite_engine-0.24.1-*.whl"),
}


def archive(engine: str) -> Path:
    """The downloaded package of ``engine``, or a skip that says how to get it."""
    pin, pattern = PACKAGES[engine]
    found = sorted(ENGINE_CACHE.glob(pattern)) if ENGINE_CACHE.is_dir() else []
    if not found:
        pytest.skip(f"{pin} is not downloaded: run `pip download --no-deps {pin} -d "
                    f"{ENGINE_CACHE}` (or set KVGUARD_ENGINE_CACHE); .ci/run does this")
    return found[-1]


def source(package: Path, inner: str) -> Path:
    """``inner`` (a path inside the package) extracted once under the engine cache, so tracebacks
    and kvguard's reports can show its lines."""
    target = ENGINE_CACHE / "src" / package.name / inner
    if target.exists():
        return target
    if package.suffix == ".whl":
        with zipfile.ZipFile(package) as zf:
            data = zf.read(inner)
    else:
        with tarfile.open(package) as tf:
            top = tf.getmembers()[0].name.split("/")[0]
            member = tf.extractfile(f"{top}/{inner}")
            if member is None:
                raise FileNotFoundError(f"{inner} not in {package.name}")
            data = member.read()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, target)  # concurrent xdist workers each write whole files
    return target


class _OneModule:
    """A meta path finder that finds one module, at its extracted file."""

    def __init__(self, dotted: str, spec) -> None:
        self.dotted = dotted
        self.spec = spec

    def find_spec(self, fullname, path=None, target=None):
        return self.spec if fullname == self.dotted else None


class Modules:
    """The modules one loader put into ``sys.modules``: removed again by ``close()``, which also
    puts back every attribute it set on a module that was there before (the installed engine's
    own, when it is installed: a stand-in left on it would break the engine for later tests)."""

    _ABSENT = object()

    def __init__(self) -> None:
        self.added: list[str] = []
        self.replaced: list[tuple] = []  # (module, attribute, what it was), in order set
        self.aside: list[tuple] = []  # (name, the module sys.modules had under it)

    def _set(self, module, key, value) -> None:
        if module.__name__ not in self.added:
            self.replaced.append((module, key, vars(module).get(key, self._ABSENT)))
        setattr(module, key, value)

    def package(self, dotted: str) -> types.ModuleType:
        """``dotted`` and its parents as empty packages (unless present)."""
        parts = dotted.split(".")
        for n in range(1, len(parts) + 1):
            name = ".".join(parts[:n])
            if name not in sys.modules:
                module = types.ModuleType(name)
                module.__path__ = []
                self._add(name, module)
        return sys.modules[dotted]

    def stub(self, dotted: str, **attrs) -> types.ModuleType:
        """A stand-in module holding ``attrs``."""
        parent, _, child = dotted.rpartition(".")
        if parent:
            self.package(parent)
        module = sys.modules.get(dotted)
        if module is None:
            module = types.ModuleType(dotted)
            module.__path__ = []
            self._add(dotted, module)
        for key, value in attrs.items():
            self._set(module, key, value)
        return module

    def load(self, package: Path, inner: str, dotted: str) -> types.ModuleType:
        """Execute ``inner`` from ``package`` as module ``dotted``, imported through the import
        system as the installed engine would be, so import hooks see it (``kvguard.instrument()``
        guards the registered classes of a module imported while it is on)."""
        path = source(package, inner)
        parent = dotted.rpartition(".")[0]
        if parent:
            self.package(parent)
        if dotted in sys.modules:  # the installed engine's own: set aside while ours is loaded
            self.aside.append((dotted, sys.modules.pop(dotted)))
        if parent and parent not in self.added:  # the import binds ours on the parent too
            above, child = sys.modules[parent], dotted.rpartition(".")[2]
            self.replaced.append((above, child, vars(above).get(child, self._ABSENT)))
        finder = _OneModule(dotted, importlib.util.spec_from_file_location(dotted, path))
        sys.meta_path.append(finder)
        try:
            module = importlib.import_module(dotted)
        finally:
            sys.meta_path.remove(finder)
        self.added.append(dotted)
        return module

    def load_class(self, package: Path, inner: str, dotted: str, name: str, **namespace):
        """Execute only ``class name`` of ``inner`` (whose other imports cannot load here) in a
        module ``dotted`` prefilled with ``namespace``."""
        path = source(package, inner)
        text = path.read_text()
        node = next(n for n in ast.parse(text).body
                    if isinstance(n, ast.ClassDef) and n.name == name)
        # Keep the class at its own line numbers, so reports point into the real file.
        code = "\n" * (node.lineno - 1) + ast.get_source_segment(text, node)
        module = self.stub(dotted, __file__=str(path), **namespace)
        flags = __future__.annotations.compiler_flag  # the file's own future import
        self._exec(module, compile(code, str(path), "exec", flags=flags, dont_inherit=True))
        return getattr(module, name)

    def load_functions(self, package: Path, inner: str, dotted: str, names, **namespace):
        """Execute only the functions ``names`` of ``inner`` (whose other imports cannot load
        here) in a module ``dotted`` prefilled with ``namespace``, at their own line numbers."""
        path = source(package, inner)
        text = path.read_text()
        module = self.stub(dotted, __file__=str(path), **namespace)
        flags = __future__.annotations.compiler_flag
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and node.name in names:
                code = "\n" * (node.lineno - 1) + ast.get_source_segment(text, node)
                self._exec(module, compile(code, str(path), "exec", flags=flags,
                                           dont_inherit=True))
        return module

    def _exec(self, module, code) -> None:
        """Run ``code`` in ``module``; what it defines on a module that was there before is
        put back by ``close()``."""
        before = dict(vars(module))
        exec(code, vars(module))
        if module.__name__ not in self.added:
            self.replaced += [(module, key, before.get(key, self._ABSENT))
                              for key, value in vars(module).items()
                              if before.get(key, self._ABSENT) is not value]

    def _add(self, name, module) -> None:
        sys.modules[name] = module
        self.added.append(name)
        parent, _, child = name.rpartition(".")
        if parent and parent in sys.modules:
            self._set(sys.modules[parent], child, module)

    def close(self) -> None:
        for module, key, was in reversed(self.replaced):
            if was is self._ABSENT:
                vars(module).pop(key, None)
            else:
                setattr(module, key, was)
        self.replaced.clear()
        for name in reversed(self.added):
            sys.modules.pop(name, None)
        self.added.clear()
        for name, module in reversed(self.aside):
            sys.modules[name] = module
        self.aside.clear()


@contextlib.contextmanager
def loaded(engine: str):
    """``with loaded("vllm") as ns:`` the engine's allocator modules, as attributes of ``ns``."""
    package = archive(engine)
    modules = Modules()
    try:
        yield LOADERS[engine](package, modules)
    finally:
        modules.close()


class _Anything:
    """A stand-in object: every attribute is a no-op callable (metrics, NVTX, monitors)."""

    @classmethod
    def GetOrCreate(cls):
        return cls()

    def __getattr__(self, name):
        if name.startswith("__"):  # dunders stay absent, or ABCs take it for an abstract method
            raise AttributeError(name)
        return lambda *args, **kwargs: None


def _placeholders(modules, dotted, *names):
    """A stand-in module whose ``names`` are empty classes (used in annotations only)."""
    return modules.stub(dotted, **{n: type(n, (), {"__module__": dotted}) for n in names})


# --- DeepSpeed 0.19.8 (sdist) ---------------------------------------------------------------


class NoPinTorch(types.ModuleType):
    """``torch`` as ``BlockedAllocator`` sees it in these tests: its constructor asks for pinned
    host memory (``torch.arange(..., pin_memory=True)``), which CPU-only torch refuses, so
    ``arange`` drops that flag when no accelerator is present; the rest is torch itself."""

    def __init__(self) -> None:
        super().__init__("torch")
        import torch
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def arange(self, *args, **kwargs):
        if not self._torch.cuda.is_available():
            kwargs.pop("pin_memory", None)
        return self._torch.arange(*args, **kwargs)


def _deepspeed(package, modules):
    import torch

    root = "deepspeed.inference.v2"
    ragged = f"{root}.ragged"
    blocked = modules.load(package, "deepspeed/inference/v2/ragged/blocked_allocator.py",
                           f"{ragged}.blocked_allocator")
    blocked.torch = NoPinTorch()
    modules.load(package, "deepspeed/inference/v2/inference_utils.py", f"{root}.inference_utils")
    # kv_cache.py / ragged_manager.py imports that need the full package (comm, accelerator,
    # pydantic configs, the C++ op builder): stand-ins with the few members these files use.
    modules.stub("deepspeed.comm", get_world_size=lambda group=None: 1,
                 all_reduce=lambda *a, **k: None)
    modules.stub("deepspeed.comm.reduce_op", ReduceOp=enum.Enum("ReduceOp", "MIN MAX SUM"))
    accelerator = types.SimpleNamespace(current_device=lambda: "cpu", empty_cache=lambda: None)
    modules.stub("deepspeed.accelerator", get_accelerator=lambda: accelerator)
    logger = logging.getLogger("deepspeed.test")
    modules.stub(f"{root}.logging", inference_logger=lambda: logger)
    modules.stub("deepspeed.utils.logging", logger=logger)

    class AllocationMode(enum.Enum):
        RESERVE = "reserve"
        ALLOCATE = "allocate"

    modules.stub(f"{ragged}.manager_configs", AllocationMode=AllocationMode,
                 KVCacheConfig=object, MemoryConfig=object, DSStateManagerConfig=object)

    class RaggedUtils:
        @staticmethod
        def allocate_fast_host_buffer(like):
            return torch.zeros_like(like, device="cpu")

    modules.stub("deepspeed.ops.op_builder",
                 RaggedUtilsBuilder=lambda: types.SimpleNamespace(load=lambda: RaggedUtils))
    kv_cache = modules.load(package, "deepspeed/inference/v2/ragged/kv_cache.py",
                            f"{ragged}.kv_cache")
    descriptor = modules.load(package, "deepspeed/inference/v2/ragged/sequence_descriptor.py",
                              f"{ragged}.sequence_descriptor")
    manager = modules.load(package, "deepspeed/inference/v2/ragged/ragged_manager.py",
                           f"{ragged}.ragged_manager")
    return types.SimpleNamespace(BlockedAllocator=blocked.BlockedAllocator,
                                 BlockedKVCache=kv_cache.BlockedKVCache,
                                 DSStateManager=manager.DSStateManager,
                                 DSSequenceDescriptor=descriptor.DSSequenceDescriptor,
                                 AllocationMode=AllocationMode, blocked_allocator=blocked)


# --- vLLM 0.33.0 ----------------------------------------------------------------------------


def _vllm(package, modules):
    # kv_cache_utils.py / block_pool.py import the config system, hashing (cbor2), request and
    # event types: annotation-only placeholders, and a logger. Prefix hashing and KV events are
    # not exercised (enable_kv_cache_events stays False).
    modules.stub("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False)
    _placeholders(modules, "vllm.config", "VllmConfig")
    modules.stub("vllm.logger", init_logger=logging.getLogger)
    modules.stub("vllm.multimodal.utils", get_mm_features_in_window=lambda *a, **k: [])

    def xxhash(data):
        raise NotImplementedError("prefix hashing is not loaded in these tests")

    def xxhash_cbor(data):
        raise NotImplementedError("prefix hashing is not loaded in these tests")

    modules.stub("vllm.utils.hashing", xxhash=xxhash, xxhash_cbor=xxhash_cbor)
    modules.stub("vllm.utils.math_utils", cdiv=lambda a, b: -(a // -b))
    _placeholders(modules, "vllm.v1.kv_cache_interface", "KVCacheConfig", "KVCacheGroupSpec",
                  "KVCacheSpec", "MambaSpec", "UniformTypeKVCacheSpecs")
    modules.stub("vllm.v1.kv_cache_interface", iter_layer_specs=lambda *a, **k: iter(()))
    _placeholders(modules, "vllm.v1.kv_cache_spec_registry", "KVCacheSpecRegistry")
    _placeholders(modules, "vllm.v1.request", "Request")
    modules.stub("vllm.v1.utils", tensor_data=lambda t: t)
    _placeholders(modules, "vllm.distributed.kv_events", "AllBlocksCleared", "BlockRemoved",
                  "BlockStored", "KVCacheEvent")
    modules.stub("vllm.distributed.kv_events", MEDIUM_GPU="GPU", MEDIUM_CPU="CPU")
    _placeholders(modules, "vllm.v1.core.kv_cache_metrics", "KVCacheMetricsCollector")
    utils = modules.load(package, "vllm/v1/core/kv_cache_utils.py", "vllm.v1.core.kv_cache_utils")
    pool = modules.load(package, "vllm/v1/core/block_pool.py", "vllm.v1.core.block_pool")
    return types.SimpleNamespace(BlockPool=pool.BlockPool, KVCacheBlock=utils.KVCacheBlock,
                                 FreeKVCacheBlockQueue=utils.FreeKVCacheBlockQueue)


# --- SGLang 0.5.23 --------------------------------------------------------------------------


def _sglang(package, modules):
    import torch

    allocator = "sglang.srt.mem_cache.allocator"
    modules.package(allocator)
    base = modules.load(package, "sglang/srt/mem_cache/allocator/base.py", f"{allocator}.base")
    token = modules.load(package, "sglang/srt/mem_cache/allocator/token.py", f"{allocator}.token")
    # paged.py: the Triton kernels stay unused (the platform says no Triton, so the torch
    # fallbacks alloc_extend_naive / alloc_decode_naive of the same file run), and four helpers
    # of sglang.srt.utils as in sglang/srt/utils/common.py (get_bool_env_var without its
    # warning on unrecognized values: SGLANG_DEBUG_MEMORY_POOL=1 turns debug mode on).
    _placeholders(modules, "sglang.kernels.ops.memory.allocator", "alloc_decode_kernel",
                  "alloc_extend_kernel")
    capabilities = types.SimpleNamespace(supports_triton=False)
    modules.stub("sglang.srt.platforms",
                 current_platform=types.SimpleNamespace(capabilities=capabilities))

    def get_num_new_pages(seq_lens, page_size, prefix_lens=None, decode=False):
        if prefix_lens is None or decode:
            return (seq_lens % page_size == 1).int().sum().item()
        after = (seq_lens + page_size - 1) // page_size
        before = (prefix_lens + page_size - 1) // page_size
        return torch.sum(after - before).to(torch.int64).item()

    def get_bool_env_var(name, default="false"):
        return os.getenv(name, default).lower() in ("true", "1")

    modules.stub("sglang.srt.utils", get_bool_env_var=get_bool_env_var,
                 get_num_new_pages=get_num_new_pages, is_hip=lambda: False,
                 next_power_of_2=lambda n: 1 << (n - 1).bit_length())
    paged = modules.load(package, "sglang/srt/mem_cache/allocator/paged.py", f"{allocator}.paged")

    # memory_pool.py needs Triton and SGLang's kernels at import: only ReqToTokenPool runs,
    # with a no-op memory saver.
    class TorchMemorySaverAdapter:
        @staticmethod
        def create(enable):
            return types.SimpleNamespace(region=lambda *a, **k: contextlib.nullcontext())

    from typing import Any, Callable, List, Optional
    rows = modules.load_class(package, "sglang/srt/mem_cache/memory_pool.py",
                              "sglang.srt.mem_cache.memory_pool", "ReqToTokenPool", torch=torch,
                              Any=Any, Callable=Callable, List=List, Optional=Optional,
                              TorchMemorySaverAdapter=TorchMemorySaverAdapter,
                              GPU_MEMORY_TYPE_KV_CACHE="kv_cache")
    return types.SimpleNamespace(TokenToKVPoolAllocator=token.TokenToKVPoolAllocator,
                                 PagedTokenToKVPoolAllocator=paged.PagedTokenToKVPoolAllocator,
                                 BaseTokenToKVPoolAllocator=base.BaseTokenToKVPoolAllocator,
                                 ReqToTokenPool=rows)


# --- Hugging Face transformers 5.24.0 -------------------------------------------------------


def _transformers(package, modules):
    cb = "transformers.generation.continuous_batching"

    # cache_allocator.py / full_attention.py import two helpers of continuous_batching/utils.py
    # (whose own imports pull in the whole library) and a config class used in annotations:
    # the helpers as that file defines them.
    def exact_div(a, b):
        quotient, remainder = divmod(a, b)
        if remainder:
            raise ValueError(f"Division of {a} by {b} is not exact: {remainder = } != 0")
        return quotient

    def find_head_dim(config):
        head_dim = getattr(config, "head_dim", None)
        if head_dim is not None:
            return head_dim
        return config.hidden_size // config.num_attention_heads

    modules.stub(f"{cb}.utils", exact_div=exact_div, find_head_dim=find_head_dim)
    _placeholders(modules, "transformers.configuration_utils", "PreTrainedConfig")
    modules.package(f"{cb}.cache_allocators")
    inner = "transformers/generation/continuous_batching/cache_allocators"
    pool = modules.load(package, f"{inner}/cache_pool.py", f"{cb}.cache_allocators.cache_pool")
    alloc = modules.load(package, f"{inner}/cache_allocator.py",
                         f"{cb}.cache_allocators.cache_allocator")
    full = modules.load(package, f"{inner}/full_attention.py",
                        f"{cb}.cache_allocators.full_attention")
    return types.SimpleNamespace(CachePool=pool.CachePool, BlockLedger=alloc.BlockLedger,
                                 FullAttentionCacheAllocator=full.FullAttentionCacheAllocator)


# --- LMCache 0.5.6 --------------------------------------------------------------------------


def _lmcache(package, modules):
    import torch

    # The package import needs numba (device_ops), prometheus_client and more: stand-ins for the
    # logger (errors only), the stats and pin monitors (no-ops), NVTX (identity) and
    # get_size_bytes (as in lmcache/utils.py).
    try:
        import sortedcontainers  # noqa: F401
    except ImportError:
        modules.stub("sortedcontainers", SortedList=list)
    modules.stub("lmcache", device_ops=None, torch_dev=None, torch_device_type="cpu")
    def init_logger(name):
        # Objects a test never frees warn from __del__ at exit; the guard is what is tested.
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)
        return logger

    modules.stub("lmcache.logging", init_logger=init_logger)
    modules.stub("lmcache.observability", LMCStatsMonitor=_Anything)

    def get_size_bytes(shapes, dtypes):
        return sum(s.numel() * d.itemsize for s, d in zip(shapes, dtypes, strict=True))

    modules.stub("lmcache.utils", _lmcache_nvtx_annotate=lambda f, domain="lmcache": f,
                 get_size_bytes=get_size_bytes)
    modules.stub("lmcache.v1.pin_monitor", PinMonitor=_Anything)
    modules.stub("lmcache.v1.platform", current_device_spec=None)
    _placeholders(modules, "lmcache.v1.system_detection", "NUMAMapping")
    mm = modules.load(package, "lmcache/v1/memory_management.py", "lmcache.v1.memory_management")
    modules.package("lmcache.v1.memory_allocators")
    paged = modules.load(package,
                         "lmcache/v1/memory_allocators/paged_tensor_memory_allocator.py",
                         "lmcache.v1.memory_allocators.paged_tensor_memory_allocator")
    return types.SimpleNamespace(PagedTensorMemoryAllocator=paged.PagedTensorMemoryAllocator,
                                 TensorMemoryObj=mm.TensorMemoryObj, MemoryFormat=mm.MemoryFormat,
                                 torch=torch)


# --- lmdeploy 0.18.0 ------------------------------------------------------------------------


def _lmdeploy(package, modules):
    # base_block_manager.py imports SchedulerSequence (annotations only) from the scheduler's
    # messages, which pull in the whole engine: a placeholder. The allocators are numpy only.
    _placeholders(modules, "lmdeploy.pytorch.messages", "SchedulerSequence")
    base = modules.load(package, "lmdeploy/pytorch/paging/block_manager/base_block_manager.py",
                        "lmdeploy.pytorch.paging.block_manager.base_block_manager")
    return types.SimpleNamespace(LogicalAllocator=base.LogicalAllocator,
                                 PhysicalAllocator=base.PhysicalAllocator)


# --- aphrodite-engine 0.24.1 ----------------------------------------------------------------


class _Lenient(types.ModuleType):
    """A stand-in module whose every missing name is a placeholder class (the config and spec
    types aphrodite's kv_cache_utils.py imports by the dozen, for annotations and isinstance)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def _aphrodite(package, modules):
    # aphrodite's v1 core is vLLM's, forked: the same stand-ins as _vllm, under its own names.
    for name in ("aphrodite.config", "aphrodite.v1.kv_cache_interface",
                 "aphrodite.v1.kv_cache_spec_registry", "aphrodite.v1.request",
                 "aphrodite.distributed.kv_events", "aphrodite.v1.core.kv_cache_metrics"):
        modules.package(name.rpartition(".")[0])
        modules._add(name, _Lenient(name))
    modules.stub("aphrodite.envs", APHRODITE_KV_EVENTS_USE_INT_BLOCK_HASHES=False,
                 VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False)
    modules.stub("aphrodite", envs=sys.modules["aphrodite.envs"])
    modules.stub("aphrodite.logger", init_logger=logging.getLogger)
    modules.stub("aphrodite.utils.hashing", xxhash=None, xxhash_cbor=None)
    modules.stub("aphrodite.utils.math_utils", cdiv=lambda a, b: -(a // -b))
    modules.stub("aphrodite.utils.mem_utils", format_gib=lambda b: f"{b / (1 << 30):.2f}")
    modules.stub("aphrodite.utils.torch_utils", get_dtype_size=lambda dtype: 2)
    modules.stub("aphrodite.v1.utils", tensor_data=lambda t: t)
    modules.stub("aphrodite.distributed.kv_events", MEDIUM_GPU="GPU", MEDIUM_CPU="CPU")
    utils = modules.load(package, "aphrodite/v1/core/kv_cache_utils.py",
                         "aphrodite.v1.core.kv_cache_utils")
    pool = modules.load(package, "aphrodite/v1/core/block_pool.py",
                        "aphrodite.v1.core.block_pool")
    return types.SimpleNamespace(BlockPool=pool.BlockPool, KVCacheBlock=utils.KVCacheBlock)


LOADERS = {
    "deepspeed": _deepspeed,
    "vllm": _vllm,
    "sglang": _sglang,
    "transformers": _transformers,
    "lmcache": _lmcache,
    "lmdeploy": _lmdeploy,
    "aphrodite": _aphrodite,
}
