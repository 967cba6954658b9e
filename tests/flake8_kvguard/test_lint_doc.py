"""docs/lint.md: its configuration examples are valid and mean what it says."""

import re

from flake8_kvguard import config

from .helpers import REPO, run_cli, write_project

LINT_MD = (REPO / "docs" / "lint.md").read_text()


def _block(language, marker):
    blocks = re.findall(rf"```{language}\n(.*?)```", LINT_MD, re.S)
    return next(block for block in blocks if marker in block)


def test_configuration_examples(tmp_path):
    source = (
        "def f(pool, table, allocator, ids) -> None:\n"
        "    pool.drop_blocks(table.block_table.row())\n"
    )
    for name, text in (
        ("pyproject.toml", _block("toml", "[tool.kvguard]")),
        ("setup.cfg", _block("ini", "[flake8]")),
    ):
        root = write_project(tmp_path / name, {name: text, "mod.py": source})
        loaded = config.project_config(str(root))
        assert "drop_blocks" in loaded.free_names and "free" in loaded.free_names
        assert loaded.tensor_native == {"token_to_kv_pool_allocator.free"}
        status, out, err = run_cli(["mod.py"], root)
        assert (status, err) == (1, "") and ": KVG101 drop_blocks()" in out


def test_ruff_external_and_codes_are_documented():
    assert 'external = ["KVG"]' in LINT_MD
    for code in ("KVG101", "KVG102", "KVG103", "KVG104", "KVG105", "KVG106", "KVG201", "KVG202",
                 "KVG203", "KVG204"):
        assert f"| {code} |" in LINT_MD
