"""The project index: textual scan, merging, and the on-disk cache keyed by mtimes."""

import json
import os
import subprocess
import sys

from flake8_kvguard import index, project

from .helpers import lint, write_project


def test_scan_source_reads_signatures_without_parsing():
    source = """
import torch
from torch import Tensor

def all_block_ids(self, cache_group: int = 0) -> torch.Tensor:
    return x

async def fetch(
    a,
    b=")",  # a ( in a default and a comment )
) -> "torch.LongTensor":
    pass

def maybe() -> Optional[torch.Tensor]: ...
def union() -> Tensor | None: ...
def mask() -> torch.BoolTensor: ...
def typed() -> Int[Tensor, "n"]: ...
def generic[T](x: T) -> Tensor: ...
def other() -> list[int]: ...
def unannotated(): ...

class Allocator:
    def free(self, free_index: torch.Tensor):
        pass
    def release(self, request: "Request", ids: Tensor):
        pass
def free_pages(pages: "torch.Tensor"): ...
"""
    entry = index.scan_source(source)
    assert entry["r"] == {
        "all_block_ids": "t",
        "fetch": "t",
        "maybe": "o",
        "union": "o",
        "mask": "b",
        "typed": "t",
        "generic": "t",
        "other": "n",
    }
    assert entry["p"] == ["free", "free_pages"]


def test_a_name_annotated_two_ways_is_not_known():
    merged = index.ProjectIndex(
        [
            {"r": {"ids": "t", "rows": "t", "mask": "b"}, "p": ["free"]},
            {"r": {"ids": "n", "rows": "o"}, "p": []},
        ]
    )
    assert merged.returns_tensor("ids") is None
    assert merged.returns_tensor("rows") == "o"
    assert merged.returns_tensor("mask") == "b"
    assert merged.takes_tensors("free") and not merged.takes_tensors("release")


