"""A key in ``[tool.kvguard]`` (or a ``kvguard-*`` key of a flake8 section) that names no
setting is a typo until proven otherwise: it is ignored, as before, but said once."""

from __future__ import annotations

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
