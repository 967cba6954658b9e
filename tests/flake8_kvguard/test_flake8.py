"""The flake8 face, through real flake8 in a subprocess."""

import inspect
import os
import shutil
import subprocess
import sys
import time

import pytest

from flake8_kvguard.plugin import KVGChecker

from .helpers import FIXTURES, run_cli, run_flake8, write_project

CALLER = """\
import torch


def flush(allocator, ids: torch.Tensor) -> None:
    allocator.free(ids)
"""


def _parse(lines):
    """flake8's default output -> {(path, line, col, code)}."""
    found = set()
    for line in lines:
        path, row, col, rest = line.split(":", 3)
        found.add((os.path.normpath(path), int(row), int(col), rest.split()[0]))
    return found


def test_plugin_is_an_ast_plugin_taking_tree():
    # flake8 decides a plugin's type from the names of its __init__ parameters.
    assert "tree" in inspect.signature(KVGChecker.__init__).parameters
    assert KVGChecker.name == "flake8-kvguard"


def test_columns_are_one_based_as_printed(tmp_path):
    write_project(tmp_path, {"mod.py": CALLER})
    status, lines = run_flake8(["--select", "KVG", "mod.py"], tmp_path)
    assert status == 1
    # `allocator.free(ids)`: ids starts at character 20 of line 5 (1-based).
    assert lines == [
        "mod.py:5:20: KVG101 free() gets a torch.Tensor as block ids: its elements are 0-dim "
        "tensors that hash by identity, so duplicate and already-free ids go unnoticed; "
        "pass ids.tolist()"
    ]


def test_noqa(tmp_path):
    source = CALLER.replace("allocator.free(ids)\n", "allocator.free(ids)  # noqa: KVG101\n")
    source += (
        "    allocator.free(ids)  # noqa: KVG102\n"
        "    allocator.free(ids)  # noqa\n"
        "    allocator.free(ids)  # noqa:KVG1\n"
    )
    write_project(tmp_path, {"mod.py": source})
    status, lines = run_flake8(["--select", "KVG101", "mod.py"], tmp_path)
    assert [line.split(": ")[0] for line in lines] == ["mod.py:6:20"]


@pytest.mark.parametrize("config_file", ["setup.cfg", "tox.ini", ".flake8"])
def test_options_from_flake8_config(tmp_path, config_file):
    source = """\
        import torch


        def release(pool, t: torch.Tensor, table) -> None:
            pool.drop_blocks(t)
            pool.free(table.block_ids())
            pool.token_pool.free(t)
    """
    config = (
        "[flake8]\n"
        "kvguard-free-names = drop_blocks\n"
        "kvguard-tensor-functions = block_ids\n"
        "kvguard-tensor-native = token_pool.free\n"
    )
    write_project(tmp_path, {config_file: config, "mod.py": source})
    status, lines = run_flake8(["--select", "KVG", "mod.py"], tmp_path)
    assert [line.split(": ")[1].split()[0] + "@" + line.split(":")[1] for line in lines] == [
        "KVG101@5",  # drop_blocks is free-like
        "KVG101@6",  # block_ids() returns a tensor
    ]
    # Without the configuration, none of the three is known.
    (tmp_path / config_file).unlink()
    write_project(tmp_path, {"setup.cfg": "[metadata]\n"})
    status, lines = run_flake8(["--select", "KVG", "mod.py"], tmp_path)
    assert (status, lines) == (1, [lines[0]]) and ":7:" in lines[0]


def test_project_index_across_files_and_its_cache(tmp_path):
    descriptor = """\
        import torch


        class Sequence:
            def all_block_ids(self, cache_group: int = 0) -> torch.Tensor:
                return self._ids[cache_group]
    """
    manager = """\
        def flush_sequence(kv_cache, seq) -> None:
            kv_cache.free(seq.all_block_ids(cache_group=0), cache_group=0)
    """
    write_project(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/descriptor.py": descriptor, "pkg/manager.py": manager},
    )
    status, lines = run_flake8(["--select", "KVG", "pkg/manager.py"], tmp_path)
    assert status == 1 and lines[0].startswith("pkg/manager.py:2:19: KVG101")
    assert (tmp_path / ".kvguard_cache" / "lint-index.json").is_file()
    assert (tmp_path / ".kvguard_cache" / ".gitignore").read_text().strip().endswith("*")
    # The cache is keyed by mtime: a changed annotation is seen by the next run.
    time.sleep(0.01)
    path = tmp_path / "pkg/descriptor.py"
    path.write_text(inspect.cleandoc(descriptor).replace("-> torch.Tensor", "-> list[int]") + "\n")
    status, lines = run_flake8(["--select", "KVG", "pkg/manager.py"], tmp_path)
    assert (status, lines) == (0, [])


def test_flake8_and_kvguard_lint_report_the_same(tmp_path):
    for path in FIXTURES.glob("*/checker/*.py"):
        target = tmp_path / "src" / path.parent.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target)
    write_project(tmp_path, {})
    _, flake8_lines = run_flake8(["--select", "KVG", "src"], tmp_path)
    _, parallel_lines = run_flake8(["--select", "KVG", "-j2", "src"], tmp_path)
    status, out, err = run_cli(["src"], tmp_path)
    assert status == 1 and err == ""
    assert len(flake8_lines) > 60
    assert sorted(flake8_lines) == sorted(out.splitlines())
    assert sorted(parallel_lines) == sorted(flake8_lines)


def test_syntax_errors_are_flake8s_business(tmp_path):
    write_project(tmp_path, {"bad.py": "def free(self, x:\n    pass\n", "ok.py": CALLER})
    status, lines = run_flake8(["--select", "KVG,E999", "bad.py", "ok.py"], tmp_path)
    assert [line.split(": ")[1][:6] for line in lines] == ["E999 S", "KVG101"]


def test_stdin(tmp_path):
    write_project(tmp_path, {})
    done = subprocess.run(
        [sys.executable, "-m", "flake8", "--select", "KVG", "-"],
        input=CALLER,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.startswith("stdin:5:20: KVG101"), (done.stdout, done.stderr)


def test_plain_flake8_runs_the_plugin_without_select(tmp_path):
    write_project(tmp_path, {"mod.py": CALLER})
    status, lines = run_flake8(["mod.py"], tmp_path)
    assert any(": KVG101 " in line for line in lines)
