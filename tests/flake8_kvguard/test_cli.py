"""`kvguard lint` (flake8_kvguard.cli.main): exit codes, errors, formats, config, --fix."""

import json
import os
import subprocess
import sys

import pytest

from flake8_kvguard import cli, engine

from .helpers import REPO, run_cli, write_project

BAD = """\
import torch


def flush(allocator, ids: torch.Tensor) -> None:
    allocator.free(ids)
"""
CLEAN = "def flush(allocator, ids: list) -> None:\n    allocator.free(ids)\n"


def test_exit_status_0_when_clean_1_with_findings(tmp_path):
    write_project(tmp_path, {"clean.py": CLEAN, "bad.py": BAD})
    assert run_cli(["clean.py"], tmp_path) == (0, "", "")
    status, out, err = run_cli(["."], tmp_path)
    assert status == 1 and err == ""
    assert out.startswith("./bad.py:5:20: KVG101 free() gets a torch.Tensor")


@pytest.mark.parametrize(
    "args,message",
    [
        (["missing.py"], "kvguard lint: error: missing.py: no such file or directory\n"),
        (["--bogus", "."], "kvguard lint: error: unrecognized arguments: --bogus\n"),
        (["--select", "KVG999", "."], "kvguard lint: error: --select: unknown code 'KVG999'"),
        (["--select", ",", "."], "kvguard lint: error: --select: no codes given\n"),
        (["--format", "xml", "."], "kvguard lint: error: argument --format: invalid choice"),
        ([], "kvguard lint: error: the following arguments are required: PATH\n"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(tmp_path, args, message):
    write_project(tmp_path, {"bad.py": BAD})
    status, out, err = run_cli(args, tmp_path)
    assert status == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_unreadable_file_is_reported_and_the_rest_still_checked(tmp_path, monkeypatch):
    write_project(tmp_path, {"secret.py": BAD, "bad.py": BAD})
    real_open = os.open

    def guarded_open(path, *args, **kwargs):
        if str(path).endswith("secret.py"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)
    status, out, err = run_cli(["bad.py", "secret.py"], tmp_path)
    assert status == 2
    assert err == "kvguard lint: secret.py: cannot read: Permission denied\n"
    assert out.startswith("bad.py:5:20: KVG101")


def test_internal_errors_never_show_a_traceback(tmp_path, monkeypatch):
    write_project(tmp_path, {"bad.py": BAD})

    def explode(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "analyze", explode)
    status, out, err = run_cli(["bad.py"], tmp_path)
    assert status == 2
    assert err == "kvguard lint: internal error: RuntimeError: boom (please report it)\n"


def test_odd_files(tmp_path):
    write_project(tmp_path, {})
    (tmp_path / "empty.py").write_bytes(b"")
    (tmp_path / "latin1.py").write_bytes(
        b"# -*- coding: latin-1 -*-\nimport torch\n\xe9 = torch.arange(3)\nalloc.free(\xe9)\n"
    )
    (tmp_path / "broken.py").write_bytes(
        b"import torch\nx = '\xff\xfe'\nalloc.free(torch.arange(3))\n"
    )
    (tmp_path / "syntax.py").write_text("import torch\ndef free(self, x:\n")
    (tmp_path / "crlf.py").write_bytes(BAD.replace("\n", "\r\n").encode())
    (tmp_path / "bom.py").write_bytes(b"\xef\xbb\xbf" + BAD.encode())
    (tmp_path / "skipped.py").write_text("# flake8: noqa\n" + BAD)
    status, out, err = run_cli(["."], tmp_path)
    assert status == 1
    assert err == "kvguard lint: ./broken.py: skipped: cannot decode it as Python source\n"
    assert sorted(line.split(": ")[0] for line in out.splitlines()) == [
        "./bom.py:5:20",
        "./crlf.py:5:20",
        "./latin1.py:4:12",
    ]


def test_select_prefixes(tmp_path):
    source = BAD + "    allocator.free(True)\n"
    write_project(tmp_path, {"bad.py": source})
    assert {line.split()[1] for line in run_cli(["bad.py"], tmp_path)[1].splitlines()} == {
        "KVG101",
        "KVG103",
    }
    assert {
        line.split()[1]
        for line in run_cli(["--select", "kvg103", "bad.py"], tmp_path)[1].splitlines()
    } == {"KVG103"}
    assert {
        line.split()[1]
        for line in run_cli(["--select", "KVG1", "bad.py"], tmp_path)[1].splitlines()
    } == {"KVG101", "KVG103"}
    assert run_cli(["--select", "KVG2", "bad.py"], tmp_path)[0] == 0


def test_json_format(tmp_path):
    write_project(tmp_path, {"bad.py": BAD})
    status, out, _ = run_cli(["--format", "json", "bad.py"], tmp_path)
    assert status == 1
    [finding] = json.loads(out)
    assert finding == {
        "path": "bad.py",
        "line": 5,
        "column": 20,
        "code": "KVG101",
        "message": finding["message"],
        "fixable": True,
    }
    assert finding["message"].startswith("KVG101 free() gets a torch.Tensor")
    assert (
        json.loads(run_cli(["--format", "json", "bad.py", "--select", "KVG2"], tmp_path)[1]) == []
    )


def test_sarif_format(tmp_path):
    write_project(tmp_path, {"pkg/bad.py": BAD})
    status, out, _ = run_cli(["--format", "sarif", "pkg"], tmp_path)
    assert status == 1
    log = json.loads(out)
    assert log["version"] == "2.1.0"
    [run] = log["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [rule["id"] for rule in rules] == [
        "KVG101",
        "KVG102",
        "KVG103",
        "KVG104",
        "KVG105",
        "KVG106",
        "KVG201",
        "KVG202",
        "KVG203",
        "KVG204",
        "KVG205",
    ]
    [result] = run["results"]
    assert result["ruleId"] == "KVG101" and rules[result["ruleIndex"]]["id"] == "KVG101"
    location = result["locations"][0]["physicalLocation"]
    assert location == {
        "artifactLocation": {"uri": "pkg/bad.py"},
        "region": {"startLine": 5, "startColumn": 20},
    }
    assert result["message"]["text"].startswith("free() gets a torch.Tensor")


def test_pyproject_configuration(tmp_path):
    source = "def release(pool, table) -> None:\n    pool.drop_blocks(table.block_ids())\n"
    pyproject = '[tool.kvguard]\nfree-names = ["drop_blocks"]\ntensor-functions = ["block_ids"]\n'
    write_project(tmp_path, {"pyproject.toml": pyproject, "mod.py": source})
    status, out, _ = run_cli(["mod.py"], tmp_path)
    assert status == 1 and out.startswith("mod.py:2:22: KVG101 drop_blocks() gets a torch.Tensor")


@pytest.mark.parametrize(
    "pyproject,message",
    [
        ("[tool.kvguard]\nfree-names = 3\n", "expected a list of names, got 3"),
        (
            "[tool.kvguard]\nfree-names = ['not a name']\n",
            "'not a name' is not a (dotted) Python name",
        ),
        ("[tool.kvguard\n", "invalid TOML"),
    ],
)
def test_bad_configuration_is_one_line(tmp_path, pyproject, message):
    write_project(tmp_path, {"pyproject.toml": pyproject, "mod.py": BAD})
    status, out, err = run_cli(["mod.py"], tmp_path)
    assert status == 2 and out == ""
    assert message in err and err.count("\n") == 1 and err.startswith("kvguard lint: error: ")


def test_fix_rewrites_in_place_and_is_idempotent(tmp_path):
    source = BAD.replace(
        "allocator.free(ids)\n",
        "allocator.free(ids)  # keep me\n    allocator.free(ids.view(-1)[0])\n",
    )
    source += "    allocator.free(ids[1:])  # noqa: KVG101\n"
    write_project(tmp_path, {"mod.py": source})
    path = tmp_path / "mod.py"
    status, out, err = run_cli(["--fix", "mod.py"], tmp_path)
    assert err == "kvguard lint: applied 2 fixes\n"
    assert path.read_text().splitlines()[4:] == [
        "    allocator.free(ids.tolist())  # keep me",
        "    allocator.free(int(ids.view(-1)[0]))",
        "    allocator.free(ids[1:])  # noqa: KVG101",
    ]
    assert (status, out) == (0, "")
    before = path.read_bytes()
    assert run_cli(["--fix", "mod.py"], tmp_path) == (0, "", "")
    assert path.read_bytes() == before


def test_fix_keeps_crlf_and_encoding_and_reports_what_remains(tmp_path):
    source = "# -*- coding: latin-1 -*-\n# caf\xe9\n" + BAD + "    allocator.free(True)\n"
    write_project(tmp_path, {})
    path = tmp_path / "mod.py"
    path.write_bytes(source.replace("\n", "\r\n").encode("latin-1"))
    status, out, err = run_cli(["--fix", "mod.py"], tmp_path)
    assert status == 1 and out.startswith("mod.py:8:20: KVG103")
    data = path.read_bytes()
    assert b"allocator.free(ids.tolist())\r\n" in data and b"caf\xe9\r\n" in data
    assert data.count(b"\r\n") == data.count(b"\n")


def test_fix_only_selected_codes(tmp_path):
    write_project(tmp_path, {"mod.py": BAD + "    allocator.free(ids.flatten()[0])\n"})
    run_cli(["--fix", "--select", "KVG106", "mod.py"], tmp_path)
    text = (tmp_path / "mod.py").read_text()
    assert "allocator.free(ids)\n" in text and "allocator.free(int(ids.flatten()[0]))" in text


def test_python_dash_m_and_help(tmp_path):
    write_project(tmp_path, {"bad.py": BAD})
    done = subprocess.run(
        [sys.executable, "-m", "flake8_kvguard", "bad.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1 and done.stdout.startswith("bad.py:5:20: KVG101")
    done = subprocess.run(
        [sys.executable, "-m", "flake8_kvguard", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "--fix" in done.stdout and "--select" in done.stdout


def test_main_accepts_argv_list():
    assert cli.main(["--select", "KVG101", str(REPO / "flake8_kvguard" / "cli.py")]) == 0
