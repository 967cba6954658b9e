"""kvguard/ by face: the core, and one subpackage per face that sits on it (staging,
conformance, cache). A face imports the core, never another face: where two faces meet
(``kvguard replay --emit-test``), the core hands one's result to the other
(``kvguard.cli.hand_off``). Each face imports alone, in an interpreter of its own."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_import_graph import REPO, import_graph, module_files, write_package

FACES = ("kvguard.staging", "kvguard.conformance", "kvguard.cache")
PUBLIC_ENTRY = {"kvguard.testing": "kvguard.conformance", "kvguard.ray": "kvguard.staging"}
"""Modules outside a face's package that belong to it: ``kvguard.testing`` is the
conformance face's public name, ``kvguard.ray`` staging's on a Ray cluster."""


def face_of(module: str, faces=FACES, entries=None) -> str | None:
    entries = PUBLIC_ENTRY if entries is None else entries
    if module in entries:
        return entries[module]
    return next((f for f in faces if module == f or module.startswith(f + ".")), None)


def cross_face_imports(root: Path, package: str, faces=FACES, entries=None) -> list[str]:
    """``"a imports b (line)"`` for each import from one face's module into another face."""
    found = []
    for module, targets in sorted(import_graph(root, package).items()):
        here = face_of(module, faces, entries)
        if here is None:
            continue
        for target, line in sorted(targets.items()):
            there = face_of(target, faces, entries)
            if there is not None and there != here:
                found.append(f"{module} imports {target} (line {line})")
    return found


def module_level_imports(path: Path) -> list[tuple[str, int]]:
    """The modules a file imports when it is imported (not inside a function or class)."""
    out = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(("." * node.level + (node.module or ""), node.lineno))
    return out


def test_no_face_imports_another_face():
    assert cross_face_imports(REPO, "kvguard") == []


def test_the_faces_and_the_core_are_where_the_layout_says():
    modules = module_files(REPO, "kvguard")
    for face in FACES:
        assert len([m for m in modules if face_of(m) == face]) >= 3, face
    for core in ("kvguard.guard", "kvguard.ledger", "kvguard.ids", "kvguard.spec",
                 "kvguard.registry", "kvguard.violation", "kvguard.errors", "kvguard.stacks",
                 "kvguard.owners", "kvguard.cli"):
        assert core in modules and face_of(core) is None, core


def test_the_core_imports_a_face_only_when_a_function_runs():
    """``import kvguard`` loads no face: the core reaches one (``Guard.check_tables``, the
    lazy ``kvguard.guard_cache``) only from inside a function."""
    graph = import_graph(REPO, "kvguard")
    found = []
    for module, path in module_files(REPO, "kvguard").items():
        if face_of(module) is not None:
            continue
        top = {line for _, line in module_level_imports(path)}
        found += [f"{module} imports {target} at line {line}"
                  for target, line in graph[module].items() if face_of(target) and line in top]
    assert found == []


@pytest.mark.parametrize("face", FACES)
def test_each_face_imports_alone_in_a_fresh_interpreter(face):
    """Every module of the face imported in an interpreter of its own: none of another face is
    loaded, and neither torch nor numpy nor the pytest and flake8 faces."""
    names = sorted(m for m in module_files(REPO, "kvguard") if face_of(m) == face)
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert set(names) <= set(loaded)
    others = [m for m in loaded if face_of(m) not in (None, face)]
    assert others == []
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "numpy", "pytest", "_pytest",
                                                       "flake8", "libcst", "hypothesis",
                                                       "pytest_kvguard", "flake8_kvguard", "ray")]
    assert heavy == []


def test_a_face_reaching_into_another_face_is_found(tmp_path):
    """The check itself: a lazy import from one face into another is caught, an import of the
    core or of the face's own modules is not."""
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/core.py": "def hand_off():\n    from pkg.b import go\n    return go()\n",
        "pkg/testing.py": "from .a.one import x\n",
        "pkg/a/__init__.py": "",
        "pkg/a/one.py": "from ..core import hand_off\nfrom . import two\nx = 1\n",
        "pkg/a/two.py": "def later():\n    from ..b.go import run\n    return run()\n",
        "pkg/b/__init__.py": "",
        "pkg/b/go.py": "from pkg.testing import x\n\ndef run():\n    return x\n",
    })
    found = cross_face_imports(tmp_path, "pkg", faces=("pkg.a", "pkg.b"),
                               entries={"pkg.testing": "pkg.a"})
    assert found == ["pkg.a.two imports pkg.b (line 2)", "pkg.a.two imports pkg.b.go (line 2)",
                     "pkg.b.go imports pkg.testing (line 1)"]


MAX_LINES = 400
"""A module past this usually holds two ideas: split it along its own seams."""


def long_modules(root: Path, package: str, limit: int = MAX_LINES) -> list[str]:
    """``"path: N lines"`` for each Python module of ``package`` over ``limit`` lines (the C
    extension is not a Python module and is not counted)."""
    return [f"{path.relative_to(root)}: {n} lines"
            for path in sorted((root / package).rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > limit]


def test_no_module_of_kvguard_is_over_400_lines():
    assert len(list((REPO / "kvguard").rglob("*.py"))) > 40
    assert long_modules(REPO, "kvguard") == []


def test_long_modules_counts_lines_of_python_modules_only(tmp_path):
    write_package(tmp_path, {"pkg/__init__.py": "", "pkg/short.py": "x = 1\n" * 400,
                             "pkg/sub/long.py": "x = 1\n" * 401, "pkg/_speed.c": "int x;\n" * 900})
    assert long_modules(tmp_path, "pkg") == ["pkg/sub/long.py: 401 lines"]


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's layout tables name each module of kvguard (the fuzzer's too) and
    each package, so a newcomer finds any file there."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for module, path in module_files(REPO, "kvguard").items():
        if path.name == "__init__.py" and module != "kvguard":
            name = f"`{path.parent.relative_to(REPO)}/`"
        else:
            name = f"`{path.stem}`"
        if name not in text:
            missing.append(name)
    assert "`_fastpath.c`" in text
    assert missing == []
