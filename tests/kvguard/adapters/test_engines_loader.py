"""The test loader of engine files (``engines.Modules``) leaves an installed engine as it found
it: with the real package installed and imported (transformers in a venv that has it), a
stand-in left on one of its modules broke the engine for every later test (``LlamaConfig``
subclassed a placeholder ``PreTrainedConfig``)."""

from __future__ import annotations

import sys
import types

from . import engines


def test_close_puts_back_what_it_changed_on_modules_that_were_there(monkeypatch):
    real = types.ModuleType("realpkg")
    real.__path__ = []
    real.Config = config = type("Config", (), {})
    sub = types.ModuleType("realpkg.sub")
    sub.helper = helper = object()
    real.sub = sub
    monkeypatch.setitem(sys.modules, "realpkg", real)
    monkeypatch.setitem(sys.modules, "realpkg.sub", sub)
    modules = engines.Modules()
    modules.stub("realpkg", Config=type("Placeholder", (), {}), extra=1)
    modules.stub("realpkg.sub", helper=None)
    modules.stub("realpkg.fresh.leaf", value=2)
    assert real.Config is not config and real.extra == 1 and sub.helper is None
    assert sys.modules["realpkg.fresh.leaf"].value == 2 and real.fresh.leaf.value == 2
    modules.close()
    assert real.Config is config and not hasattr(real, "extra") and sub.helper is helper
    assert not hasattr(real, "fresh") and "realpkg.fresh" not in sys.modules
    assert sys.modules["realpkg"] is real and sys.modules["realpkg.sub"] is sub


def test_close_puts_back_a_module_a_loaded_file_stood_in_for(tmp_path, monkeypatch):
    engine = tmp_path / "engine"
    (engine / "pkg").mkdir(parents=True)
    (engine / "pkg" / "alloc.py").write_text(
        "class Pool:\n    pass\n\n\ndef helper():\n    return 1\n")
    monkeypatch.setattr(engines, "source", lambda package, inner: package / inner)
    real_pkg = types.ModuleType("enginepkg")
    real_pkg.__path__ = []
    real_alloc = types.ModuleType("enginepkg.alloc")
    real_alloc.Pool = pool = type("Pool", (), {})
    real_pkg.alloc = real_alloc
    monkeypatch.setitem(sys.modules, "enginepkg", real_pkg)
    monkeypatch.setitem(sys.modules, "enginepkg.alloc", real_alloc)
    modules = engines.Modules()
    loaded = modules.load(engine, "pkg/alloc.py", "enginepkg.alloc")
    assert loaded is not real_alloc and real_pkg.alloc is loaded
    cls = modules.load_class(engine, "pkg/alloc.py", "enginepkg.other", "Pool")
    modules.load_functions(engine, "pkg/alloc.py", "enginepkg", ["helper"])
    assert cls.__module__ == "enginepkg.other" and real_pkg.helper() == 1
    modules.close()
    assert sys.modules["enginepkg.alloc"] is real_alloc and real_pkg.alloc is real_alloc
    assert real_alloc.Pool is pool and not hasattr(real_pkg, "helper")
    assert not hasattr(real_pkg, "__file__") and "enginepkg.other" not in sys.modules
