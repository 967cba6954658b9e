"""The textual pre-filter: what it lets through, and that it never hides a finding."""

import subprocess
import sys

import pytest

from flake8_kvguard import config, engine, index
from flake8_kvguard.prefilter import Prefilter, has_container

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
        ("allocator.\uff46ree(ids)", True),  # Python reads the name NFKC-normalized: free
        ("allocator.\uff46reed(ids)", False),
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
        ("s = \uff53et(x)", True),
        ("# \u00fcber: reset(x)", False),
    ],
)
def test_containers(text, wanted):
    assert has_container(text) is wanted


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
        "assert 'flake8_kvguard.engine' not in sys.modules, 'a file without candidates was parsed'\n"
        "found = list(KVGChecker(None, ['alloc.free(True)\\n'], 'mod.py').run())\n"
        "assert [f[:2] for f in found] == [(1, 11)], found\n"
        "assert 'flake8_kvguard.engine' in sys.modules\n"
        "assert 'libcst' not in sys.modules, 'detection imported libcst'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr



DETECTION_PROJECT = {
    "setup.cfg": "[metadata]\nname = example\n",
    "mod.py": (
        "import torch\n"
        "def drop(alloc, n):\n"
        "    ids = torch.arange(n)\n"
        "    alloc.free(ids)\n"
        "    seen = set(ids)\n"
    ),
}
_MODULES_AFTER = (
    "import sys\n"
    "sys.argv = {argv!r}\n"
    "from {module} import main\n"
    "try:\n"
    "    status = main({args!r})\n"
    "except SystemExit as exc:\n"
    "    status = exc.code\n"
    "print(status, 'libcst' in sys.modules, 'flake8_kvguard.engine' in sys.modules)\n"
)


@pytest.mark.parametrize(
    "module,args,wanted",
    [
        ("flake8.main.cli", ["-j1", "--select", "KVG", "mod.py"], "1 False True"),
        ("kvguard.cli", ["lint", "mod.py"], "1 False True"),
        ("kvguard.cli", ["lint", "--fix", "mod.py"], "0 True True"),
    ],
)
def test_detection_never_imports_libcst(tmp_path, module, args, wanted):
    """flake8 and `kvguard lint` analyze on Python's own `ast`: only `--fix` loads libcst
    (its import alone costs 0.2-0.3 s)."""
    for name, text in DETECTION_PROJECT.items():
        (tmp_path / name).write_text(text)
    script = _MODULES_AFTER.format(argv=[module], module=module, args=args)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split("\n")[-2] == wanted, done.stdout + done.stderr


SLICED = '''\
import torch


@decorator
def unrelated(x):
    return torch.zeros(x)


class Holder:
    ids: torch.Tensor

    def __init__(self):
        self.seen = set()

    def check(self):
        for b in self.ids:
            if b in self.seen:
                pass


def dedup(t: torch.Tensor):
    return set(t)
'''


def test_slicing_blanks_what_cannot_hold_kvg105_and_keeps_positions():
    from flake8_kvguard import slicing

    reduced = slicing.reduce(SLICED)
    assert reduced is not None and len(reduced.splitlines()) == len(SLICED.splitlines())
    assert "unrelated" not in reduced and "@decorator" not in reduced
    assert "class Holder" in reduced and "def dedup" in reduced
    full = engine.lint_source(SLICED, config.DEFAULT, index.EMPTY, use_prefilter=False)
    fast = engine.lint_source(SLICED, config.DEFAULT, index.EMPTY)
    assert [f.key() for f in fast] == [f.key() for f in full]
    assert [(f.line, f.code) for f in full] == [(17, "KVG105"), (22, "KVG105")]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nSEEN = set()\ndef f(t: torch.Tensor):\n    return t[0] in SEEN\n",
        "import torch\ndef set(x):\n    return x\ndef f(t: torch.Tensor):\n    return set(t)\n",
        "import torch\ndef f(t: torch.Tensor):\n    return set(t)\n",
        "import torch\ndef f(:\n",
    ],
)
def test_slicing_keeps_whole_files_when_needed(source):
    from flake8_kvguard import slicing

    assert slicing.reduce(source) is None


@pytest.mark.parametrize(
    "source, code",
    [
        ("def abort(allocator, ids):\n    allocator.\uff46ree(ids)\n    allocator.\uff46ree(ids)\n",
         "KVG104"),
        ("import torch\ndef unique_blocks(t: torch.Tensor) -> int:\n    return len(\uff53et(t))\n",
         "KVG105"),
        ("import torch\ndef unique_blocks(n) -> int:\n    return len(set(\uff54orch.arange(n)))\n",
         "KVG105"),
    ],
)
def test_names_written_in_another_unicode_form_pass_the_filter(source, code):
    """Python reads identifiers NFKC-normalized, so `\uff46ree` is `free`: the filter reads
    the normalized text too, and never hides a finding such a name makes."""
    found = engine.lint_source(source, config.DEFAULT, index.EMPTY)
    assert code in {f.message.split()[0] for f in found}
    unfiltered = engine.lint_source(source, config.DEFAULT, index.EMPTY, use_prefilter=False)
    assert [(f.line, f.col, f.message) for f in found] == [
        (f.line, f.col, f.message) for f in unfiltered]
