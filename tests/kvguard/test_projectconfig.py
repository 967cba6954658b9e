"""The project's configuration read by the command line: ``kvguard fuzz`` takes a spec from
``[tool.kvguard]`` (or the pytest ini option) when ``--spec`` is not given, and ``--spec`` in the
spec language; ``kvguard run`` passes the project's entries to its processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvguard.cli import main
from kvguard.projectconfig import find

POOL = """
    class Pool:
        def __init__(self, n):
            self.n, self.free_ids = n, list(range(n))

        def get_blocks(self, k):
            out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
            return out

        def put_blocks(self, ids):
            self.free_ids.extend(ids)
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    (tmp_path / "kvg_proj_pool.py").write_text(textwrap.dedent(POOL))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def write_pyproject(folder, text):
    (folder / "pyproject.toml").write_text(textwrap.dedent(text))


def test_fuzz_reads_the_spec_from_tool_kvguard(project, capsys):
    assert main(["fuzz", "kvg_proj_pool.Pool", "--factory", "cls(4)"]) == 2
    assert "has no method 'allocate'" in capsys.readouterr().err, "no spec: it fits nothing"
    write_pyproject(project, """
        [tool.kvguard]
        allocators = ["kvg_proj_pool.Pool(alloc=get_blocks, free=put_blocks, size=n)"]
    """)
    code = main(["fuzz", "kvg_proj_pool.Pool", "--factory", "cls(4)", "--examples", "5",
                 "--budget", "600", "--clause", "duplicate-id"])
    out = capsys.readouterr().out
    assert code == 1 and "breaks a promise it makes:\n  duplicate-id" in out


@pytest.mark.parametrize("spec", ["alloc=get_blocks, free=put_blocks, size=n",
                                  "kvg_proj_pool.Pool(alloc=get_blocks, free=put_blocks, size=n)"])
def test_fuzz_takes_the_spec_language_on_the_command_line(project, capsys, spec):
    code = main(["fuzz", "kvg_proj_pool.Pool", "--factory", "cls(4)", "--spec", spec,
                 "--examples", "5", "--budget", "600", "--clause", "duplicate-id"])
    assert code == 1 and "duplicate-id" in capsys.readouterr().out


def test_a_mistake_in_the_project_file_is_one_line(project, capsys):
    write_pyproject(project, """
        [tool.kvguard]
        allocators = ["kvg_proj_pool.Pool(sized=4)"]
    """)
    assert main(["fuzz", "kvg_proj_pool.Pool", "--factory", "cls(4)"]) == 2
    err = capsys.readouterr().err
    assert "unknown keyword 'sized'" in err and err.count("\n") == 1


def test_the_nearest_file_that_declares_allocators_wins(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nkvguard_allocators =\n    a.b:C alloc=x\n")
    inner = tmp_path / "sub" / "deeper"
    inner.mkdir(parents=True)
    (tmp_path / "sub" / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    found = find(str(inner))
    assert found.path == str(tmp_path / "pytest.ini")
    assert found.entries()[0][0] == "a.b.C"


def test_run_passes_the_projects_entries_to_its_processes(project):
    write_pyproject(project, """
        [tool.kvguard.allocators."kvg_proj_pool.Pool"]
        alloc = "get_blocks"
        free = "put_blocks"
    """)
    code = "import os; print(os.environ['KVGUARD_REGISTER'])"
    out = subprocess.run([sys.executable, "-m", "kvguard", "run", "--log", str(project / "logs"),
                          "--", sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(project), env={**os.environ, "KVGUARD_REGISTER": ""})
    assert out.returncode == 0, out.stderr
    assert "kvg_proj_pool.Pool(alloc=get_blocks, free=put_blocks)" in out.stdout
