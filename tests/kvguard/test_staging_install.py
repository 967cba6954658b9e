"""The start-up hook really lands in site-packages: a regular and an editable ``pip install`` of
this checkout into throwaway venvs, then ``KVGUARD=1`` turns staging on there, its absence imports
nothing, and ``pip uninstall`` removes the file again.

The venvs see nothing of the interpreter they are made from (no ``--system-site-packages``), and
pip builds the project in an isolated build environment with the ``[build-system]`` requirements
from the package index, as ``pip install`` on a user's machine does: the result must not depend
on which setuptools, or whether ``wheel``, the base interpreter happens to carry (a fresh
``python -m venv`` of Python 3.11 has setuptools 65.5 and no ``wheel``, which cannot build
``bdist_wheel``). Without a reachable index the build requirements cannot be had: the test
skips and says so."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from kvguard._pth import PTH_LINE, PTH_NAME

from .staging_env import ROOT

PROBE = ("import sys; k = sys.modules.get('kvguard'); "
         "print(k is not None and k.registry.instrumented(), k and k.__file__)")


NO_INDEX = re.compile(r"No matching distribution found for setuptools|"
                      r"Could not find a version that satisfies the requirement setuptools")


def sh(*args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)


def copy_project(dest):
    """What a build needs: pyproject, README and the three packages (no caches, no .git)."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), dest / name)
    for package in ("kvguard", "pytest_kvguard", "flake8_kvguard"):
        if os.path.isdir(os.path.join(ROOT, package)):
            shutil.copytree(os.path.join(ROOT, package), dest / package,
                            ignore=shutil.ignore_patterns("__pycache__"))


@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_pip_install_ships_the_hook(tmp_path, editable):
    src = tmp_path / "src"
    src.mkdir()
    copy_project(src)
    venv = tmp_path / "venv"
    made = sh(sys.executable, "-m", "venv", "--without-pip", str(venv))
    assert made.returncode == 0, made.stderr
    python = str(venv / "bin" / "python")
    target = ["-e", str(src)] if editable else [str(src)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD", "PIP_"))}
    env.pop("PYTHONPATH", None)
    installed = sh(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                   "-q", *target, cwd=tmp_path, env=env)
    if installed.returncode and NO_INDEX.search(installed.stderr):
        pytest.skip("no package index reachable for the build requirements (setuptools): "
                    + installed.stderr.strip().splitlines()[-1])
    assert installed.returncode == 0, installed.stderr[-3000:]
    purelib = sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                 env=env).stdout.strip()
    pth = os.path.join(purelib, PTH_NAME)
    with open(pth, encoding="utf-8") as f:
        assert f.read() == PTH_LINE
    (record,) = [os.path.join(purelib, d, "RECORD") for d in os.listdir(purelib)
                 if d.startswith("kvguard-") and d.endswith(".dist-info")]
    with open(record, encoding="utf-8") as f:
        assert any(line.startswith(PTH_NAME + ",") for line in f), "uninstall removes it"

    on = sh(python, "-c", PROBE, env={**env, "KVGUARD": "1"}, cwd=tmp_path)
    assert on.returncode == 0, on.stderr
    active, where = on.stdout.split()
    assert active == "True"
    assert where.startswith(str(src) if editable else purelib), where
    off = sh(python, "-c", PROBE, env=env, cwd=tmp_path)
    assert off.stdout.split() == ["False", "None"]
    # The log schema is package data: installed beside the code, read from there.
    schema = sh(python, "-c", "import kvguard.staging.records as r; print(r.schema()['title'], "
                "r.__file__)", env=env, cwd=tmp_path)
    assert schema.returncode == 0, schema.stderr
    assert schema.stdout.startswith("kvguard staging log record, format version 1 ")
    if not editable:
        assert os.path.isfile(os.path.join(purelib, "kvguard", "schema", "log-v1.json"))

    removed = sh(sys.executable, "-m", "pip", "--python", python, "uninstall", "-y", "-q",
                 "kvguard", cwd=tmp_path, env=env)
    assert removed.returncode == 0, removed.stderr
    assert not os.path.exists(pth)
