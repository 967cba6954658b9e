"""A key in ``[tool.kvguard]`` (or a ``kvguard-*`` key of a flake8 section) that names no
setting is a typo until proven otherwise: it is ignored, as before, but said once."""

from __future__ import annotations

import pytest

from flake8_kvguard import config

from .helpers import run_cli, write_project


def test_an_unknown_pyproject_key_warns_once_with_a_suggestion(tmp_path):
    root = write_project(tmp_path / "proj", {
        "pyproject.toml": '[tool.kvguard]\nfree_name = ["drop_blocks"]\ncolour = "red"\n',
        "a.py": "def f(pool, ids):\n    pool.drop_blocks(ids)\n",
        "b.py": "def g(pool, ids):\n    pool.free(ids)\n",
    })
    status, out, err = run_cli(["a.py", "b.py"], root)
    assert status == 0, out + err
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0] == (
        f"kvguard lint: warning: {root / 'pyproject.toml'} [tool.kvguard]: unknown setting "
        "'free_name' is ignored (did you mean 'free-names'? known: free-names, "
        "tensor-functions, tensor-native)")
    assert "unknown setting 'colour' is ignored (known: " in lines[1]
    assert run_cli(["a.py"], root)[2] == "", "once per process, not once per run or per file"


def test_unknown_kvguard_keys_of_a_flake8_section_warn_and_others_do_not(tmp_path):
    root = write_project(tmp_path / "proj", {
        "setup.cfg": "[flake8]\nmax-line-length = 99\nkvguard-tensor-function = x.ids\n",
        "a.py": "x = 1\n",
    })
    status, _, err = run_cli(["a.py"], root)
    assert status == 0
    assert "unknown setting 'kvguard-tensor-function' is ignored (did you mean " \
           "'tensor-functions'?" in err
    assert "max-line-length" not in err


def test_known_keys_are_silent_and_still_read():
    unknown: list = []
    cfg = config.from_mapping({"free-names": ["drop"], "tensor_native": "a.free"}, "here",
                              unknown=unknown)
    assert unknown == [] and "drop" in cfg.free_names and "a.free" in cfg.tensor_native


def test_a_config_is_an_immutable_value():
    """Config keys the pre-filter and the per-root caches: equal settings are one key,
    and nothing can change a config once made."""
    a = config.Config(free_names=frozenset({"free", "drop"}))
    b = config.DEFAULT.merged(config.Config(free_names=frozenset({"drop"})))
    assert a != config.DEFAULT and a.merged(config.DEFAULT) == b.merged(a) != a
    assert b == config.Config(free_names=config.DEFAULT_FREE_NAMES | {"drop"})
    assert hash(b) == hash(config.Config(free_names=config.DEFAULT_FREE_NAMES | {"drop"}))
    assert len({config.DEFAULT, config.Config(), b}) == 2
    assert config.Config() != (config.DEFAULT_FREE_NAMES, frozenset(), frozenset())
    for change in (lambda: setattr(b, "free_names", frozenset()), lambda: delattr(b, "free_names")):
        with pytest.raises(AttributeError):
            change()
    assert "drop" in b.free_names and "drop" in repr(b)
