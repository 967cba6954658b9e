"""The conventions a newcomer expects to find: a pre-commit hook that really runs, advice for
ruff users that ruff itself confirms, and skip reasons shown by a plain ``pytest``."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

BAD = """import torch


def flush(allocator, seq) -> None:
    ids = torch.cat(seq.block_groups)
    allocator.free(ids)
"""
GOOD = BAD.replace("allocator.free(ids)", "allocator.free(ids.tolist())")


def run(args, cwd, env=None, timeout=600):
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def git_repo(path: Path, files: dict) -> Path:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    for args in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "init"]):
        done = run(args, path, env)
        assert done.returncode == 0, done.stderr
    return path


def test_plain_pytest_shows_skip_reasons(pytestconfig):
    # README says skipped tests say what to download: only true when their reasons are shown.
    assert "-rs" in pytestconfig.getini("addopts")


def test_the_pre_commit_hook_runs_kvguard_lint(tmp_path):
    if importlib.util.find_spec("pre_commit") is None:
        pytest.skip("pre-commit is not installed (it is in the test extra: pip install -e '.[test]')")
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("pre-commit installs a hook from a git repository: this checkout is not one")
    hooks = (REPO / ".pre-commit-hooks.yaml").read_text()
    assert "id: kvguard-lint" in hooks and "entry: kvguard lint" in hooks
    project = git_repo(tmp_path / "project", {"bad.py": BAD, "good.py": GOOD})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PRE_COMMIT_HOME"] = str(tmp_path / "pre-commit-home")
    env["PIP_NO_COMPILE"] = "1"  # the hook's environment is used once: no bytecode for it
    # try-repo installs the hook from this checkout (its HEAD plus uncommitted changes) into an
    # environment of its own, as a project's .pre-commit-config.yaml would.
    command = [sys.executable, "-m", "pre_commit", "try-repo", str(REPO), "kvguard-lint"]
    found = run([*command, "--all-files"], project, env)
    assert found.returncode == 1, found.stdout[-3000:] + found.stderr[-2000:]
    assert re.search(r"^bad\.py:6:20: KVG101 ", found.stdout, re.M), found.stdout[-3000:]
    assert "good.py" not in found.stdout
    clean = run([*command, "--files", "good.py"], project, env)
    assert clean.returncode == 0, clean.stdout[-3000:]
    assert re.search(r"^kvguard lint\.+Passed$", clean.stdout, re.M), clean.stdout[-2000:]


def ruff_command() -> list:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    if shutil.which("ruff"):
        return [shutil.which("ruff")]
    pytest.skip("ruff is not installed (it is in the test extra: pip install -e '.[test]')")


def documented_ruff_setting() -> str:
    lint_md = (REPO / "docs" / "lint.md").read_text()
    ruff = lint_md[lint_md.index("\n### ruff\n"):]
    (toml,) = re.findall(r"```toml\n(.*?)```", ruff[:ruff.index("\n## ", 1)], re.S)
    return toml


@pytest.mark.parametrize("with_setting", [False, True], ids=["no-setting", "documented-setting"])
def test_what_ruff_does_to_kvg_noqa_comments(tmp_path, with_setting):
    # Checked with ruff itself: without `external`, RUF102 reports `# noqa: KVG101` as an
    # invalid code and its fix deletes it, and RUF100's fix of an unused code sharing the
    # comment drops KVG101 with it. The setting docs/lint.md gives keeps both.
    ruff = ruff_command()
    source = "x = 1  # noqa: KVG101\ny = 2  # noqa: E501, KVG101\n"
    (tmp_path / "a.py").write_text(source)
    if with_setting:
        (tmp_path / "ruff.toml").write_text(
            documented_ruff_setting().replace("[tool.ruff.lint]", "[lint]"))
    base = [*ruff, "check", "--no-cache", "--select", "RUF100,RUF102", "--output-format",
            "concise"]
    if not with_setting:
        base.append("--isolated")
    found = run([*base, "a.py"], tmp_path)
    fixed = run([*base, "--fix", "a.py"], tmp_path)
    assert fixed.returncode in (0, 1), fixed.stderr
    after = (tmp_path / "a.py").read_text()
    if with_setting:
        assert "KVG101" not in found.stdout, found.stdout
        assert after == "x = 1  # noqa: KVG101\ny = 2  # noqa: KVG101\n"
    else:
        assert "RUF102" in found.stdout and "KVG101" in found.stdout, found.stdout
        assert "KVG101" not in after, after


def test_the_project_points_to_nothing_outside_it():
    # The docs and docstrings are self-contained: a clone has no ../shared/ beside it.
    tracked = run(["git", "ls-files"], REPO).stdout.split() if (REPO / ".git").exists() else []
    files = tracked or [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                        if p.suffix in (".md", ".py", ".toml", ".yaml") and p.is_file()]
    offenders = []
    for name in files:
        path = REPO / name
        if path.suffix not in (".md", ".py", ".toml", ".yaml", ".cfg", "") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if name != "tests/test_conventions.py" and re.search(
                r"SPEC\.md|STYLE\.md|\.\./shared|/work/(shared|notes)", text):
            offenders.append(name)
    assert offenders == []


def test_readme_commands_that_ci_runs_are_there_once_and_agree():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    patterns = re.findall(r"grep -m1 '(\^[^']+)' README\.md", ci)
    assert len(patterns) == 2, patterns
    for pattern in patterns:
        # grep's basic regex: \[ and \] are literal brackets, as in Python's.
        hits = [line for line in readme.splitlines() if re.match(pattern, line)]
        assert len(hits) == 1, (pattern, hits)
    (test_line,) = [line for line in readme.splitlines() if re.match(patterns[1], line)]
    assert test_line.startswith('pip install torch==2.13.0 && pip install -e ".[test]" && pytest')
    (cpu,) = re.findall(r"^pip install (torch==\S+) --index-url https://download\.pytorch\.org"
                        r"/whl/cpu$", readme, re.M)
    assert cpu in test_line, "the CPU-index command installs the same torch as the test command"


def test_readme_download_command_fetches_what_ci_downloads():
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    (loop,) = re.findall(r"^for pin in (.*?); do$", ci.replace("\\\n", " "), re.M | re.S)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    (command,) = re.findall(r"^pip download --no-deps (.*) -d ~/\.cache/kvguard-engines$",
                            readme, re.M)
    assert command.split() == loop.split(), (
        "README's download command should list the pins of .ci/run's download loop")


def defined_in(module: str, attribute: str) -> bool:
    """Whether ``module`` has ``attribute`` of its own (a function or class it imports from
    elsewhere is named by the module that defines it)."""
    value = getattr(importlib.import_module(module), attribute, defined_in)
    return value is not defined_in and getattr(value, "__module__", module) == module


def test_the_c_extensions_comments_name_python_code_that_exists():
    """``kvguard/_fastpath.c`` is the compiled twin of Python code, and its comments say of
    which (``readers.fast_reader's read_objects``, ``evidence.fold_empty``): each such name, a
    kvguard module's short or dotted name and an attribute, must be defined there."""
    package = REPO / "kvguard"
    modules: dict = {}
    for path in package.rglob("*.py"):  # modules, not packages (``guard`` is an object there)
        if path.name == "__init__.py":
            continue
        dotted = ".".join(path.relative_to(REPO).with_suffix("").parts)
        modules.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
        modules.setdefault(dotted, []).append(dotted)
    text = (package / "_fastpath.c").read_text()
    named = set(re.findall(r"\b((?:kvguard\.)?[a-z_]+(?:\.[a-z_]+)*)\.([A-Za-z_]\w*)\b", text))
    checked, missing = 0, []
    for module, attribute in sorted(named):
        candidates = modules.get(module)
        if not candidates or attribute == "py":  # a file's name
            continue
        checked += 1
        if not any(defined_in(m, attribute) for m in candidates):
            missing.append(f"{module}.{attribute}")
    assert checked >= 5, "the pattern no longer finds the comments' names"
    assert not missing, f"_fastpath.c's comments name what is gone: {missing}"
