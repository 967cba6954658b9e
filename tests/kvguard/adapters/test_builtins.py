"""The built-in specs: one module per engine, registered by dotted name, and lazy."""

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

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


DOC_TABLES = {
    "DeepSpeed 0.19.8 `BlockedAllocator`": ("deepspeed", "BlockedAllocator"),
    "vLLM 0.33.0 `BlockPool`": ("vllm", "BlockPool"),
    "SGLang 0.5.23 `TokenToKVPoolAllocator` (page size 1)": ("sglang", "TokenToKVPoolAllocator"),
    "SGLang 0.5.23 `PagedTokenToKVPoolAllocator`": ("sglang", "PagedTokenToKVPoolAllocator"),
    "SGLang 0.5.23 `ReqToTokenPool`": ("sglang", "ReqToTokenPool"),
    "Hugging Face transformers 5.24.0 `CachePool`": ("transformers", "CachePool"),
    "LMCache 0.5.6 `PagedTensorMemoryAllocator`": ("lmcache", "PagedTensorMemoryAllocator"),
}


def method_table(title):
    """``{method name: guarded column}`` of one per-engine table in docs/engines.md."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "engines.md").read_text()
    section = text.split(f"### {title}\n", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("method", "---"):
            continue
        for name in re.findall(r"`([\w.]+)", cells[0]):
            if "." not in name:  # TensorMemoryObj.ref_count_down: another class's method
                rows[name] = cells[1]
        rows.update({f"{n}s": cells[1] for n in re.findall(r"`(\w+)\(s\)", cells[0])})
    return rows


def an_instance(engine, ns, name):
    import torch

    cls = getattr(ns, name)
    if engine == "deepspeed":
        return cls(8)
    if engine == "vllm":
        return cls(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    if name == "ReqToTokenPool":
        return cls(size=4, max_context_len=8, device="cpu", enable_memory_saver=False)
    if engine == "sglang":
        extra = {"page_size": 4} if name.startswith("Paged") else {}
        return cls(size=32, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False,
                   **extra)
    if engine == "transformers":
        return cls(num_sectors=4, num_allocators=2)
    shape = torch.Size([2, 1, 4, 8])  # one page: 128 bytes
    return cls(torch.zeros(4 * 128, dtype=torch.uint8), [shape], [torch.float16],
               ns.MemoryFormat.KV_2LTD)


@pytest.mark.parametrize("title", list(DOC_TABLES))
def test_the_engines_doc_tables_name_real_methods_and_every_guarded_one(title):
    """docs/engines.md's per-engine tables cannot drift from the engines' code: each method they
    name exists on the real class, and each method a guard shadows is listed as guarded."""
    engine, name = DOC_TABLES[title]
    rows = method_table(title)
    with engines.loaded(engine) as ns:
        allocator = an_instance(engine, ns, name)
        g = kvguard.guard(allocator)
        missing = [m for m in rows if not hasattr(allocator, m)]
        assert missing == [], f"{title} lists methods the class does not have"
        shadowed = sorted(m for m, v in vars(allocator).items()
                          if getattr(v, "__kvguard__", None) is g)
        assert shadowed and all(rows.get(m) == "yes" for m in shadowed), (shadowed, rows)
        g.unguard()
