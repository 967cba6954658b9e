"""Where a project starts, and which of its files are Python source."""

from __future__ import annotations

import os

ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", "tox.ini", ".flake8", ".git")

# Directories that hold no source of the project itself.
SKIPPED_DIRS = frozenset(
    (
        "__pycache__",
        "build",
        "dist",
        "node_modules",
        "site-packages",
        "venv",
        "env",
    )
)

_roots: dict = {}


def find_root(path: str) -> str:
    """The project a file belongs to.

    The nearest directory above it holding a project marker (pyproject.toml,
    setup.py, setup.cfg, tox.ini, .flake8, .git); failing that the outermost
    package that contains it (an installed wheel: site-packages/vllm), or its
    own directory.
    """
    directory = (
        os.path.dirname(os.path.abspath(path)) if not os.path.isdir(path) else os.path.abspath(path)
    )
    root = _roots.get(directory)
    if root is None:
        root = _find_root(directory)
        _roots[directory] = root
    return root


def _find_root(directory: str) -> str:
    current = directory
    while True:
        try:
            entries = set(os.listdir(current))
        except OSError:
            entries = set()
        if any(marker in entries for marker in ROOT_MARKERS):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    package = directory
    while os.path.isfile(os.path.join(package, "__init__.py")):
        parent = os.path.dirname(package)
        if parent == package or not os.path.isfile(os.path.join(parent, "__init__.py")):
            break
        package = parent
    return package


MAX_SOURCE_BYTES = 1 << 20
"""A larger file is neither checked nor indexed (``kvguard lint`` says so in one line): no
hand-written allocator is that long, and time and memory grow with it (a generated 9 MB module
took 43 s and 3.3 GB)."""


def is_skipped_dir(name: str) -> bool:
    return name.startswith(".") or name in SKIPPED_DIRS or name.endswith(".egg-info")


def iter_python_files(directory: str, *, with_stat: bool = False):
    """Python files under a directory, skipping hidden, build and virtualenv folders;
    with `with_stat`, (path, os.stat_result) pairs."""
    stack = [directory]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError:
            continue
        subdirectories = []
        for entry in entries:
            name = entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    if not is_skipped_dir(name):
                        subdirectories.append(entry.path)
                    continue
                if not name.endswith((".py", ".pyi")) or not entry.is_file():
                    continue
                if with_stat:
                    yield entry.path, entry.stat()
                else:
                    yield entry.path
            except OSError:
                continue
        stack.extend(reversed(subdirectories))
