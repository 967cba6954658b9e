"""Every code block in README.md and docs/*.md runs as written, as a newcomer would paste it.

Blocks fenced ```python, ```sh, ```shell, ```bash or ```console are run in a fresh temporary
directory, with this checkout first on PYTHONPATH and the running interpreter's scripts
(``python``, ``kvguard``, ``flake8``) first on PATH: a Python block as a script, a shell block as
one bash script that stops at the first failing line, a console block command by command (its
``$ `` lines; the other lines are the output shown). Each must exit 0. Every page under docs/ is
picked up, so a new page is tested the day it lands. Other languages (toml, ini, reports) are
not run; the rule examples of docs/rules.md (```python bad KVG101 ...) have their own test.

An HTML comment on the line just before a block says how to treat it (several, separated by
``;``; ``skip`` takes the rest of the comment as its reason)::

    <!-- snippet: skip REASON -->     not run: an illustrative fragment, a download, a GPU, ...
    <!-- snippet: file NAME -->       not run: written to NAME for the page's later blocks
    <!-- snippet: continues -->       a Python block run after the page's previous Python block
    <!-- snippet: needs deepspeed --> run with DeepSpeed's allocator module on PYTHONPATH, from
                                      the engine download (skipped without it)
    <!-- snippet: exit N -->          a command of the block may exit N as well as 0

docs/reference.md says the same for documentation writers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUN = ("python", "sh", "shell", "bash", "console")
FENCE = re.compile(r"^```([\w-]*)([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*snippet:\s*(.*?)\s*-->\s*$")
TIMEOUT = 120


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    text: str
    marks: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def parse_marks(text: str) -> dict:
    """``word args; word args``; ``skip`` takes the rest of the comment as its reason."""
    marks = {}
    while text.strip():
        part, _, text = text.strip().partition(";")
        word, _, rest = part.strip().partition(" ")
        if word not in ("skip", "file", "continues", "needs", "exit"):
            raise ValueError(f"unknown snippet marker {word!r} in {part!r}")
        if word == "skip":
            rest, text = ";".join(filter(None, [rest, text])), ""
        marks.setdefault(word, []).append(rest.strip())
    return marks


def blocks(page: Path) -> list[Block]:
    """The page's runnable blocks in order, each with the marker on the line just before it."""
    source = page.read_text(encoding="utf-8")
    found = []
    for m in FENCE.finditer(source):
        lang, info = m.group(1), m.group(2).strip()
        if lang not in RUN or info:
            continue
        before = source[:m.start()].rstrip("\n").rpartition("\n")[2]
        marker = MARKER.match(before.strip())
        line = source.count("\n", 0, m.start()) + 1
        found.append(Block(page, line, lang, m.group(3), parse_marks(marker.group(1))
                           if marker else {}))
    return found


ALL = [b for page in pages() for b in blocks(page)]


def deepspeed_tree(tmp: Path) -> Path:
    """A package tree holding DeepSpeed 0.19.8's real ``blocked_allocator.py`` (read out of the
    engine download, as tests/kvguard/adapters do) under its real dotted name, empty parents
    above it."""
    from tests.kvguard.adapters.engines import archive, source
    allocator = source(archive("deepspeed"), "deepspeed/inference/v2/ragged/blocked_allocator.py")
    root = tmp / "_engines"
    package = root / "deepspeed" / "inference" / "v2" / "ragged"
    package.mkdir(parents=True)
    for directory in (package, *package.parents):
        if directory == root:
            break
        (directory / "__init__.py").touch()
    (package / "blocked_allocator.py").write_text(allocator.read_text())
    return root


def environment(tmp: Path, block: Block) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    path = [str(REPO)]
    for need in block.marks.get("needs", []):
        if need != "deepspeed":
            raise ValueError(f"{block.name}: no provider for 'needs {need}'")
        path.append(str(deepspeed_tree(tmp)))
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p])
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    if "KVGUARD_ENGINE_CACHE" in os.environ:
        env["KVGUARD_ENGINE_CACHE"] = os.environ["KVGUARD_ENGINE_CACHE"]
    env["HOME"] = str(tmp / "home")
    return env


def python_source(block: Block) -> str:
    """The block, after the page's previous Python block when it says it continues it."""
    if "continues" not in block.marks:
        return block.text
    earlier = [b for b in blocks(block.page) if b.lang == "python" and b.line < block.line]
    assert earlier, f"{block.name} continues no earlier Python block"
    return python_source(earlier[-1]) + "\n" + block.text


def console_commands(text: str) -> list[str]:
    commands = []
    for line in text.splitlines():
        if line.startswith("$ "):
            commands.append(line[2:])
        elif commands and commands[-1].endswith("\\"):
            commands[-1] = commands[-1][:-1] + line
    return commands


def sh(command: str, tmp: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)


@pytest.mark.parametrize("block", ALL, ids=[b.name for b in ALL])
def test_snippet_runs_as_written(block, tmp_path):
    if "skip" in block.marks:
        pytest.skip(f"{block.name}: marked skip: {'; '.join(block.marks['skip'])}")
    if "file" in block.marks:
        pytest.skip(f"{block.name}: the file {block.marks['file'][0]} for later blocks")
    (tmp_path / "home").mkdir()
    for earlier in blocks(block.page):
        if earlier.line < block.line and "file" in earlier.marks:
            (tmp_path / earlier.marks["file"][0]).write_text(earlier.text)
    env = environment(tmp_path, block)
    allowed = {0, *(int(n) for n in block.marks.get("exit", []))}
    if block.lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(python_source(block))
        runs = [subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=TIMEOUT)]
    elif block.lang == "console":
        commands = console_commands(block.text)
        assert commands, f"{block.name}: a console block without a '$ ' command"
        runs = [sh(command, tmp_path, env) for command in commands]
    else:
        runs = [sh("set -e\n" + block.text, tmp_path, env)]
    for run in runs:
        assert run.returncode in allowed, (
            f"{block.name} exited {run.returncode}:\n{run.args}\n{run.stdout[-2000:]}"
            f"\n{run.stderr[-3000:]}")


def test_markers_are_known_and_every_page_is_found():
    assert {p.name for p in pages()} >= {"README.md", "reference.md", "staging.md"}
    for page in pages():
        source = page.read_text(encoding="utf-8")
        for m in re.finditer(r"^<!--\s*snippet:(.*?)-->[ \t]*$", source, re.M):
            parse_marks(m.group(1))  # an unknown word raises
            after = source[m.end():].lstrip(" \t")
            assert after.startswith("\n```"), (
                f"{page.name}: a snippet marker must stand on the line just before its block")


def test_parse_and_console_helpers():
    assert parse_marks("exit 1; skip a GPU; CUDA") == {"skip": ["a GPU; CUDA"], "exit": ["1"]}
    with pytest.raises(ValueError):
        parse_marks("skipp")
    assert console_commands("$ a \\\n  b\nout\n$ c\n") == ["a   b", "c"]
