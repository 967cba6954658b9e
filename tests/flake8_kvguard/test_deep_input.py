"""Deep input never kills the checker (depth.py).

libcst's parser overflows its stack (SIGSEGV, no output) on 20,000 `and` operands, 3,000
parentheses or 5,000 nested lambdas, and takes minutes over 20,000 unary operators or
chained calls. Each generated file runs in a subprocess with a timeout, so that a
regression fails here instead of killing the test run.
"""

import os
import subprocess
import sys

import pytest

from flake8_kvguard import config, depth, engine, index

from .helpers import REPO, run_flake8

FREE = "import torch\n\ndef f(alloc):\n    alloc.free(torch.arange(3))\n"

DEEP = {
    "and_20000": "x = " + " and ".join(["a"] * 20_000) + "\n",
    "parentheses_3000": "x = " + "(" * 3_000 + "a" + ")" * 3_000 + "\n",
    "lambdas_5000": "x = " + "lambda: " * 5_000 + "a\n",
    "unary_20000": "x = " + "-" * 20_000 + "a\n",
    "calls_20000": "x = a" + "()" * 20_000 + "\n",
    "methods_20000": "x = a" + ".b()" * 20_000 + "\n",
    "not_20000": "x = " + "not " * 20_000 + "a\n",
    "multiline_sum_20000": "x = (\n" + " +\n".join(["    a"] * 20_000) + "\n)\n",
    "multiline_or_20000": "x = (\n" + " or\n".join(["    a"] * 20_000) + "\n)\n",
}
# Python's own parser accepts only and_20000 and multiline_or_20000: it rejects
# parentheses_3000 (too many nested parentheses, not Python: no KVG line, flake8 says
# E999) and cannot build the rest (RecursionError, MemoryError): still code, so KVG000.


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module")
def deep_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep")
    (root / "setup.cfg").write_text("[metadata]\n")
    for name, body in DEEP.items():
        # A free call first, so that the pre-filter sends the file on to parsing.
        (root / f"{name}.py").write_text("alloc.free(ids)\n" + body)
    (root / "findings.py").write_text(FREE)
    return root


@pytest.mark.parametrize("name", sorted(DEEP))
def test_each_deep_file_is_skipped_with_one_line(deep_files, name):
    done = subprocess.run(
        [sys.executable, "-m", "flake8_kvguard", f"{name}.py"],
        cwd=deep_files,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    if name == "parentheses_3000":
        assert lines == []  # not Python: flake8 reports it as E999
    else:
        assert len(lines) == 1 and " KVG000 file not checked: " in lines[0], lines
        assert lines[0].startswith(f"{name}.py:2:1: ")


def test_deep_files_do_not_take_other_findings_down(deep_files):
    done = subprocess.run(
        [sys.executable, "-m", "flake8_kvguard", "."],
        cwd=deep_files,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert done.returncode == 1, done.stderr[-2000:]
    codes = sorted(line.split(" ")[1] for line in done.stdout.splitlines())
    assert codes == ["KVG000"] * (len(DEEP) - 1) + ["KVG101"]


def test_flake8_with_two_jobs_reports_the_other_files(deep_files):
    # flake8 itself fails on the files its own ast.parse cannot build; the two it
    # parses reach the plugin. With -j 2 a crashed worker used to hang the pool.
    status, lines = run_flake8(
        ["--select", "KVG,E999", "-j", "2", "and_20000.py", "multiline_or_20000.py",
         "parentheses_3000.py", "findings.py"],
        deep_files,
        env={"PYTHONPATH": _env()["PYTHONPATH"]},
    )
    assert status == 1
    assert [" ".join(line.split(" ")[:2]) for line in lines] == [
        "and_20000.py:2:1: KVG000",
        "findings.py:4:16: KVG101",
        "multiline_or_20000.py:2:1: KVG000",
        "parentheses_3000.py:2:206: E999",
    ]


def test_the_estimate_keeps_flat_data_and_real_code():
    flat = "table = [" + ", ".join(["-1", "a.b.c", "f(x)"] * 5_000) + "]\n"
    assert depth.too_deep(flat) is None
    strings = 'doc = """' + "(" * 5_000 + '"""\n# ' + "[" * 5_000 + "\ns = '" + "{" * 500 + "'\n"
    assert depth.too_deep(strings) is None
    assert depth.too_deep("x = " + " and ".join(["a"] * 150) + "\n") is None
    assert depth.too_deep("x = " + " and ".join(["a"] * 250) + "\n") == (
        1,
        "an expression nested more than 200 deep",
    )
    lines = "y = 1\n" * 7 + "z = " + "(" * 300 + ")" * 300 + "\n"
    assert depth.too_deep(lines)[0] == 8


def test_a_deep_file_is_not_parsed_and_not_fixed():
    source = "import torch\nalloc.free(torch.arange(3))\nx = " + "-" * 20_000 + "a\n"
    assert engine.parse(source) is None
    found = engine.lint_source(source, config.DEFAULT, index.EMPTY)
    assert [(f.code, f.line) for f in found] == [("KVG000", 3)]
    from flake8_kvguard import fixer

    assert fixer.fix_source(source.encode(), config.DEFAULT, index.EMPTY) == (source.encode(), 0)


DEEP_IN_EVERY_PLACE = {
    "statement": "x = 1\ny = " + " + ".join(["a"] * 250) + "\n",
    "decorator": "@d(" + " + ".join(["a"] * 250) + ")\ndef f():\n    pass\n",
    "signature": "def f(x=" + " or ".join(["a"] * 250) + "):\n    pass\n",
    "nested": "class C:\n    def f(self):\n        if a:\n            y = " + "-" * 250 + "a\n",
    "elif": "if a:\n    pass\nelif " + " and ".join(["b"] * 250) + ":\n    pass\n",
    "except": "try:\n    pass\nexcept (" + ", ".join(["E." * 250 + "E"]) + "):\n    pass\n",
    "case": "match x:\n    case 1 if " + " and ".join(["a"] * 250) + ":\n        pass\n",
    "with": "with " + "f(" * 150 + ")" * 150 + ":\n    pass\n",
    "flat": "table = [" + ", ".join(["-1", "a.b.c", "f(x)"] * 2_000) + "]\n",
    "near": "x = " + " + ".join(["a"] * 200) + "\n",
    "over": "x = " + " + ".join(["a"] * 202) + "\n",
    "one_line_suite": "if a: y = " + " + ".join(["a"] * 250) + "\n",
    # "\r" alone ends no statement for the scan: two statements of 120 add up.
    "carriage_returns": ("x = " + " + ".join(["a"] * 120) + "\r") * 2,
}


@pytest.mark.parametrize("name", sorted(DEEP_IN_EVERY_PLACE) + sorted(DEEP))
def test_the_bound_from_the_tree_gives_the_scans_answer(name):
    """With Python's tree, too_deep() skips the scan where no statement can reach the
    limit: the answer is the scan's, wherever the deep part sits."""
    import ast

    text = DEEP_IN_EVERY_PLACE.get(name) or ("alloc.free(ids)\n" + DEEP[name])
    try:
        tree = ast.parse(text)
    except (SyntaxError, RecursionError, MemoryError):
        pytest.skip("Python cannot build its tree: the scan alone decides")
    assert depth.too_deep(text, tree=tree) == depth.too_deep(text)
    if name in ("flat", "near"):
        assert depth.too_deep(text) is None
    elif name in DEEP_IN_EVERY_PLACE:
        assert depth.too_deep(text) is not None, name
