"""The shapes the checker missed on engines it had never seen (issue: what a method does,
not what it is called), as a project of their own.

shapes/flagged/ holds one file per shape: release methods found by behaviour
(`deallocate_pages`, `_free`, `free_pages_resource`), a per-item decrement method
(`page.sub_ref()`), ids read from an attribute of the argument, a normalization line
ahead of an unchecked push, a range-checked release, receivers resolved through a
factory or left unknown, a concatenation of two id lists, a membership filter over
tensor elements. Every `# KVGnnn` comment must be a finding and every finding must have
one. shapes/fixed/ holds their fixed twins: no finding at all. Each is linted as a
project (`kvguard lint`, the project index built from its files), as a user runs it.
"""

import re
import shutil

import pytest

from flake8_kvguard import fuzzcmd, index

from .helpers import run_cli, run_flake8

from pathlib import Path

SHAPES = Path(__file__).parent / "shapes"
FLAGGED = sorted(p.name for p in (SHAPES / "flagged").glob("*.py") if p.name != "__init__.py")


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGUARD_LINT_CACHE_DIR", str(tmp_path / "cache"))
    index.forget()

    def make(kind):
        root = tmp_path / kind
        shutil.copytree(SHAPES / kind, root / "shapes")
        (root / "pyproject.toml").write_text("")
        return root

    yield make
    index.forget()


def _findings(root):
    status, out, err = run_cli(["shapes"], root)
    assert "Traceback" not in err, err
    found = {}
    for line in out.splitlines():
        path, number, _, rest = line.split(":", 3)
        found.setdefault((Path(path).name, int(number)), set()).add(rest.split()[0])
    return status, found, out


def _wanted():
    wanted = {}
    for name in FLAGGED:
        for number, line in enumerate((SHAPES / "flagged" / name).read_text().splitlines(), 1):
            codes = re.findall(r"KVG\d{3}", line.partition("#")[2])
            if codes:
                wanted[(name, number)] = set(codes)
    return wanted


def test_each_shape_is_flagged_where_its_comments_say(project):
    status, found, _ = _findings(project("flagged"))
    assert status == 1
    assert found == _wanted()
    assert {name for name, _ in found} == set(FLAGGED)  # every file holds a finding


def test_the_fixed_twins_have_no_finding(project):
    assert sorted(p.name for p in (SHAPES / "fixed").glob("*.py")) == sorted(
        FLAGGED + ["__init__.py"]
    )
    status, found, out = _findings(project("fixed"))
    assert (status, found) == (0, {}), out


def test_an_allocator_finding_prints_the_fuzz_command_for_its_class(project):
    _, _, out = _findings(project("flagged"))
    lines = [line for line in out.splitlines() if " KVG2" in line]
    assert lines
    by_class = {
        "release_by_behaviour.py:11:": ("PagePool", "duplicate-id", "deallocate_pages"),
        "release_by_behaviour.py:29:": ("ResourcePool", "double-free", "free_pages_resource"),
        "range_checked.py:10:": ("RefPool", "duplicate-id", "release"),
    }
    for where, (cls, clause, method) in by_class.items():
        line = next(line for line in lines if where in line)
        module = "shapes." + where.partition(".py")[0]
        assert line.endswith(fuzzcmd.command(module, cls, line.split()[1], method))
        assert f"kvguard fuzz {module}.{cls} --clause {clause}" in line


def test_unknown_receiver_where_the_candidates_disagree_says_so(project):
    _, _, out = _findings(project("flagged"))
    line = next(line for line in out.splitlines() if "receivers.py:33:" in line)
    assert "KVG101" in line and "receiver's class is unknown" in line


def test_flake8_agrees(project):
    root = project("flagged")
    status, lines = run_flake8(["--select", "KVG", "shapes"], root)
    _, _, out = _findings(root)
    assert sorted(lines) == sorted(out.splitlines())
