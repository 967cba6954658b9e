"""The pytest plugin (entry point ``pytest11: kvguard``); dormant unless switched on.

Installed, pytest loads this module in every run, so it holds only what must always exist: the
options, the marker's line in ``--markers``, and the ``kvguard`` fixture's name. Everything else
lives in ``Manager``, registered only when the run asks for kvguard (``-p kvguard``, also through
``PYTEST_ADDOPTS`` or ini ``addopts``; ``--kvguard``; ini ``kvguard = true``). A dormant run does
not even import ``kvguard``: no finder on ``sys.meta_path``, no patched class, no hook that runs
per test.
"""

from __future__ import annotations

import pytest

from .ini import add_settings
from .markers import MARKER_HELP
from .options import LEAKS, MODES, STACKS, Settings

MANAGER_NAME = "kvguard-manager"
PLUGIN_NAMES = ("kvguard", "pytest_kvguard.plugin")
"""Names under which ``-p`` loads this plugin; ``-p`` with one of them switches it on."""

_manager_key = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvguard", "kvguard: guard paged KV-cache block allocators")
    group.addoption("--kvguard", action="store_true", default=False,
                    help="switch kvguard on for this run (like -p kvguard)")
    group.addoption("--kvguard-mode", choices=MODES, default=None,
                    help="raise: a misuse raises into the code under test; log: it is recorded "
                         "and the call goes through. Either way the test fails (default: raise)")
    group.addoption("--kvguard-stacks", choices=STACKS, default=None,
                    help="call stacks kept per allocation and free site (default: cheap)")
    group.addoption("--kvguard-leaks", choices=LEAKS, default=None,
                    help="blocks a test handed out and never freed: summary (listed at the "
                         "end of the run if their allocator outlived the test, with the "
                         "session's own; the default), warn (a warning per test), fail (the "
                         "test's teardown fails), or off")
    group.addoption("--kvguard-report", action="append", default=None,
                    metavar="short|full|PATH",
                    help="short: a failing test shows each violation's SUMMARY line, not its "
                         "whole report; full: the whole report (default); PATH: also write "
                         "every violation (with its test) and the counters per allocator "
                         "class to PATH as JSON. Give it twice for a style and a PATH")
    add_settings(parser)  # also by the kvguard-ini entry point; adding twice is harmless


def switched_on(config: pytest.Config) -> bool:
    plugins = getattr(config.option, "plugins", None) or ()
    return (any(name in PLUGIN_NAMES for name in plugins) or bool(config.getoption("kvguard"))
            or bool(config.getini("kvguard")))


def pytest_configure(config: pytest.Config) -> None:
    # The marker is declared even while dormant, so a suite that uses it passes
    # --strict-markers with or without kvguard switched on.
    config.addinivalue_line("markers", MARKER_HELP)
    if not switched_on(config):
        return
    from .manager import Manager

    manager = Manager(config, Settings.from_config(config))
    config.stash[_manager_key] = manager
    config.pluginmanager.register(manager, MANAGER_NAME)
    manager.start()


def manager_of(config: pytest.Config):
    """The running Manager, or None while the plugin is dormant."""
    return config.stash.get(_manager_key, None)


@pytest.fixture
def kvguard(request: pytest.FixtureRequest):
    """This test's view of kvguard: ``guard(obj, spec=None)``, ``violations``,
    ``expect(kind)``, ``assert_no_leaks()``. See docs/pytest.md."""
    manager = manager_of(request.config)
    if manager is None:
        pytest.fail("the kvguard fixture needs the plugin switched on: run pytest -p kvguard "
                    "(or --kvguard, or ini kvguard = true)", pytrace=False)
    handle = manager.fixture(request.node)
    try:
        yield handle
    finally:
        handle.close()
