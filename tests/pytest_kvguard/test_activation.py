"""Dormant when installed; switched on by -p kvguard, --kvguard, ini, addopts; off by -p no:."""

import os
import subprocess
import sys

import pytest

from .conftest import SWALLOWED, write


DORMANT_CHECKS = """
    import sys
    import kvguard
    from kvguard import registry
    from kvguard.examples import LinkedFreeList

    def test_nothing_is_guarded():
        assert not kvguard.instrumented()
        assert not any(type(f).__module__ == "kvguard.registry" for f in sys.meta_path)
        pool = LinkedFreeList(8)
        assert kvguard.guard_of(pool) is None
        pool.free([pool.allocate(1)[0]] * 1)
"""


@pytest.mark.parametrize("how", ["-p", "--kvguard", "ini", "ini-addopts", "env-addopts"])
def test_each_switch_turns_it_on(suite, how, monkeypatch):
    write(suite, SWALLOWED)
    args = []
    if how == "-p":
        args = ["-p", "kvguard"]
    elif how == "--kvguard":
        args = ["--kvguard"]
    elif how == "ini":
        suite.makeini("[pytest]\nkvguard = true\n")
    elif how == "ini-addopts":
        suite.makeini("[pytest]\naddopts = -p kvguard\n")
    else:
        monkeypatch.setenv("PYTEST_ADDOPTS", "-p kvguard")
    result = suite.runpytest(*args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*kvguard: duplicate-id of block 0 on LinkedFreeList#*"])
    result.stdout.fnmatch_lines(["kvguard: on (mode=raise, stacks=cheap, leaks=summary)*"])


def test_dormant_by_default(suite):
    write(suite, SWALLOWED + DORMANT_CHECKS)
    result = suite.runpytest()
    result.assert_outcomes(passed=2)
    assert "kvguard:" not in result.stdout.str()


def test_p_no_kvguard_wins_over_the_ini_switch(suite):
    suite.makeini("[pytest]\nkvguard = true\n")
    write(suite, SWALLOWED + DORMANT_CHECKS)
    result = suite.runpytest("-p", "no:kvguard")
    result.assert_outcomes(passed=2)


def test_p_no_kvguard_leaves_the_ini_settings_known(suite):
    """A project's kvguard settings stay known with the plugin off: no ``Unknown config
    option`` warning, and ``--strict-config`` passes."""
    suite.makeini("[pytest]\nkvguard = true\nkvguard_mode = log\n"
                  "kvguard_allocators =\n    mypool:BlockPool free=put\n")
    write(suite, SWALLOWED + DORMANT_CHECKS)
    result = suite.runpytest("-p", "no:kvguard", "--strict-config")
    result.assert_outcomes(passed=2)
    assert "Unknown config option" not in result.stdout.str() + result.stderr.str()


def test_the_marker_is_known_while_dormant(suite):
    write(suite, """
        import pytest

        @pytest.mark.kvguard(leaks="fail")
        def test_marked():
            pass
    """)
    suite.runpytest("--strict-markers").assert_outcomes(passed=1)


def _clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "KVGUARD"))}
    return env


def test_a_plain_run_never_imports_kvguard(pytester):
    """The installed plugin costs a plain run nothing: kvguard is not even imported."""
    write(pytester, """
        import sys

        def test_untouched():
            assert "kvguard" not in sys.modules
            assert not any("kvguard" in type(f).__module__ for f in sys.meta_path)
            assert sys.modules["pytest_kvguard.plugin"]  # loaded by its entry point, dormant
    """)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                         cwd=pytester.path, capture_output=True, text=True, env=_clean_env(),
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout


def test_works_with_plugin_autoload_disabled(pytester):
    pytester.makeconftest("""
        import kvguard
        from kvguard.examples import LINKED_FREE_LIST_SPEC
        kvguard.register("kvguard.examples.LinkedFreeList", LINKED_FREE_LIST_SPEC)
    """)
    write(pytester, SWALLOWED)
    env = dict(_clean_env(), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "kvguard"], cwd=pytester.path, capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed" in out.stdout
    assert "kvguard: duplicate-id of block 0" in out.stdout
