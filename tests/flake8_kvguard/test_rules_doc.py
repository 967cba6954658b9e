"""docs/rules.md: generated from the rule modules, and every example in it runs.

Blocks are fenced as ```python bad KVGnnn / good KVGnnn / fixed KVGnnn: a bad example
must be flagged with its code, a good one must produce no finding at all, and `--fix`
must turn each bad example into the fixed block that follows it (or leave it as it is
when none follows).
"""

import re

import pytest

from flake8_kvguard import docs
from flake8_kvguard.rules import BY_CODE, RULES

from .helpers import REPO, codes, fix

RULES_MD = REPO / "docs" / "rules.md"
BLOCK = re.compile(r"```python (bad|good|fixed) (KVG\d{3})\n(.*?)```", re.S)


def _blocks():
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(RULES_MD.read_text())]


def _cases():
    cases, last_bad = [], None
    for kind, code, source in _blocks():
        if kind == "bad":
            last_bad = (code, source)
            cases.append(("bad", code, source, None))
        elif kind == "fixed":
            assert last_bad is not None and last_bad[0] == code
            cases[-1] = ("bad", code, last_bad[1], source)
        else:
            cases.append(("good", code, source, None))
    return cases


def test_rules_md_is_generated_from_the_rules():
    assert (
        RULES_MD.read_text() == docs.render()
    ), "run: python -m flake8_kvguard.docs > docs/rules.md"


def test_every_rule_is_documented_with_examples():
    blocks = _blocks()
    for rule in RULES:
        kinds = {kind for kind, code, _ in blocks if code == rule.CODE}
        assert {"bad", "good"} <= kinds, rule.CODE
        if rule.FIXABLE:
            assert "fixed" in kinds, rule.CODE
        assert f"## {rule.CODE}" in RULES_MD.read_text()


@pytest.mark.parametrize(
    "kind,code,source,fixed",
    _cases(),
    ids=lambda v: v if isinstance(v, str) and len(v) < 8 else None,
)
def test_example(kind, code, source, fixed):
    found = codes(source)
    if kind == "good":
        assert found == [], found
        assert fix(source) == source
        return
    assert code in found
    expected = fixed if fixed is not None else source
    assert fix(source, select=(code,)) == expected


def test_messages_say_what_is_wrong_and_what_to_do():
    for rule in RULES:
        assert rule.MESSAGE.startswith(rule.CODE + " ")
        assert ";" in rule.MESSAGE, f"{rule.CODE}: the message should end with what to do"
        assert BY_CODE[rule.CODE] is rule
