"""The checker never imports torch, and runs where torch cannot be imported."""

import subprocess
import sys

from .helpers import FIXTURES, write_project

BLOCK_TORCH = (
    "import sys\n"
    "class _NoTorch:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError('torch is blocked in this test')\n"
    "sys.meta_path.insert(0, _NoTorch())\n"
)


def test_lint_without_torch(tmp_path):
    write_project(tmp_path, {"mod.py": (FIXTURES / "kvg101/checker/flush_sequence.py").read_text()})
    script = BLOCK_TORCH + (
        "from flake8_kvguard.cli import main\n"
        "status = main(['mod.py'])\n"
        "assert 'torch' not in sys.modules\n"
        "sys.exit(status)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("mod.py:21:33: KVG101"), done.stdout
    flake8 = (
        BLOCK_TORCH
        + "from flake8.main.cli import main\nsys.exit(main(['--select', 'KVG', 'mod.py']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", flake8], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("mod.py:21:33: KVG101")


def test_importing_the_package_never_imports_torch():
    script = (
        "import sys\n"
        "import flake8_kvguard, flake8_kvguard.plugin, flake8_kvguard.engine, flake8_kvguard.cli\n"
        "from flake8_kvguard import fixer, docs\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
