"""Writes docs/rules.md from the rule modules: `python -m flake8_kvguard.docs`.

Each rule's examples live beside its code (Fixit style); the reference is generated
from them, and the tests both check that docs/rules.md is current and run every
example in it.
"""

from __future__ import annotations

import sys

from .rules import RULES

HEADER = """\
# kvguard lint rules (KVG)

Each rule below comes with the code it flags (**bad**), code it leaves alone
(**good**) and, where `kvguard lint --fix` rewrites it, the result (**fixed**).
Every example on this page runs as a test (`tests/flake8_kvguard/test_rules_doc.py`).
This file is generated from `flake8_kvguard/rules/`: edit the rule module, then run
`python -m flake8_kvguard.docs > docs/rules.md`.

| code | flags | `--fix` |
|---|---|---|
"""


def _doc_body(rule) -> str:
    doc = (rule.__doc__ or "").strip()
    _, _, body = doc.partition("\n\n")
    return " ".join(body.split())


def render() -> str:
    parts = [HEADER]
    for rule in RULES:
        fix = "yes" if rule.FIXABLE else ""
        parts.append(f"| [{rule.CODE}](#{rule.CODE.lower()}) | {rule.SUMMARY} | {fix} |\n")
    for rule in RULES:
        parts.append(f"\n## {rule.CODE}\n\n{rule.SUMMARY[0].upper()}{rule.SUMMARY[1:]}.\n\n")
        parts.append(f"{_doc_body(rule)}\n\n")
        message = rule.MESSAGE.split(" ", 1)[1]
        parts.append(f"Message: `{message}`\n")
        fixed = getattr(rule, "FIXED", None) or [None] * len(rule.BAD)
        for number, (bad, after) in enumerate(zip(rule.BAD, fixed), 1):
            parts.append(f"\nBad ({number}):\n\n```python bad {rule.CODE}\n{bad}```\n")
            if after is not None:
                parts.append(f"\nFixed ({number}):\n\n```python fixed {rule.CODE}\n{after}```\n")
        for number, good in enumerate(rule.GOOD, 1):
            parts.append(f"\nGood ({number}):\n\n```python good {rule.CODE}\n{good}```\n")
    return "".join(parts)


if __name__ == "__main__":
    sys.stdout.write(render())
