"""The textual pre-filter: what it lets through, and that it never hides a finding."""

import subprocess
import sys

import pytest

from flake8_kvguard import config, engine, index
from flake8_kvguard.prefilter import Prefilter, _has_container

from .helpers import FIXTURES, REPO

PREFILTER = Prefilter(config.DEFAULT)


@pytest.mark.parametrize(
    "text,wanted",
    [
        ("alloc.free(ids)", True),
        ("free (ids)", True),
        ("x.free_blocks(\n    ids)", True),
        ("alloc.free()", False),
        ("lock.release( )", False),
        ("def free(self):", False),
        ("def free_blocks(self) -> int:", False),
        ("def free(self, blocks):", True),
        ("my_free(ids)", False),
        ("freed(ids)", False),
    ],
)
def test_free_calls(text, wanted):
    assert PREFILTER.has_free_call(text) is wanted


@pytest.mark.parametrize(
    "text,wanted",
    [
        ("s = set(x)", True),
        ("s = frozenset(x)", True),
        ("collections.Counter(x)", True),
        ("d = collections.defaultdict(list)", True),
        ("dict.fromkeys(x)", True),
        ("{b for b in ids}", True),
        ("{b: i for b, i in pairs}", True),
        ("event.set()", False),
        ("reset(x)", False),
        ("d = {}", False),
        ("x: Dict[int, int]", False),
        ('f"{x}" for y in z', False),
    ],
)
def test_containers(text, wanted):
    assert _has_container(text) is wanted


def test_configured_names_extend_the_filter():
    custom = Prefilter(config.Config(free_names=config.DEFAULT.free_names | {"drop_pages"}))
    assert custom.has_free_call("pool.drop_pages(ids)")
    assert not PREFILTER.has_free_call("pool.drop_pages(ids)")


def test_index_names_count_as_tensor_sources():
    text = "def f(seq):\n    return set(seq.all_block_ids())\n"
    assert not PREFILTER.may_hold_findings(text, index.EMPTY)
    project_index = index.ProjectIndex([{"r": {"all_block_ids": "t"}, "p": []}])
    assert PREFILTER.may_hold_findings(text, lambda: project_index)
    assert [f.code for f in engine.lint_source(text, config.DEFAULT, project_index)] == ["KVG105"]


def test_never_hides_a_finding_on_the_fixtures_and_this_repository():
    paths = list(FIXTURES.glob("*/*/*.py")) + list((REPO / "flake8_kvguard").rglob("*.py"))
    for path in paths:
        source = path.read_text()
        with_filter = engine.lint_source(source, config.DEFAULT, index.EMPTY)
        without = engine.lint_source(source, config.DEFAULT, index.EMPTY, use_prefilter=False)
        assert [f.key() for f in with_filter] == [f.key() for f in without], path


def test_plugin_import_and_rejected_files_do_not_load_libcst(tmp_path):
    script = (
        "import sys\n"
        "from flake8_kvguard.plugin import KVGChecker\n"
        "assert 'libcst' not in sys.modules\n"
        "lines = ['import torch\\n', 'x = torch.zeros(3)\\n', 'print(x.sum())\\n']\n"
        "assert list(KVGChecker(None, lines, 'mod.py').run()) == []\n"
        "assert 'libcst' not in sys.modules, 'a file without candidates was parsed'\n"
        "found = list(KVGChecker(None, ['alloc.free(True)\\n'], 'mod.py').run())\n"
        "assert [f[:2] for f in found] == [(1, 11)], found\n"
        "assert 'libcst' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
