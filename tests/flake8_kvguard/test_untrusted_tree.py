"""`kvguard lint` on a source tree it cannot trust: only regular files inside it, bounded.

A `*.py` FIFO in a tree once hung `kvguard lint` (and a symlink to `/dev/zero` exhausted its
memory), so the real finding in the next file was never printed; a generated 9 MB module took
43 s and 3.3 GB. Each such file is skipped with one line now, and the rest is checked. Run as
a subprocess with a timeout, so that a hang fails the test instead of stalling the run.
"""

import os
import subprocess
import sys

import pytest

from flake8_kvguard import project

from .helpers import REPO, write_project

BAD = """\
import torch


def flush(allocator, ids: torch.Tensor) -> None:
    allocator.free(ids)
"""

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def _lint(args, cwd):
    return subprocess.run([sys.executable, "-m", "kvguard", "lint", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_fifos_devices_and_symlinks_out_of_the_tree_are_skipped_with_one_line(tmp_path):
    tree = tmp_path / "tree"
    write_project(tree, {"z_real.py": BAD})
    os.mkfifo(tree / "a_fifo.py")  # no writer: opening it for reading would block
    os.symlink("/dev/zero", tree / "b_zero.py")
    outside = tmp_path / "outside.py"
    outside.write_text(BAD)
    os.symlink(outside, tree / "c_out.py")
    done = _lint(["."], tree)
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("./z_real.py:5:20: KVG101"), "the real finding is reported"
    assert done.stderr.splitlines() == [
        "kvguard lint: ./a_fifo.py: skipped: not a regular file (a FIFO)",
        "kvguard lint: ./b_zero.py: skipped: a symlink out of . (to /dev/zero)",
        f"kvguard lint: ./c_out.py: skipped: a symlink out of . (to {outside.resolve()})",
    ]


def test_a_fifo_or_device_named_on_the_command_line_is_skipped(tmp_path):
    write_project(tmp_path, {"real.py": BAD})
    os.mkfifo(tmp_path / "pipe.py")
    done = _lint(["pipe.py", "/dev/zero", "real.py"], tmp_path)
    assert done.returncode == 1
    assert done.stdout.startswith("real.py:5:20: KVG101")
    assert done.stderr.splitlines() == [
        "kvguard lint: pipe.py: skipped: not a regular file (a FIFO)",
        "kvguard lint: /dev/zero: skipped: not a regular file (a character device)",
    ]


def test_a_source_file_past_the_size_limit_is_skipped_and_not_indexed(tmp_path):
    write_project(tmp_path, {"real.py": BAD})
    line = b"x = allocator.free([1, 1])\n"
    (tmp_path / "generated.py").write_bytes(line * (project.MAX_SOURCE_BYTES // len(line) + 1))
    done = _lint(["."], tmp_path)
    assert done.returncode == 1
    assert done.stdout.startswith("./real.py:5:20: KVG101")
    size = os.path.getsize(tmp_path / "generated.py")
    assert done.stderr == (f"kvguard lint: ./generated.py: skipped: {size:,} bytes, over the "
                           f"{project.MAX_SOURCE_BYTES:,}-byte limit for a source file\n")
