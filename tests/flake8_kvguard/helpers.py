"""Shared helpers for the flake8_kvguard tests."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from flake8_kvguard import cli, config, engine, fixer, index

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]


def lint(source: str, cfg: config.Config = config.DEFAULT, project_index=None, *, prefilter=True):
    """Findings for a snippet (dedented), as "line:col CODE" with 1-based columns."""
    found = engine.lint_source(
        textwrap.dedent(source), cfg, project_index or index.EMPTY, use_prefilter=prefilter
    )
    return [f"{f.line}:{f.col + 1} {f.code}" for f in found]


def codes(source: str, **kwargs):
    return [entry.split()[1] for entry in lint(source, **kwargs)]


def fix(source: str, cfg: config.Config = config.DEFAULT, project_index=None, select=None) -> str:
    new, _ = fixer.fix_source(
        textwrap.dedent(source).encode(), cfg, project_index or index.EMPTY, select
    )
    return new.decode()


def write_project(root: Path, files: dict) -> Path:
    """Files (relative path -> dedented text) under root, with a setup.cfg marking it
    as a project unless one is given."""
    root.mkdir(parents=True, exist_ok=True)
    if not any(name in files for name in ("setup.cfg", "pyproject.toml", "tox.ini", ".flake8")):
        files = {"setup.cfg": "[metadata]\nname = example\n", **files}
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def run_flake8(args, cwd, *, env=None):
    """Real flake8 in a subprocess; returns (exit status, stdout lines)."""
    done = subprocess.run(
        [sys.executable, "-m", "flake8", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout.splitlines()


@contextlib.contextmanager
def chdir(path):
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def run_cli(args, cwd):
    """`kvguard lint ARGS` in this process; returns (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with chdir(cwd):
        status = cli.main(list(args), out=out, err=err)
    return status, out.getvalue(), err.getvalue()
