"""The guard package is reached only through its public protocol.

Outside ``kvguard/guard/``, no module of the runtime or of the pytest plugin touches a
``_``-prefixed member of a guard or of its ledger, or imports a ``_``-prefixed name from the
guard package: adapters and checks use the hooks ``Guard`` offers by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvguard
from kvguard import kinds
from kvguard.examples import LINKED_FREE_LIST_SPEC, REFCOUNTED_POOL_SPEC, RefcountedPool
from kvguard.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
GUARD_PACKAGE = ROOT / "kvguard" / "guard"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_members() -> set:
    """Every ``_``-prefixed name a guard or a ledger has, on the class or the instance."""
    pool = RefcountedPool(8)
    g = kvguard.guard(pool, REFCOUNTED_POOL_SPEC, stacks="off")
    try:
        names = set(dir(g)) | set(vars(g)) | set(dir(Ledger)) | set(vars(g.ledger()))
    finally:
        g.unguard()
    return {n for n in names if _private(n)}


def outside_modules() -> list:
    files = [f for package in ("kvguard", "pytest_kvguard")
             for f in sorted((ROOT / package).rglob("*.py"))]
    return [f for f in files if GUARD_PACKAGE not in f.parents]


def offences(path: Path, members: set) -> list:
    """``file:line: what`` for each reach into the guard's or a ledger's private members."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in members:
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue  # a class's own member that happens to share the name
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in (
                "guard", "front", "shadowing", "careful", "checker", "decisions", "bookkeeping",
                "evidence", "telemetry", "quarantine", "baseline", "roles", "arguments",
                "instances"):
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}"
                      for a in node.names if _private(a.name)]
    return found


def test_the_probe_sees_the_guards_private_members():
    members = private_members()
    assert {"_ledgers", "_tick", "_quarantine", "_learn", "_watchers"} <= members
    sample = ROOT / "kvguard" / "guard" / "bookkeeping.py"  # inside: allowed, but it does reach
    assert offences(sample, members), "the probe must find what the package itself uses"


def test_no_module_outside_the_guard_package_touches_its_privates():
    members = private_members()
    found = [hit for path in outside_modules() for hit in offences(path, members)]
    assert found == [], "use the Guard's hook protocol instead:\n" + "\n".join(found)


def test_the_hooks_cover_what_an_adapter_needs():
    """An extra freeing method wrapped by its role checks like the spec's own free."""
    from kvguard.examples import LinkedFreeList

    class TwoDoors(LinkedFreeList):
        def release(self, ids):
            for b in ids:
                self.free([b])

    a = TwoDoors(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    g.wrap_method("release", "freeing")
    ids = a.allocate(2)
    a.release(ids)
    assert g.live == {} and g.stats.free_calls == 1
    try:
        a.release([ids[0]])
    except kvguard.DoubleFreeError as exc:
        assert exc.violation.method == "release"
    else:
        raise AssertionError("a double free through an extra freeing method must raise")
    g.unguard()
    assert "release" not in vars(a)


def test_no_module_imports_another_modules_private_name():
    """Across kvguard/ and pytest_kvguard/, a name one module imports from another is public."""
    found = []
    for package in ("kvguard", "pytest_kvguard"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                    found += [f"{path.relative_to(ROOT)}:{node.lineno}: {a.name}"
                              for a in node.names if _private(a.name)]
    assert found == []


def test_a_wrapper_built_on_the_low_level_hooks_checks_and_records():
    """capture_site, plan_release, commit_release and commit_allocation: what a hand-written
    wrapper needs, with no private member of the guard."""
    from kvguard.examples import LinkedFreeList

    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC, on_violation="repair")
    raw_free, raw_allocate = g.allocator.free.__wrapped__, g.allocator.allocate.__wrapped__

    def take(n):
        with g.lock:
            ids = raw_allocate(n)
            g.commit_allocation("take", ids, g.capture_site())
            return ids

    def give_back(ids):
        with g.lock:
            plan = g.plan_release("give_back", ids, g.capture_site())
            kept = plan.good + plan.learned
            raw_free(kept)
            g.commit_release(plan)
            return kept

    ids = take(2)
    assert sorted(g.live) == sorted(ids) and g.stats.alloc_calls == 1
    assert give_back([ids[0], ids[0]]) == [ids[0]]  # repaired: the duplicate is dropped
    assert [v.kind for v in g.violations] == [kinds.DUPLICATE_ID]
    assert g.violations[0].method == "give_back"
    assert list(g.live) == [ids[1]] and a.free_blocks == 3
    g.check()


def test_wrap_method_refuses_what_it_cannot_guard_and_changes_nothing():
    from kvguard.examples import LinkedFreeList

    a = LinkedFreeList(4)
    g = kvguard.guard(a, LINKED_FREE_LIST_SPEC)
    before = dict(vars(a))
    for name, role, options, error in (
            ("free", "freeing", {}, TypeError),          # the spec's own method
            ("allocate_more", "shredding", {}, ValueError),  # no such role
            ("allocate_more", "settled", {}, TypeError),     # settled needs when=
    ):
        try:
            g.wrap_method(name, role, **options)
        except error as exc:
            assert str(exc)
        else:
            raise AssertionError(f"{role} of {name} must be refused")
    assert vars(a) == before
