"""A Python interpreter whose start-up runs kvguard's ``.pth`` hook, for subprocess tests.

When the running interpreter's site-packages already holds ``kvguard.pth`` (an install made
after the hook shipped), that interpreter is used. Otherwise a throwaway venv with
``--system-site-packages`` gets exactly the file the build writes: its Python sees the installed
kvguard and runs the hook at start-up, as an installed one would. ``PYTHONPATH`` pins the
kvguard under test (this checkout) either way.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys

import pytest

from kvguard._pth import PTH_LINE, PTH_NAME
from kvguard.staging import VARIABLES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hook_installed() -> bool:
    for directory in site.getsitepackages():
        try:
            with open(os.path.join(directory, PTH_NAME), encoding="utf-8") as f:
                if f.read() == PTH_LINE:
                    return True
        except OSError:
            continue
    return False


@pytest.fixture(scope="session", name="staged_python")
def staged_python_fixture(tmp_path_factory) -> str:
    if hook_installed():
        return sys.executable
    venv = tmp_path_factory.mktemp("staged-venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, capture_output=True, timeout=120)
    python = os.path.join(venv, "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True,
                             timeout=60).stdout.strip()
    with open(os.path.join(purelib, PTH_NAME), "w", encoding="utf-8") as f:
        f.write(PTH_LINE)
    return python


def staged_env(**variables) -> dict:
    """The environment of a staged subprocess: this checkout first on the path, no staging
    variables inherited from the test run, then ``variables``."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.update({k: str(v) for k, v in variables.items()})
    return env
