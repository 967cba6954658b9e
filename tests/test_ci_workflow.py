"""docs/ci.md's GitHub Actions workflow: valid against a schema of the workflow syntax it uses,
wired together (the SARIF upload reads the file the lint step writes, the artifact is the file
the plugin writes, both uploads run when the step before them fails), and its kvguard commands
run here as written, on a project with a finding and a failing test."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "ci.md"

STEP = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "if": {"type": "string"},
        "uses": {"type": "string", "pattern": r"^[\w.-]+/[\w./-]+@v\d+$"},
        "with": {"type": "object", "additionalProperties": {"type": ["string", "number",
                                                                    "boolean"]}},
        "run": {"type": "string"},
        "env": {"type": "object"},
    },
    "additionalProperties": False,
    "oneOf": [{"required": ["uses"]}, {"required": ["run"]}],
}
WORKFLOW = {
    "type": "object",
    "required": ["name", "on", "jobs"],
    "properties": {
        "name": {"type": "string"},
        "on": {"type": ["object", "array", "string"]},
        "jobs": {
            "type": "object",
            "minProperties": 1,
            "additionalProperties": {
                "type": "object",
                "required": ["runs-on", "steps"],
                "properties": {
                    "runs-on": {"type": "string"},
                    "permissions": {"type": "object", "additionalProperties": {
                        "enum": ["read", "write", "none"]}},
                    "steps": {"type": "array", "minItems": 1, "items": STEP},
                },
                "additionalProperties": False,
            },
        },
    },
    "additionalProperties": False,
}
"""The part of GitHub Actions' workflow syntax the page uses; a key outside it (a typo such as
``runs_on`` or ``sarif-file``) fails the test."""


def workflow() -> dict:
    (text,) = re.findall(r"^```yaml\n(.*?)^```", PAGE.read_text(encoding="utf-8"), re.S | re.M)
    data = yaml.safe_load(text)
    if True in data:  # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return data


def steps(job: dict, uses: str | None = None, runs: str | None = None) -> list:
    return [s for s in job["steps"]
            if (uses is None or s.get("uses", "").startswith(uses + "@"))
            and (runs is None or runs in s.get("run", ""))]


def test_the_workflow_matches_the_schema():
    jsonschema.validate(workflow(), WORKFLOW)
    assert set(workflow()["on"]) == {"push", "pull_request"}


def test_the_schema_rejects_a_misspelt_key():
    broken = workflow()
    broken["jobs"]["lint"]["steps"][-1]["sarif-file"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, WORKFLOW)


def test_lint_uploads_the_sarif_file_it_writes_even_when_it_finds_something():
    lint = workflow()["jobs"]["lint"]
    (step,) = steps(lint, runs="kvguard lint")
    written = re.search(r"--format sarif > (\S+)", step["run"]).group(1)
    (upload,) = steps(lint, uses="github/codeql-action/upload-sarif")
    assert upload["with"]["sarif_file"] == written
    assert upload["if"] == "always()"
    assert lint["permissions"]["security-events"] == "write"
    assert lint["steps"].index(upload) > lint["steps"].index(step)


def test_tests_keep_the_plugins_json_report_as_an_artifact():
    test = workflow()["jobs"]["test"]
    (step,) = steps(test, runs="-p kvguard")
    reports = re.findall(r"--kvguard-report=(\S+)", step["run"])
    (path,) = [r for r in reports if r.endswith(".json")]
    (upload,) = steps(test, uses="actions/upload-artifact")
    assert upload["with"]["path"] == path and upload["if"] == "always()"
    (install,) = steps(test, runs="torch==")
    assert install["run"].index("download.pytorch.org/whl/cpu") < install["run"].index("-e .")


def run_step(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_lint_step_writes_sarif_with_the_finding(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "release.py").write_text(
        "def finish(pool, request):\n"
        "    pool.free([*request.prefix_blocks, *request.new_blocks])\n")
    (step,) = steps(workflow()["jobs"]["lint"], runs="kvguard lint")
    out = run_step(step["run"], tmp_path)
    assert out.returncode == 1, out.stderr  # a finding fails the step
    sarif_file = re.search(r"> (\S+)", step["run"]).group(1)
    sarif = json.loads((tmp_path / sarif_file).read_text())
    assert sarif["version"] == "2.1.0"
    (result,) = sarif["runs"][0]["results"]
    assert result["ruleId"] == "KVG102"
    location = result["locations"][0]["physicalLocation"]
    assert location["artifactLocation"]["uri"].endswith("src/release.py")
    assert location["region"]["startLine"] == 2


def test_the_test_step_writes_the_json_report_and_a_short_log(tmp_path):
    (tmp_path / "test_pool.py").write_text(
        "from kvguard.examples import LinkedFreeList\n\n"
        "def test_aborted():\n"
        "    pool = LinkedFreeList(8)\n"
        "    ids = pool.allocate(2)\n"
        "    pool.free(ids[:1])\n"
        "    pool.free(ids)\n")
    (tmp_path / "conftest.py").write_text(
        "import kvguard\nfrom kvguard.examples import LINKED_FREE_LIST_SPEC\n"
        "kvguard.register('kvguard.examples.LinkedFreeList', LINKED_FREE_LIST_SPEC)\n")
    (step,) = steps(workflow()["jobs"]["test"], runs="-p kvguard")
    assert shlex.split(step["run"])[:3] == ["python", "-m", "pytest"]
    out = run_step(step["run"], tmp_path)
    assert out.returncode == 1, out.stdout[-2000:]
    assert "SUMMARY: kvguard: double-free" in out.stdout and "ERROR: kvguard" not in out.stdout
    report = json.loads((tmp_path / "kvguard-report.json").read_text())
    (violation,) = report["violations"]
    assert violation["kind"] == "double-free" and violation["nodeid"].endswith("test_aborted")
