"""A spec that fits nothing is a configuration error, said once where the spec is given: not a
``TypeError`` at every instance (issue 27). ``register()`` of a class refuses it; a dotted name
is checked when its class is imported while instrumented (its instances then run unguarded,
said in one line); ``kvguard.guard()`` names the methods the class has; ``kvguard fuzz`` stops
with one line and exit status 2. The plugin's side is in tests/pytest_kvguard."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap

import pytest

import kvguard
from kvguard import registry, staging
from kvguard.spec import SpecMisfitError, misfit


class Unnamed:
    """An allocator whose methods have names no default spec guesses."""

    def __init__(self, n=4):
        self.free_ids = list(range(n))

    def get_blocks(self, k):
        out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
        return out

    def put_blocks(self, ids):
        self.free_ids.extend(ids)


def test_misfit_names_the_missing_method_the_keyword_and_what_the_class_has():
    problem = misfit(Unnamed, kvguard.AllocatorSpec())
    assert "has no method 'allocate' (AllocatorSpec alloc='allocate', the default)" in problem
    assert "get_blocks, put_blocks" in problem and "kvguard spec suggest" in problem
    assert misfit(Unnamed, kvguard.AllocatorSpec(alloc="get_blocks", free="put_blocks")) is None
    assert "also_*" in misfit(Unnamed, kvguard.AllocatorSpec(
        alloc="get_blocks", free="put_blocks", reset="clear"))


def test_register_of_a_class_refuses_a_spec_that_fits_nothing():
    with pytest.raises(SpecMisfitError, match=r"kvguard.register\(.*Unnamed\): .*no method "
                       r"'allocate'"):
        kvguard.register(Unnamed, kvguard.AllocatorSpec())
    assert f"{Unnamed.__module__}.Unnamed" not in registry.registered()


def test_guard_names_the_methods_the_class_has():
    with pytest.raises(TypeError, match="its public methods: get_blocks, put_blocks"):
        kvguard.guard(Unnamed())


MODULE = """
class Pool:
    def __init__(self, n=4):
        self.free_ids = list(range(n))

    def get_blocks(self, k):
        out, self.free_ids = self.free_ids[:k], self.free_ids[k:]
        return out

    def put_blocks(self, ids):
        self.free_ids.extend(ids)
"""


@pytest.fixture
def late_module(tmp_path, monkeypatch):
    """A module of the test's own, not imported yet: registered by its dotted name."""
    name = f"kvg_fit_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_dotted_name_that_fits_nothing_is_said_once_when_imported_and_guards_nothing(
        late_module, caplog):
    dotted = f"{late_module}.Pool"
    kvguard.register(dotted, kvguard.AllocatorSpec())
    kvguard.instrument()
    try:
        with caplog.at_level(logging.WARNING, logger="kvguard"):
            pool_class = importlib.import_module(late_module).Pool
            pools = [pool_class() for _ in range(3)]   # no TypeError at any of them
        assert all(kvguard.guard_of(p) is None for p in pools)
        lines = [r.getMessage() for r in caplog.records if "configuration error" in
                 r.getMessage()]
        assert len(lines) == 1 and "no method 'allocate'" in lines[0] and "\n" not in lines[0]
        assert "no method 'allocate'" in registry.misfits()[dotted]
    finally:
        kvguard.uninstrument()
        kvguard.unregister(dotted)
    assert dotted not in registry.misfits()


def test_staging_warns_in_one_line_and_never_breaks_the_host(late_module, caplog):
    dotted = f"{late_module}.Pool"
    assert staging.start({"KVGUARD": "1", "KVGUARD_REGISTER": dotted})
    try:
        with caplog.at_level(logging.WARNING, logger="kvguard"):
            pool = importlib.import_module(late_module).Pool()
            pool.put_blocks(pool.get_blocks(2))
        assert kvguard.guard_of(pool) is None
        (line,) = [r.getMessage() for r in caplog.records if "configuration error" in
                   r.getMessage()]
        assert f"{dotted} has no method 'allocate'" in line and "run unguarded" in line
    finally:
        staging.stop()
        kvguard.unregister(dotted)


def test_kvguard_fuzz_stops_with_one_line_and_exit_2(late_module, capsys, monkeypatch):
    from kvguard.cli import main
    assert main(["fuzz", f"{late_module}.Pool", "--factory", "cls()"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvguard fuzz: error: " in err and \
        "no method 'allocate'" in err


def test_the_source_tells_a_misfit_without_importing_the_module(late_module):
    from kvguard.specsource import source_misfit
    dotted = f"{late_module}.Pool"
    problem = source_misfit(dotted, kvguard.AllocatorSpec())
    assert f"{dotted} has no method 'allocate'" in problem and "get_blocks, put_blocks" in problem
    assert source_misfit(dotted, kvguard.AllocatorSpec(alloc="get_blocks",
                                                       free="put_blocks")) is None
    assert late_module not in sys.modules
    assert source_misfit("kvguard.examples.LinkedFreeList", kvguard.AllocatorSpec()) is None
    assert source_misfit("kvg_nowhere.Pool", kvguard.AllocatorSpec()) is None


def test_kvguard_run_stops_before_the_command_with_one_line(late_module, capsys, tmp_path,
                                                            monkeypatch):
    from kvguard.cli import main
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    assert main(["run", "--register", f"{late_module}.Pool", *command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvguard run: error: " in err and \
        "no method 'allocate'" in err
    assert not marker.exists() and late_module not in sys.modules
    assert main(["run", "--register", f"{late_module}.Pool(alloc=get_blocks, free=put_blocks)",
                 *command]) == 0
    assert marker.exists()
