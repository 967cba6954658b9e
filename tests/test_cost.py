"""docs/cost.md is the one source of kvguard's cost figures, written by the benchmarks.

Each benchmark script owns a section of the page and rewrites it with ``--write-docs``
(``benchmarks/results.py``); README links the page instead of quoting figures, and no
benchmark's docstring sends a reader to notes the repository does not have."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
PAGE = REPO / "docs" / "cost.md"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.stem.startswith(("bench_", "gpu_")))

sys.path.insert(0, str(BENCHMARKS))
import results  # noqa: E402


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_benchmark_writes_its_own_section(script):
    source = script.read_text(encoding="utf-8")
    assert "results.main(main" in source, f"{script.name}: end with sys.exit(results.main(main))"
    page = PAGE.read_text(encoding="utf-8")
    assert f"<!-- bench: {script.stem} -->" in page and f"<!-- /bench: {script.stem} -->" in page
    docstring = source.split('"""')[1]
    assert not re.search(r"\bnotes?\b|closing|issue \d", docstring, re.I), (
        f"{script.name}: its docstring points to notes a user does not have")


def test_readme_links_the_cost_page_and_quotes_no_figure():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    cost = readme[readme.index("\n## Cost"):]
    cost = cost[:cost.index("\n## ", 1)]
    assert "(docs/cost.md)" in cost
    assert not re.search(r"\d\.\d+ ?[x×]|\d+ ?us\b|\d+ bytes", cost), cost


def test_write_replaces_one_section_and_keeps_the_rest(tmp_path):
    page = tmp_path / "cost.md"
    page.write_text("# Cost\n\nintro\n\n<!-- bench: a -->\nold a\n<!-- /bench: a -->\n\n"
                    "<!-- bench: b -->\nold b\n<!-- /bench: b -->\n")
    results.write("a", "python benchmarks/a.py --rounds 3", "ratio 1.10x\n", page)
    text = page.read_text()
    assert "old a" not in text and "old b" in text and "intro" in text
    (section,) = re.findall(r"<!-- bench: a -->.*?<!-- /bench: a -->", text, re.S)
    assert "`python benchmarks/a.py --rounds 3`" in section and "ratio 1.10x" in section
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", section)
    assert f"{os.cpu_count()} cores" in section and "Python 3." in section
    results.write("c", "python benchmarks/c.py", "c figures\n", page)
    assert page.read_text().endswith("<!-- /bench: c -->\n") and "## `c`" in page.read_text()


def test_a_benchmark_run_with_write_docs_records_what_it_printed(tmp_path):
    page = tmp_path / "cost.md"
    page.write_text(PAGE.read_text(encoding="utf-8"))
    # An empty engine cache leaves DeepSpeed's part out: the run stays short.
    env = {**os.environ, "KVGUARD_COST_PAGE": str(page), "PYTHONPATH": str(REPO),
           "KVGUARD_ENGINE_CACHE": str(tmp_path / "no-engines")}
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_guard.py"), "--rounds", "1",
                          "--steps", "200", "--write-docs"], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    (section,) = re.findall(r"<!-- bench: bench_guard -->.*?<!-- /bench: bench_guard -->",
                            page.read_text(), re.S)
    assert "`python benchmarks/bench_guard.py --rounds 1 --steps 200`" in section
    for line in out.stdout.strip().splitlines():
        assert line in section
    assert "<!-- bench: bench_staging -->" in page.read_text(), "the other sections are kept"


def test_a_mode_flag_gets_a_section_of_its_own(tmp_path, monkeypatch, capsys):
    page = tmp_path / "cost.md"
    page.write_text("# Cost\n\n<!-- bench: bench_x -->\ntimed\n<!-- /bench: bench_x -->\n")
    monkeypatch.setenv("KVGUARD_COST_PAGE", str(page))
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_x.py"])

    def run():
        print("counted" if "--instructions" in sys.argv else "timed again")
        return 0

    assert results.main(run, ["--instructions", "--write-docs"], modes=("--instructions",)) == 0
    text = page.read_text()
    assert "timed\n" in text, "the timed section is left alone"
    (section,) = re.findall(r"<!-- bench: bench_x-instructions -->.*?"
                            r"<!-- /bench: bench_x-instructions -->", text, re.S)
    assert "counted" in section and "--instructions" in section