def test_build_reuses_unchanged_files_and_rescans_changed_ones(tmp_path, monkeypatch):
    write_project(
        tmp_path,
        {
            "a.py": "import torch\ndef ids() -> torch.Tensor: ...\n",
            "b.py": "def rows() -> list: ...\n",
            "build/skipped.py": "def hidden() -> torch.Tensor: ...\n",
            ".venv/skipped.py": "def hidden() -> torch.Tensor: ...\n",
        },
    )
    scanned = []
    real_scan = index.scan_source
    monkeypatch.setattr(index, "scan_source", lambda text: scanned.append(text) or real_scan(text))
    first = index.build(str(tmp_path))
    assert first.returns_tensor("ids") == "t" and first.returns_tensor("hidden") is None
    assert len(scanned) == 2
    cache = tmp_path / ".kvguard_cache" / "lint-index.json"
    assert set(json.loads(cache.read_text())["files"]) == {"a.py", "b.py"}

    scanned.clear()
    assert index.build(str(tmp_path)).returns_tensor("ids") == "t"
    assert scanned == []  # everything came from the cache

    path = tmp_path / "a.py"
    path.write_text("def ids() -> list[int]: ...\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert index.build(str(tmp_path)).returns_tensor("ids") is None
    assert len(scanned) == 1


def test_a_corrupt_cache_is_rebuilt(tmp_path):
    write_project(tmp_path, {"a.py": "import torch\ndef ids() -> torch.Tensor: ...\n"})
    index.build(str(tmp_path))
    cache = tmp_path / ".kvguard_cache" / "lint-index.json"
    for garbage in (
        "{not json",
        json.dumps({"version": index.FORMAT_VERSION, "files": {"a.py": 3}}),
    ):
        cache.write_text(garbage)
        assert index.build(str(tmp_path)).returns_tensor("ids") == "t"


def test_cache_directory_override(tmp_path, monkeypatch):
    root = write_project(
        tmp_path / "proj", {"a.py": "import torch\ndef ids() -> torch.Tensor: ...\n"}
    )
    monkeypatch.setenv("KVGUARD_LINT_CACHE_DIR", str(tmp_path / "cache"))
    assert index.build(str(root)).returns_tensor("ids") == "t"
    assert not (root / ".kvguard_cache").exists()
    written = sorted(path.name for path in (tmp_path / "cache").glob("*.json"))
    assert len(written) == 2 and written[0].split("-", 1)[0] == written[1].split("-", 1)[0]
    assert sorted(name.split("-", 1)[1] for name in written) == sorted(
        [index.CACHE_FILE, index.MERGED_FILE]
    )


def test_find_root(tmp_path):
    write_project(
        tmp_path / "proj", {"pkg/__init__.py": "", "pkg/sub/__init__.py": "", "pkg/sub/mod.py": ""}
    )
    assert project.find_root(str(tmp_path / "proj/pkg/sub/mod.py")) == str(tmp_path / "proj")
    wheel = tmp_path / "site" / "vllm"
    (wheel / "core").mkdir(parents=True)
    (wheel / "__init__.py").write_text("")
    (wheel / "core" / "__init__.py").write_text("")
    (wheel / "core" / "pool.py").write_text("")
    found = project.find_root(str(wheel / "core" / "pool.py"))
    # No marker above an unpacked wheel: the outermost package is the project.
    assert found == str(wheel) or not found.startswith(str(tmp_path))


def test_an_unchanged_project_is_read_from_the_merged_cache(tmp_path, monkeypatch):
    """A second run in an unchanged project reads the merged index (no per-file
    entries, no merging); any change (edit, new file, removed file) falls back to the
    per-file cache and rescans only what changed."""
    write_project(
        tmp_path,
        {
            "a.py": "import torch\nclass Pool:\n    def free(self, ids: torch.Tensor): ...\n",
            "b.py": "import torch\ndef ids() -> torch.Tensor: ...\n",
        },
    )
    first = index.build(str(tmp_path))
    assert (tmp_path / ".kvguard_cache" / index.MERGED_FILE).is_file()
    read = []
    real_read = index._read_cache
    monkeypatch.setattr(index, "_read_cache", lambda path: read.append(path) or real_read(path))
    scanned = []
    real_scan = index.scan_source
    monkeypatch.setattr(index, "scan_source", lambda text: scanned.append(text) or real_scan(text))
    second = index.build(str(tmp_path))
    assert read == [] and scanned == []
    assert second.tables() == first.tables()
    assert second.returns_tensor("ids") == "t" and second.method_takes("Pool", "free") == "t"

    # The file being checked, unchanged, is not scanned again: its entry is found by
    # the digest of its text.
    local = index.LocalIndex(second, (tmp_path / "b.py").read_text())
    assert scanned == [] and read == [] and local.returns_tensor("ids") == "t"
    assert index.LocalIndex(second, (tmp_path / "a.py").read_text()).method_takes("Pool", "free")
    assert scanned == []
    index.LocalIndex(second, "def other() -> int: ...\n")
    assert len(scanned) == 1 and read == []

    (tmp_path / "c.py").write_text("import torch\ndef rows() -> torch.Tensor: ...\n")
    third = index.build(str(tmp_path))
    assert third.returns_tensor("rows") == "t" and len(scanned) == 2
    (tmp_path / "c.py").unlink()
    assert index.build(str(tmp_path)).returns_tensor("rows") is None
    assert len(scanned) == 2  # a removed file: the rest comes from the per-file cache


RECEIVER_PROJECT = {
    # Two allocators, each in its own file: one `free` takes tensors, the other lists.
    "pools/tensor_pool.py": """
        import torch

        class TensorPool:
            def free(self, ids: torch.Tensor): ...
        """,
    "pools/base.py": """
        class ListPoolBase:
            def free(self, ids: list[int]): ...
        """,
    "pools/list_pool.py": """
        from pools.base import ListPoolBase

        class ListPool(ListPoolBase):
            pass

        def make_pool() -> ListPool: ...
        """,
    "serve.py": """
        import torch
        from pools.list_pool import ListPool, make_pool
        from pools.tensor_pool import TensorPool

        def flush(pool: ListPool, other: TensorPool, ids: torch.Tensor):
            pool.free(ids)
            other.free(ids)
            make_pool().free(ids)
        """,
}


def test_a_receiver_class_from_another_file_is_resolved_from_the_merged_cache(tmp_path):
    """The merged cache is read in parts: a method's classes and a file's scan only
    when asked for. A receiver annotated with a class whose `free` (inherited from a
    base in a third file) takes lists still gets KVG101, and one whose class takes
    tensors does not, exactly as with the index just built."""
    root = write_project(tmp_path, RECEIVER_PROJECT)
    source = (root / "serve.py").read_text()
    expected = ["7:15 KVG101", "9:22 KVG101"]
    built = index.build(str(root))
    assert type(built) is index.ProjectIndex
    assert lint(source, project_index=built) == expected
    cached = index.build(str(root))
    assert type(cached) is index.CachedIndex
    assert lint(source, project_index=cached) == expected
    assert cached.method_takes("ListPool", "free") == "n"
    assert cached.method_takes("TensorPool", "free") == "t"
    assert cached.factory_class("make_pool") == "ListPool"
    # Only the method names the checker asked about were read from the cache.
    assert set(cached._methods) == {"free"}
    assert cached.tables() == built.tables()


def test_a_run_in_an_unchanged_project_loads_no_scanner_and_no_openssl(tmp_path):
    """The textual scanner (indexscan.py), hashlib (OpenSSL's bindings), dataclasses and
    difflib are not imported by a flake8 run whose index comes from the merged cache;
    the findings are those of a run that built it."""
    root = write_project(tmp_path, RECEIVER_PROJECT)
    script = (
        "import sys\n"
        "from flake8.main.cli import main\n"
        "try:\n"
        "    main(['--select', 'KVG', 'serve.py'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('flake8_kvguard.indexscan', 'hashlib', 'dataclasses', 'difflib', 'libcst')\n"
        "print('loaded:', *[name for name in heavy if name in sys.modules])\n"
    )
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=root, capture_output=True, text=True
        )
        assert "Traceback" not in done.stderr, done.stderr
        runs.append(done.stdout.splitlines())
    first, second = runs
    assert first[:-1] == second[:-1] and len(first) == 3, runs
    assert [line.split()[1] for line in first[:-1]] == ["KVG101", "KVG101"]
    assert "flake8_kvguard.indexscan" in first[-1].split()  # the first run built the index
    assert second[-1] == "loaded:"
