"""Golden files, TorchFix style.

fixtures/<rule>/checker/NAME.py is checked and its findings compared with NAME.txt
(`line:col: message`, columns 1-based as flake8 prints them); every `# KVGnnn` comment
in a fixture must match a finding on its line and every finding needs such a comment.
fixtures/<rule>/codemod/NAME.py is rewritten by `--fix` and compared with NAME.py.out,
and fixing that output again changes nothing.

Set KVGUARD_UPDATE_GOLDEN=1 to rewrite the .txt/.out files from the current output
(then review the diff).
"""

import os
import re

import pytest

from flake8_kvguard import config, engine, index

from .helpers import FIXTURES, fix

UPDATE = os.environ.get("KVGUARD_UPDATE_GOLDEN") == "1"
CHECKER = sorted(FIXTURES.glob("*/checker/*.py"))
CODEMOD = sorted(FIXTURES.glob("*/codemod/*.py"))


def _findings(source):
    return engine.lint_source(source, config.DEFAULT, index.EMPTY)


def _annotated(source):
    """{line: codes} from the `# KVGnnn` comments ("not KVGnnn" excluded)."""
    wanted = {}
    for number, line in enumerate(source.splitlines(), 1):
        comment = line.partition("#")[2]
        codes = [c for c in re.findall(r"KVG\d{3}", comment) if f"not {c}" not in comment]
        if codes:
            wanted[number] = sorted(set(codes))
    return wanted


@pytest.mark.parametrize("path", CHECKER, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_checker_golden(path):
    source = path.read_text()
    found = _findings(source)
    rendered = "".join(f"{f.line}:{f.col + 1}: {f.message}\n" for f in found)
    expected_path = path.with_suffix(".txt")
    if UPDATE:
        expected_path.write_text(rendered)
    assert rendered == expected_path.read_text()


@pytest.mark.parametrize("path", CHECKER, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_checker_matches_comments(path):
    source = path.read_text()
    got = {}
    for finding in _findings(source):
        got.setdefault(finding.line, set()).add(finding.code)
    assert {line: sorted(codes) for line, codes in got.items()} == _annotated(source)


def test_every_rule_has_checker_fixtures():
    from flake8_kvguard.rules import RULES

    for rule in RULES:
        directory = FIXTURES / rule.CODE.lower() / "checker"
        assert any(directory.glob("*.py")), rule.CODE
        if rule.FIXABLE:
            assert any((FIXTURES / rule.CODE.lower() / "codemod").glob("*.py")), rule.CODE


@pytest.mark.parametrize("path", CODEMOD, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_codemod_golden(path):
    source = path.read_text()
    fixed = fix(source)
    expected_path = path.with_name(path.name + ".out")
    if UPDATE:
        expected_path.write_text(fixed)
    assert fixed == expected_path.read_text()
    assert fix(fixed) == fixed, "--fix is not idempotent"
