"""How `kvguard lint` prints findings: text (as flake8 does), JSON or SARIF."""

from __future__ import annotations

import json
import os

from . import __version__

FORMATS = ("text", "json", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


class Located:
    """A finding in a file, as printed: 1-based line and column."""

    __slots__ = ("path", "line", "column", "code", "message", "fixable")

    def __init__(self, path, finding):
        self.path = path
        self.line = finding.line
        self.column = finding.col + 1
        self.code = finding.code
        self.message = finding.message
        self.fixable = finding.fix is not None

    def as_dict(self):
        return {
            "path": self.path,
            "line": self.line,
            "column": self.column,
            "code": self.code,
            "message": self.message,
            "fixable": self.fixable,
        }


def text(findings) -> str:
    return "".join(f"{f.path}:{f.line}:{f.column}: {f.message}\n" for f in findings)


def as_json(findings) -> str:
    return json.dumps([f.as_dict() for f in findings], indent=2) + "\n"


def sarif(findings, rules) -> str:
    index = {rule.CODE: position for position, rule in enumerate(rules)}
    driver = {
        "name": "kvguard",
        "version": __version__,
        "rules": [
            {
                "id": rule.CODE,
                "name": rule.__name__.rpartition(".")[2],
                "shortDescription": {"text": rule.SUMMARY},
                "fullDescription": {
                    "text": " ".join((rule.__doc__ or "").split("\n\n", 1)[-1].split())
                },
                "defaultConfiguration": {"level": "warning"},
            }
            for rule in rules
        ],
    }
    results = []
    for finding in findings:
        results.append(
            {
                "ruleId": finding.code,
                "ruleIndex": index.get(finding.code, -1),
                "level": "warning",
                "message": {"text": finding.message[len(finding.code) + 1 :]},
                "locations": [
                    {
                        "physicalLocation": {
                            "artifactLocation": {"uri": finding.path.replace(os.sep, "/")},
                            "region": {"startLine": finding.line, "startColumn": finding.column},
                        }
                    }
                ],
            }
        )
    log = {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{"tool": {"driver": driver}, "results": results}],
    }
    return json.dumps(log, indent=2) + "\n"
