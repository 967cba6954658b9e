"""The built-in specs: one module per engine, registered by dotted name, and lazy."""

import shutil
import subprocess
import sys
import textwrap

import pytest

import kvguard
from kvguard.adapters import BUILTIN_SPECS, deepspeed, huggingface, lmcache, sglang, vllm

from . import engines

HEAVY = ("torch", "numpy", "deepspeed", "vllm", "sglang", "transformers", "lmcache")


def test_every_engine_module_contributes_its_specs():
    modules = (deepspeed, vllm, sglang, huggingface, lmcache)
    assert BUILTIN_SPECS == {k: v for m in modules for k, v in m.SPECS.items()}
    assert set(BUILTIN_SPECS) == {
        "deepspeed.inference.v2.ragged.blocked_allocator.BlockedAllocator",
        "vllm.v1.core.block_pool.BlockPool",
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator",
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator",
        "sglang.srt.mem_cache.memory_pool.ReqToTokenPool",
        "transformers.generation.continuous_batching.cache_allocators.cache_pool.CachePool",
        "lmcache.v1.memory_allocators.paged_tensor_memory_allocator.PagedTensorMemoryAllocator",
    }
    assert all(kvguard.registered()[name] is spec for name, spec in BUILTIN_SPECS.items())


def test_kvguard_and_its_builtin_specs_import_no_engine_and_no_torch():
    code = textwrap.dedent(f"""
        import sys
        import kvguard
        kvguard.registered()
        kvguard.instrument()
        import json, email.mime.text  # unrelated imports pass the post-import hook untouched
        kvguard.uninstrument()
        print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_a_run_under_the_plugin_without_engines_imports_none(tmp_path):
    (tmp_path / "test_plain.py").write_text(textwrap.dedent(f"""
        import sys

        def test_nothing_heavy_was_imported():
            assert sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}) == []
    """))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "kvguard", "-p",
                          "no:cacheprovider", str(tmp_path / "test_plain.py")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout


def test_instrument_guards_an_engine_module_imported_later(tmp_path, monkeypatch):
    """DeepSpeed's real ``blocked_allocator.py`` in a package tree on sys.path, imported after
    ``instrument()``: the post-import hook patches the class it declares."""
    package = engines.archive("deepspeed")
    inner = "deepspeed/inference/v2/ragged/blocked_allocator.py"
    target = tmp_path / inner
    target.parent.mkdir(parents=True)
    shutil.copy(engines.source(package, inner), target)
    for directory in target.relative_to(tmp_path).parents:
        if directory.parts:
            (tmp_path / directory / "__init__.py").touch()
    import torch
    arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: arange(
        *a, **{key: v for key, v in k.items() if key != "pin_memory"}))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    kvguard.instrument()
    try:
        from deepspeed.inference.v2.ragged.blocked_allocator import BlockedAllocator
        a = BlockedAllocator(4)
        assert kvguard.guard_of(a).spec is deepspeed.SPECS[deepspeed.BLOCKED_ALLOCATOR]
        a.allocate(2)
        with pytest.raises(kvguard.DuplicateIdError):
            a.free([0, 0, 1])
    finally:
        kvguard.uninstrument()
        for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
            sys.modules.pop(name)
