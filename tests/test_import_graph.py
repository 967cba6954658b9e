"""The packages import in one direction: no module imports, directly or through others, a
module that imports it back. The graph is read from the source with ``ast``, imports inside
functions included, since a function-level import only hides a cycle until the call."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The dotted module a ``from ... import`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth, except under ``if TYPE_CHECKING:`` (never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """``{module: {imported module of the same package: line of the import}}``.

    ``from pkg import name`` depends on ``pkg.name`` when that is a module, else on ``pkg``.
    Importing ``a.b.c`` from outside ``a.b`` runs ``a.b`` first: that package is a dependency
    too. A module's own enclosing packages are left out: Python always starts running them
    first, so reading a name off one (``from . import __version__``) cannot close a cycle."""
    modules = module_files(root, package)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        ancestors = {".".join(name.split(".")[:n]) for n in range(1, name.count(".") + 1)}
        if is_package:
            ancestors.discard(name)
        targets = []
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [(alias.name, node.lineno) for alias in node.names]
                continue
            base = _base(name, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append((sub if sub in modules else base, node.lineno))
        for target, line in targets:
            while target and target not in modules:  # import a.b.c -> the module a.b.c, or a.b
                target = target.rpartition(".")[0]
            if target and target != name and target not in ancestors:
                graph[name].setdefault(target, line)
                parts = target.split(".")
                for end in range(2, len(parts)):  # the packages that import runs on the way
                    above = ".".join(parts[:end])
                    if above in modules and above not in ancestors and above != name:
                        graph[name].setdefault(above, line)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None: a depth-first search for a back edge."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def describe(graph, cycle: list[str], root: Path) -> str:
    steps = []
    for here, there in zip(cycle, cycle[1:]):
        path = module_files(root, here.split(".")[0])[here].relative_to(root)
        steps.append(f"  {here} imports {there} ({path}:{graph[here][there]})")
    return "import cycle: " + " -> ".join(cycle) + "\n" + "\n".join(steps)


@pytest.mark.parametrize("package", ["kvguard", "pytest_kvguard", "flake8_kvguard"])
def test_no_import_cycles(package):
    graph = import_graph(REPO, package)
    assert len(graph) > 5  # the package was found and read
    cycle = find_cycle(graph)
    assert cycle is None, describe(graph, cycle, REPO)


def test_pytest_kvguard_imports_run_from_the_plugin_down():
    graph = import_graph(REPO, "pytest_kvguard")
    assert "pytest_kvguard.manager" in graph["pytest_kvguard.plugin"]
    assert "pytest_kvguard.fixture" in graph["pytest_kvguard.manager"]
    assert "pytest_kvguard.state" in graph["pytest_kvguard.fixture"]
    for module in ("fixture", "state", "results", "tracking", "leaks", "expect", "frames"):
        imported = graph[f"pytest_kvguard.{module}"]
        assert not {"pytest_kvguard.manager", "pytest_kvguard.plugin"} & set(imported), module


ALLOWED_PRIVATE = {
    ("expect.py", "sys._getframe"),
}


def private_uses(path: Path) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self``/``cls``, and ``from x import _name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom):
            found += [f"from {'.' * node.level}{node.module or ''} import {alias.name}"
                      for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def test_pytest_kvguard_modules_keep_out_of_each_others_privates():
    found = [f"{path.name}: {use}"
             for path in sorted((REPO / "pytest_kvguard").glob("*.py"))
             for use in private_uses(path) if (path.name, use) not in ALLOWED_PRIVATE]
    assert found == []


def test_private_uses_sees_another_objects_private(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from .manager import _phase\n\nclass F:\n"
                    "    def mode(self):\n        return self._manager._options, self._ok\n")
    assert private_uses(path) == ["from .manager import _phase", "self._manager._options"]


def write_package(root: Path, files: dict) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from .a import run\n",
        "pkg/a.py": "from . import b\n\ndef run():\n    return b.go()\n",
        "pkg/b.py": "def go():\n    from .sub.c import three\n    return three()\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from pkg import a\n\ndef three():\n    return 3\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c": 2, "pkg.sub": 2}  # the import runs pkg.sub too
    cycle = find_cycle(graph)
    assert cycle == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    text = describe(graph, cycle, tmp_path)
    assert "pkg.b imports pkg.sub.c (pkg/b.py:2)" in text
    assert "pkg.sub.c imports pkg.a (pkg/sub/c.py:1)" in text


def test_one_way_imports_and_type_checking_imports_are_no_cycle(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "from .a import run\n__version__ = '1'\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nfrom .b import go\n"
                    "if TYPE_CHECKING:\n    from . import c\n",
        "pkg/b.py": "def go():\n    from . import __version__\n    return __version__\n",
        "pkg/c.py": "import pkg.a\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b": 2}
    assert graph["pkg.c"] == {"pkg.a": 1}
    assert find_cycle(graph) is None


def test_importing_a_submodule_depends_on_the_packages_it_runs(tmp_path):
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/user.py": "from .sub.leaf import x\n",
        "pkg/sub/__init__.py": "from .. import user\n",
        "pkg/sub/leaf.py": "x = 1\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.user"] == {"pkg.sub.leaf": 1, "pkg.sub": 1}
    assert graph["pkg.sub.leaf"] == {}
    assert find_cycle(graph) == ["pkg.sub", "pkg.user", "pkg.sub"]
