"""The linter's layout: modules keep to their own privates, imports go one way, rules
use only the rule contract and are registered, not discovered.

Read from the source with the stdlib ast (no import of the package), so it is fast
and sees imports inside functions too.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import pytest

import flake8_kvguard
from flake8_kvguard import rules
from flake8_kvguard.rules import HOOKS, RULES, contract

PACKAGE = Path(flake8_kvguard.__file__).parent
ROOT = "flake8_kvguard"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    """{module name: (path, ast tree, is package)} for every module of the linter."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found[_module_name(path)] = (path, ast.parse(path.read_text()), path.name == "__init__.py")
    return found


MODULES = _modules()


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str):
    """(imported module, names taken from it, node) for each import in a module,
    inside functions too; only the linter's own modules."""
    _, tree, is_package = MODULES[name]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT:
                    yield alias.name, [], node
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_package, node.level, node.module)
            if target.split(".")[0] != ROOT:
                continue
            taken = []
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, [], node
                else:
                    taken.append(alias.name)
            if taken:
                yield target, taken, node


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_privates(tree) -> set:
    """The `_` names a module defines: functions, classes, globals, attributes it sets
    on self, slots."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            own.add(node.value)  # __slots__ entries
    return {name for name in own if _private(name)}


@functools.cache
def _own_privates_of(name: str) -> set:
    return _own_privates(MODULES[name][1])


def _private_uses(name: str) -> list:
    _, tree, _ = MODULES[name]
    own = _own_privates(tree)
    elsewhere = set()
    for other, (_, other_tree, _) in MODULES.items():
        if other != name:
            elsewhere |= _own_privates_of(other)
    module_aliases = {}
    found = []
    for target, taken, node in _imports(name):
        for imported in taken:
            if _private(imported):
                found.append(f"{name}:{node.lineno} imports {target}.{imported}")
        if not taken and isinstance(node, ast.ImportFrom):
            for alias in node.names:
                module_aliases[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module_aliases[alias.asname or alias.name.split(".")[0]] = alias.name
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in module_aliases:
            found.append(f"{name}:{node.lineno} uses {module_aliases[owner.id]}.{node.attr}")
        elif isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        elif node.attr in elsewhere and node.attr not in own:
            found.append(f"{name}:{node.lineno} uses another module's .{node.attr}")
    return found


def test_no_module_touches_another_modules_private_names():
    found = [use for name in MODULES for use in _private_uses(name)]
    assert found == []


def test_the_private_name_check_sees_a_private_import(tmp_path, monkeypatch):
    """The check above is not vacuous: a module importing another's `_` name is found."""
    tree = ast.parse("from .prefilter import _EMPTY_CALL\nfrom . import prefilter\nprefilter._x\n")
    monkeypatch.setitem(MODULES, f"{ROOT}.probe", (tmp_path / "probe.py", tree, False))
    assert _private_uses(f"{ROOT}.probe") == [
        f"{ROOT}.probe:1 imports {ROOT}.prefilter._EMPTY_CALL",
        f"{ROOT}.probe:3 uses {ROOT}.prefilter._x",
    ]


# Import cycles: tests/test_import_graph.py checks every package, this one included.


VIEW_MEMBERS = {
    name
    for name, member in vars(contract.RuleView).items()
    if not name.startswith("_") and callable(member)
}


def test_the_rule_view_implements_exactly_the_contract():
    from flake8_kvguard.analysis import RuleView

    public = {name for name in RuleView.__slots__ if not name.startswith("_")}
    public |= {name for name in vars(RuleView) if not name.startswith("_")}
    assert public == VIEW_MEMBERS
    for name in VIEW_MEMBERS:
        wanted = list(inspect.signature(getattr(contract.RuleView, name)).parameters)
        if inspect.isfunction(vars(RuleView).get(name)):
            assert list(inspect.signature(getattr(RuleView, name)).parameters) == wanted


def _rule_trees():
    for rule in RULES:
        yield rule, MODULES[rule.__name__][1]


def test_rules_use_only_the_rule_view():
    """A hook's view is `ctx` (or `self.ctx` in a helper class); nothing else of the
    analysis reaches a rule."""
    used = set()
    for rule, tree in _rule_trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "ctx") or (
                isinstance(owner, ast.Attribute)
                and owner.attr == "ctx"
                and isinstance(owner.value, ast.Name)
                and owner.value.id == "self"
            ):
                used.add((rule.CODE, node.attr))
    assert {attr for _, attr in used} <= VIEW_MEMBERS, sorted(used)
    for rule, tree in _rule_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.endswith(("walk", "events", "inference", "names")), (
                    rule.CODE,
                    node.module,
                )


def test_every_check_of_a_rule_is_registered_and_only_those():
    registered = [check for checks in HOOKS for check in checks]
    assert len(registered) == len(set(registered))
    modules = {rule.__name__ for rule in RULES}
    for check in registered:
        assert check.__module__ in modules, check
    defined = {
        getattr(rule, name)
        for rule in RULES
        for name in vars(rule)
        if name.startswith("check_") and callable(getattr(rule, name))
    }
    assert defined == set(registered)


def test_the_analysis_finds_no_rule_by_name():
    for name, (path, tree, _) in MODULES.items():
        if not name.startswith(f"{ROOT}.analysis"):
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("hasattr", "getattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("check_")
            ):
                pytest.fail(f"{path.name}:{node.lineno} finds a rule's check by name")


def test_each_analysis_module_says_what_it_owns():
    for name, (path, tree, _) in MODULES.items():
        if name.startswith(f"{ROOT}.analysis"):
            doc = ast.get_docstring(tree)
            assert doc and doc.splitlines()[0].endswith("."), path.name


def test_rules_package_lists_every_rule_module():
    on_disk = {
        path.stem for path in (PACKAGE / "rules").glob("kvg*.py")
    }
    assert {rule.__name__.rpartition(".")[2] for rule in RULES} == on_disk
    assert rules.CODES == tuple(rule.CODE for rule in RULES)
