"""The command line and the import-cost contract, run as a user would: in subprocesses."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(*args, **kwargs):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          **kwargs)


def test_import_kvguard_loads_no_heavy_modules():
    code = ("import sys, kvguard; heavy = [m for m in ('torch', 'numpy', 'pytest', 'flake8', "
            "'libcst', 'flake8_kvguard', 'pytest_kvguard') if m in sys.modules]; print(heavy)")
    out = run("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_demo_shows_the_seed_bug_then_the_report():
    out = run("-m", "kvguard", "demo")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "allocate(2)      -> [0, -1]" in text, "the unguarded replay shows the corruption"
    assert "ERROR: kvguard: duplicate-id of block 0" in text
    assert "SUMMARY: kvguard: duplicate-id" in text and "demo.py" in text
    for kind in ("bool-id", "consumed-iterable", "double-free", "invalid-id", "foreign-id"):
        assert f"-> {kind}" in text
    short = run("-c", "import sys; from kvguard.cli import main; main(['demo', '--short']); "
                      "print('torch' in sys.modules)")
    assert "SUMMARY: kvguard: duplicate-id" in short.stdout and "==ERROR" not in short.stdout
    assert short.stdout.splitlines()[-1] == "False", "the demo runs without torch"


@pytest.mark.parametrize("argv, message", [
    (["bogus"], "unknown command 'bogus'"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_command_line_mistakes_are_one_line(argv, message):
    out = run("-m", "kvguard", *argv)
    assert out.returncode == 2
    assert message in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_help_and_version():
    out = run("-m", "kvguard", "--help")
    assert out.returncode == 0 and "demo" in out.stdout and "lint" in out.stdout
    assert run("-m", "kvguard", "--version").stdout.startswith("kvguard ")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["demo"], ["run", "--help"]])
def test_output_into_a_closed_pipe_ends_quietly(argv):
    # `kvguard --help | head -1`: the reader is gone before the command writes. Its read end is
    # closed before the command starts, so the write fails every time, not by a race.
    import os
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([sys.executable, "-m", "kvguard", *argv], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
    assert out.stderr == ""
    assert out.returncode in (0, 1)


def test_the_demo_ends_with_what_to_try_next():
    out = run("-m", "kvguard", "demo", "--short")
    tail = out.stdout.strip().splitlines()[-5:]
    assert tail[0] == "What to try next:"
    commands = [line.split("  ")[1].strip() for line in tail[1:]]
    assert commands[:3] == ["pytest -p kvguard", "kvguard lint src/",
                            "kvguard run -- python serve.py"]
    assert "docs/reference.md" in tail[-1]


def test_fuzz_imports_the_projects_own_module_from_the_working_directory(tmp_path):
    """``kvguard fuzz mypool.Pool`` in the project's directory finds ``mypool.py`` there, as
    ``python -m`` would: the console script's own directory is what Python puts on its path."""
    project, bin_dir = tmp_path / "project", tmp_path / "bin"
    project.mkdir()
    bin_dir.mkdir()
    (project / "mypool.py").write_text(
        "class Pool:\n"
        "    def __init__(self, n):\n        self.free_ids = list(range(n))\n"
        "    def allocate(self, n):\n"
        "        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]\n        return out\n"
        "    def free(self, ids):\n        self.free_ids.extend(ids)\n"
        "    def count(self):\n        return len(self.free_ids)\n")
    (project / "specs.py").write_text("import kvguard\n"
                                      "SPEC = kvguard.AllocatorSpec(free_count='count')\n")
    (bin_dir / "kvguard").write_text("import sys\nfrom kvguard.cli import main\n"
                                      "sys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(bin_dir / "kvguard"), "fuzz", "mypool.Pool",
                          "--factory", "cls(8)", "--spec", "specs.SPEC", "--clause", "duplicate-id",
                          "--examples", "5"],
                         cwd=project, env=env, capture_output=True, text=True, timeout=120)
    assert "cannot import" not in out.stderr, out.stderr
    assert out.returncode == 1 and "duplicate-id" in out.stdout, out.stdout + out.stderr


def test_help_keeps_names_whole_and_paragraphs_apart():
    """``kvguard fuzz --help`` breaks no dotted class name across lines, ``kvguard run --help``
    gives each environment variable a paragraph of its own (it was one 25-line paragraph), and
    ``kvguard replay --help`` says what FILE is."""
    from kvguard.conformance.fuzz import TARGETS
    from kvguard.staging import VARIABLES
    env = {**os.environ, "COLUMNS": "80"}
    fuzz = run("-m", "kvguard", "fuzz", "--help", env=env).stdout
    words = set(fuzz.replace(",", " ").replace(".\n", " ").split())
    assert all(name in words or name + "." in words for name in TARGETS), fuzz
    staged = run("-m", "kvguard", "run", "--help", env=env).stdout
    paragraphs = staged.split("\n\n")
    for name in VARIABLES:
        assert any(p.startswith(f"{name}: ") for p in paragraphs), name
    replay = run("-m", "kvguard", "replay", "--help", env=env).stdout
    assert "FILE" in replay and "a staging log" in replay
